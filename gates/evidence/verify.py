"""Reading evidence back: what it is (a directory of regular files the manifest lists), who wrote it (the
signature, where a key is configured), what it says (bundle.json against the schema, each gate's numbers
against its own status) and whether it still describes this tree (the covered sources).

    verify_bundle(path) -> list[str]      every problem with one bundle; [] when it can be trusted
    verify_tree(path) -> dict[Path, list]  the same for every bundle under a directory
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import ValidationError

from gates.core.registry import registered
from gates.core.sources import HARNESS_DIRS, REPO_ROOT, resolve, sha256_file
from gates.evidence import decode
from gates.evidence.bundle import BUNDLE_FILE, MANIFEST_FILE, Bundle, is_regular, load_bundle, parse_bundle
from gates.evidence.signing import SIGNATURE_FILE, signature_problems
from kernels.contract import Contract

SHA256 = re.compile(r"[0-9a-f]{64}")
UNLISTED = (MANIFEST_FILE, SIGNATURE_FILE)  # the manifest cannot list itself, nor the signature made over it


def find_bundles(path: Path) -> list[Path]:
    """Bundle directories at or under `path` (temporary directories of unfinished writes skipped)."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file() or (path / BUNDLE_FILE).is_file():
        return [path]
    found = {p.parent for p in path.rglob(MANIFEST_FILE)} | {p.parent for p in path.rglob(BUNDLE_FILE)}
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts))


def _listed(manifest: Path) -> dict[str, str] | None:
    """The manifest's {file name: sha256}, or None when it is not a manifest."""
    try:
        files = json.loads(manifest.read_text()).get("files")
    except (ValueError, AttributeError):
        return None
    if not isinstance(files, dict) or not all(isinstance(name, str) and isinstance(digest, str)
                                              and SHA256.fullmatch(digest) for name, digest in files.items()):
        return None
    return files


def _is_file_name(name: str) -> bool:
    """A name of a file directly inside the bundle directory (no separator, no `..`, not absolute)."""
    return name not in ("", ".", "..", *UNLISTED) and not any(c in name for c in "/\\\0")


def check_integrity(directory: Path) -> list[str]:
    """The bundle is a directory of regular files; the manifest lists each of them but itself and the signature,
    with its sha256, and nothing else is there."""
    if directory.is_symlink():
        return [f"{directory}: a symbolic link; a bundle is a directory of regular files"]
    manifest = directory / MANIFEST_FILE
    if manifest.is_symlink():
        return [f"{manifest}: a symbolic link, not a file of the bundle"]
    if not manifest.is_file():
        return [f"{manifest}: missing: the bundle has no manifest"]
    listed = _listed(manifest)
    if listed is None:
        return [f"{manifest}: not a manifest (expected JSON with a 'files' mapping of file names to sha256 digests)"]
    problems = []
    for name, digest in listed.items():
        path = directory / name
        if not _is_file_name(name):
            problems.append(f"{manifest}: lists {name!r}, which is not the name of a file in the bundle directory")
        elif path.is_symlink():
            problems.append(f"{path}: a symbolic link, not a file of the bundle")
        elif not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing")
        elif sha256_file(path) != digest:
            problems.append(f"{path}: modified after the bundle was written (sha256 differs from the manifest)")
    problems += [f"{entry}: not in the manifest" for entry in sorted(directory.iterdir())
                 if entry.name not in listed and entry.name not in UNLISTED]
    return problems


def check_signature(directory: Path, key: bytes | None, required: bool) -> list[str]:
    """The signature against `key`: a wrong one is always a problem, a missing one when `required` (which needs
    the key); without a key a signature cannot be checked, and is not."""
    signature, manifest = directory / SIGNATURE_FILE, directory / MANIFEST_FILE
    if signature.is_symlink():
        return [f"{signature}: a symbolic link, not a file of the bundle"]
    if not signature.exists():
        return [f"{signature}: missing: the bundle is not signed"] if required else []
    if key is None or not is_regular(manifest):  # no key to check with, or no manifest (check_integrity says so)
        return []
    return signature_problems(manifest.read_bytes(), signature, key)


def contradictions(bundle: Bundle) -> list[str]:
    """What each gate's result says that its own numbers contradict (each gate audits its own details)."""
    audits = {gate.name: gate.audit for gate in registered()}
    return [f"{result.gate}: {problem}" for result in bundle.gates if result.gate in audits
            for problem in audits[result.gate](result)]


def unlisted_bundle_device(bundle: Bundle) -> list[str]:
    """The GPU that made the bundle, where its contract validates the bundle's arch on other devices only: one arch
    spans devices of different memories (an H100 and an H200 are both sm_90), so evidence from one does not
    validate another. An arch the contract only declares, or a CPU, is not checked: no device is claimed there."""
    if bundle.arch == "cpu":
        return []
    device = bundle.environment.device_name
    return [f"made on {device} but the contract lists {', '.join(hw.devices)} for {bundle.arch} under "
            "hardware.validated" for hw in Contract.model_validate(bundle.contract).hardware.validated
            if hw.arch == bundle.arch and device not in hw.devices]


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


def verify_bundle(directory: Path, root: Path = REPO_ROOT, key: bytes | None = None,
                  require_signature: bool = False) -> list[str]:
    """Every reason not to trust the bundle at `directory`: broken integrity, a wrong signature (or a missing one,
    with `require_signature`), a bundle.json that breaks the schema or whose gates contradict their own numbers,
    a GPU its contract does not validate the arch on, stale sources. Its verdict is not judged here: a trustworthy
    bundle may record a failure."""
    directory = Path(directory)
    problems = check_integrity(directory) + check_signature(directory, key, require_signature)
    path = directory / BUNDLE_FILE
    if path.is_symlink():
        return problems  # check_integrity names it; a link is never followed
    if decode.is_decode_bundle(directory):  # measurements, no verdict: integrity, signature and freshness only
        try:
            return problems + [f"{directory}: {p}" for p in decode.check_freshness(decode.load(directory), root)]
        except ValueError as e:
            return problems + [off_schema(path, e)]
    try:
        bundle = parse_bundle(path.read_text())
    except FileNotFoundError:
        return problems + [f"{path}: missing"]
    except ValueError as e:
        return problems + [off_schema(path, e)]
    return (problems + [f"{path}: {p}" for p in contradictions(bundle) + unlisted_bundle_device(bundle)]
            + [f"{directory}: {p}" for p in check_freshness(bundle, root)])


def off_schema(path: Path, e: ValueError) -> str:
    """One line for a bundle.json parse_bundle refused: not JSON, a number that is not finite, off the schema."""
    if not isinstance(e, ValidationError):
        return f"{path}: not a bundle ({e})"
    found = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:3])
    return f"{path}: does not follow the bundle schema ({found})"


def judged_by_other_gate_code(directory: Path, current: str) -> str | None:
    """A note when the bundle was judged by gate code other than `current` (this tree's harness_digest); not a
    reason to distrust it."""
    try:
        recorded = load_bundle(directory).harness
    except (OSError, ValueError):
        return None
    if recorded == current:
        return None
    return (f"judged by gate code ({', '.join(HARNESS_DIRS)}) that differs from this tree's" if recorded else
            "made before bundles recorded the gate code that judged them") + "; `k3forge gate` re-judges it"


def verify_tree(path: Path, root: Path = REPO_ROOT, key: bytes | None = None,
                require_signature: bool = False) -> dict[Path, list[str]]:
    return {directory: verify_bundle(directory, root, key, require_signature) for directory in find_bundles(path)}
