"""Reading evidence back: integrity (the manifest) and freshness (the covered sources against the tree).

    verify_bundle(path) -> list[str]      every problem with one bundle; [] when intact and fresh
    verify_tree(path) -> dict[Path, list]  the same for every bundle under a directory
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from gates.core.sources import HARNESS_DIRS, REPO_ROOT, resolve, sha256_file
from gates.evidence import decode
from gates.evidence.bundle import BUNDLE_FILE, MANIFEST_FILE, Bundle, load_bundle


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
    if decode.is_decode_bundle(directory):
        try:
            return problems + [f"{directory}: {p}" for p in decode.check_freshness(decode.load(directory), root)]
        except ValidationError as e:
            return problems + [off_schema(directory / BUNDLE_FILE, e)]
    try:
        bundle = load_bundle(directory)
    except FileNotFoundError:
        return problems + [f"{directory / BUNDLE_FILE}: missing"]
    except ValidationError as e:
        return problems + [off_schema(directory / BUNDLE_FILE, e)]
    return problems + [f"{directory}: {p}" for p in check_freshness(bundle, root)]


def off_schema(path: Path, e: ValidationError) -> str:
    found = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:3])
    return f"{path}: does not follow the bundle schema ({found})"


def judged_by_other_gate_code(directory: Path, current: str) -> str | None:
    """A note when the bundle was judged by gate code other than `current` (this tree's harness_digest); not a
    reason to distrust it."""
    try:
        recorded = load_bundle(directory).harness
    except (FileNotFoundError, ValidationError):
        return None
    if recorded == current:
        return None
    return (f"judged by gate code ({', '.join(HARNESS_DIRS)}) that differs from this tree's" if recorded else
            "made before bundles recorded the gate code that judged them") + "; `k3forge gate` re-judges it"


def verify_tree(path: Path, root: Path = REPO_ROOT) -> dict[Path, list[str]]:
    return {directory: verify_bundle(directory, root) for directory in find_bundles(path)}
