"""The evidence index: evidence/index.json and index.md, one row per bundle, written after every gate run."""

from __future__ import annotations

import json
from pathlib import Path

from gates.core.sources import REPO_ROOT, relative
from gates.evidence.bundle import load_bundle
from gates.evidence.report import render_index
from gates.evidence.verify import find_bundles

INDEX_JSON, INDEX_MD = "index.json", "index.md"


def index_rows(evidence_dir: Path, root: Path = REPO_ROOT) -> list[dict]:
    rows = []
    for directory in find_bundles(evidence_dir):
        try:
            bundle = load_bundle(directory)
        except (OSError, ValueError):
            continue
        rows.append({
            "op": bundle.op, "arch": bundle.arch, "verdict": bundle.verdict.value, "created": bundle.created,
            "commit": bundle.git.commit, "dirty": bundle.git.dirty, "path": relative(directory, root),
            "report": f"{directory.relative_to(evidence_dir).as_posix()}/report.html",
            "gates": {g.gate: g.status.value for g in bundle.gates},
        })
    return sorted(rows, key=lambda r: (r["op"], r["arch"]))


def write_index(evidence_dir: Path, root: Path = REPO_ROOT) -> list[dict]:
    rows = index_rows(evidence_dir, root)
    evidence_dir.mkdir(parents=True, exist_ok=True)
    (evidence_dir / INDEX_JSON).write_text(json.dumps({"bundles": rows}, indent=2) + "\n")
    (evidence_dir / INDEX_MD).write_text(render_index(rows))
    return rows
