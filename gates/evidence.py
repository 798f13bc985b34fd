"""Reading evidence back: integrity (the manifest), freshness (the covered sources against the tree), the index.

    verify_bundle(path) -> list[str]      every problem with one bundle; [] when intact and fresh
    verify_tree(path) -> dict[Path, list]  the same for every bundle under a directory
    write_index(evidence_dir)              evidence/index.json and index.md, one row per bundle
    rerender(path) -> list[str]            a bundle's reports again from its bundle.json, with this tree's templates
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from gates.bundle import BUNDLE_FILE, MANIFEST_FILE, Bundle, load_bundle, write_bundle
from gates.report import render_index, render_reports
from gates.sources import REPO_ROOT, relative, resolve, sha256_file

INDEX_JSON, INDEX_MD = "index.json", "index.md"


def find_bundles(path: Path) -> list[Path]:
    """Bundle directories at or under `path` (temporary directories of unfinished writes skipped)."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file() or (path / BUNDLE_FILE).is_file():
        return [path]
    found = {p.parent for p in path.rglob(MANIFEST_FILE)} | {p.parent for p in path.rglob(BUNDLE_FILE)}
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts))


def check_integrity(directory: Path) -> list[str]:
    """Each file the manifest lists exists with its sha256, and nothing else is in the bundle."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing: the bundle has no manifest"]
    try:
        listed = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{manifest_path}: not a manifest (expected JSON with a 'files' mapping)"]
    problems = []
    for name, digest in listed.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing")
        elif sha256_file(path) != digest:
            problems.append(f"{path}: modified after the bundle was written (sha256 differs from the manifest)")
    extra = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST_FILE and p.name not in listed)
    problems += [f"{directory / name}: not in the manifest" for name in extra]
    return problems


def check_freshness(bundle: Bundle, root: Path = REPO_ROOT) -> list[str]:
    """Each covered source file still has the sha256 the bundle recorded."""
    problems = []
    for source in bundle.sources:
        path = resolve(source.path, root)
        if not path.is_file():
            problems.append(f"stale: {source.path} ({', '.join(source.roles)}) no longer exists")
        elif (digest := sha256_file(path)) != source.sha256:
            problems.append(f"stale: {source.path} ({', '.join(source.roles)}) changed since the evidence was made "
                            f"(recorded {source.sha256[:12]}, now {digest[:12]})")
    return problems


def verify_bundle(directory: Path, root: Path = REPO_ROOT) -> list[str]:
    """Every reason not to trust the bundle at `directory`: broken integrity, unreadable schema, stale sources."""
    directory = Path(directory)
    problems = check_integrity(directory)
    try:
        bundle = load_bundle(directory)
    except FileNotFoundError:
        return problems + [f"{directory / BUNDLE_FILE}: missing"]
    except ValidationError as e:
        return problems + [_off_schema(directory / BUNDLE_FILE, e)]
    return problems + [f"{directory}: {p}" for p in check_freshness(bundle, root)]


def _off_schema(path: Path, e: ValidationError) -> str:
    found = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:3])
    return f"{path}: does not follow the bundle schema ({found})"


def rerender(directory: Path) -> list[str]:
    """Render the reports of the bundle at `directory` again from its bundle.json with this tree's templates,
    atomically; nothing measured or judged changes. Refused (the reasons returned, nothing written) unless the
    bundle is intact and this schema writes its bundle.json back byte for byte."""
    directory = Path(directory)
    if problems := check_integrity(directory):
        return problems
    path = directory / BUNDLE_FILE
    text = path.read_text()
    try:
        bundle = Bundle.model_validate_json(text)
    except ValidationError as e:
        return [_off_schema(path, e)]
    if bundle.model_dump_json(indent=2) + "\n" != text:
        return [f"{path}: this tree's bundle schema would not write it back unchanged; re-run the gate instead"]
    write_bundle(directory, bundle, render_reports(bundle))
    return []


def judged_by_other_gate_code(directory: Path, current: str) -> str | None:
    """A note when the bundle was judged by gate code other than `current` (this tree's harness_digest); not a
    reason to distrust it."""
    try:
        recorded = load_bundle(directory).harness
    except (FileNotFoundError, ValidationError):
        return None
    if recorded == current:
        return None
    return ("judged by gate code that differs from this tree's (gates/, kernels/)" if recorded else
            "made before bundles recorded the gate code that judged them") + "; `k3forge gate` re-judges it"


def verify_tree(path: Path, root: Path = REPO_ROOT) -> dict[Path, list[str]]:
    return {directory: verify_bundle(directory, root) for directory in find_bundles(path)}


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
