"""The evidence bundle: `evidence/<op>/<arch>/`, a directory of regular files: bundle.json, report.md,
report.html, manifest.json and, where a signing key is configured, signature.json (gates.evidence.signing).

bundle.json follows the versioned `Bundle` schema: what was checked (the commit, and the sha256 of every source
file the contract covers), where (the environment), how (the gate options and seed) and what every gate
found; every number in it is finite. manifest.json holds the sha256 of each other file. A bundle is staged in
a hidden directory next to its place and swapped in, so a failed or interrupted write leaves the previous
bundle or the new one, never half of either (write_bundle).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gates.core.machine import Environment
from gates.core.registry import GateOptions, registered, unjudged, verdict_of
from gates.core.sources import REPO_ROOT, import_closure, module_file, relative, sha256_file
from gates.core.status import GateResult, Status, worst
from gates.evidence.signing import SIGNATURE_FILE, signature_text
from kernels.contract import Contract

SCHEMA_VERSION = 3
BUNDLE_FILE, MANIFEST_FILE = "bundle.json", "manifest.json"
# loaded: a repository file a candidate's process loaded at run time that no import statement names (importlib)
SOURCE_ROLES = ("contract", "problem", "implementation", "reference", "standard", "dependency", "loaded")


class SourceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="relative to the repository root")
    roles: list[Literal[SOURCE_ROLES]]  # type: ignore[valid-type]
    sha256: str


class GitState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    commit: str | None
    branch: str | None
    dirty: bool | None = Field(description="uncommitted changes outside evidence/ when the gates ran")


class Bundle(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # 3: the verdict means judged (gates.core.registry.verdict_of); 2 (read, never written): the worst status of the
    # gates that ran, so PASSED beside a NOT_RUN gate
    schema_version: Literal[2, 3] = SCHEMA_VERSION
    op: str
    arch: str = Field(description="the machine the gates ran on: sm_90, ..., or cpu")
    created: str
    command: str
    git: GitState
    contract_path: str
    contract: dict
    owners: list[str]
    sources: list[SourceFile]
    environment: Environment
    options: GateOptions
    harness: str | None = Field(default=None, description="sha256 of the gate code that judged (gates.core.sources."
                                                        "harness_digest); None in bundles made before it was recorded")
    gates: list[GateResult]
    verdict: Status = Field(description="PASSED only when every gate that applies on this arch ran and passed; "
                                        "else the worst failure, or NOT_RUN (not judged)")

    @model_validator(mode="after")
    def _verdict_follows_the_gates(self) -> "Bundle":
        if self.schema_version == 2:
            expected = worst(g.status for g in self.ran) if self.ran else Status.NOT_RUN
        else:
            expected = verdict_of(Contract.model_validate(self.contract), self.arch, self.gates)
        if self.verdict is not expected:
            raise ValueError(f"verdict {self.verdict.value} does not follow from the gates' statuses "
                             f"({expected.value})")
        return self

    @property
    def not_required(self) -> set[str]:
        """The gates that do not apply to this contract on this arch: not judged here, and not needed to pass."""
        contract = Contract.model_validate(self.contract)
        return {g.name for g in registered() if g.inapplicable(contract, self.arch)}

    @property
    def unjudged(self) -> list[str]:
        """The gates that apply on this arch and did not pass: why the verdict is not PASSED."""
        return unjudged(Contract.model_validate(self.contract), self.arch, self.gates)

    @property
    def ran(self) -> list[GateResult]:
        return [g for g in self.gates if g.status is not Status.NOT_RUN]

    @property
    def not_run(self) -> list[GateResult]:
        return [g for g in self.gates if g.status is Status.NOT_RUN]

    @property
    def flags(self) -> list[str]:
        return [f for g in self.gates for f in g.flags]


def covered_sources(contract: Contract, contract_path: Path, problem_file: Path | None,
                    root: Path = REPO_ROOT, loaded: list[str] = ()) -> list[SourceFile]:
    """The contract, the problem file, every repository file the implementation, reference and standard import,
    and the repository files (relative paths) their processes `loaded` while the gates ran them, dynamic imports
    included. Each file's roles: what the contract names it as, `dependency` for a file one of those imports, or
    `loaded` for one only the run revealed. The gate harness itself (the rest of gates/) is versioned by the
    commit, not by the evidence."""
    named = {contract_path.resolve(): {"contract"}}
    if problem_file is not None:
        named[problem_file.resolve()] = {"problem"}
    closures = []
    for role in ("implementation", "reference", "standard"):
        module = getattr(contract, role).partition(":")[0]
        closures.append(import_closure([module], root))
        own = module_file(module, root)
        if own is not None:
            named.setdefault(own, set()).add(role)
    imported = {p for closure in closures for p in closure}
    run = {(root / rel).resolve() for rel in loaded} - imported - set(named)
    order = {r: i for i, r in enumerate(SOURCE_ROLES)}
    files = [SourceFile(path=relative(p, root),
                        roles=sorted(named.get(p, {"loaded" if p in run else "dependency"}), key=order.get),
                        sha256=sha256_file(p)) for p in set(named) | imported | run if p.is_file()]
    return sorted(files, key=lambda f: (order[f.roles[0]], f.path))


def git_state(root: Path = REPO_ROOT) -> GitState:
    """The checkout's state, or the commit a runner names in K3FORGE_COMMIT (a GPU runner's copy of the working
    tree, whose repository, if any, is not that tree's history: branch and dirty flag unknown). Informative
    only: freshness rests on the sources' hashes."""
    declared = os.environ.get("K3FORGE_COMMIT")
    if declared:
        return GitState(commit=declared, branch=None, dirty=None)
    try:
        import git

        repo = git.Repo(root, search_parent_directories=True)
    except Exception:  # not a checkout (an installed wheel, an exported tree)
        return GitState(commit=None, branch=None, dirty=None)
    commit = repo.head.commit.hexsha if repo.head.is_valid() else None
    branch = None if repo.head.is_detached else repo.active_branch.name
    dirty = bool(repo.git.status("--porcelain", "--", ".", ":(exclude)evidence"))
    return GitState(commit=commit, branch=branch, dirty=dirty)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def is_regular(path: Path) -> bool:
    """A regular file, not a symbolic link: all a bundle may hold (a link could point anywhere)."""
    return path.is_file() and not path.is_symlink()


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a bundle may hold")


def parse_bundle(text: str) -> Bundle:
    """A bundle from the text of its bundle.json; ValueError (pydantic's ValidationError among them) when the
    text is not JSON, holds a NaN or an infinity (pydantic writes those as null), or breaks the schema."""
    return Bundle.model_validate(json.loads(text, parse_float=_finite, parse_constant=_no_constant))


def load_bundle(directory: Path) -> Bundle:
    return parse_bundle((Path(directory) / BUNDLE_FILE).read_text())


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o644)


def _stage(directory: Path, files: dict[str, str], key: bytes | None) -> Path:
    """The bundle's files, its manifest and (with a key) its signature, written and synced in a hidden sibling
    of `directory`."""
    staged = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        for name, text in files.items():
            _write_durably(staged / name, text)
        digests = {name: sha256_file(staged / name) for name in sorted(files)}
        manifest_text = json.dumps({"schema_version": SCHEMA_VERSION, "files": digests}, indent=2) + "\n"
        _write_durably(staged / MANIFEST_FILE, manifest_text)
        if key is not None:
            _write_durably(staged / SIGNATURE_FILE, signature_text(manifest_text.encode(), key))
        os.chmod(staged, 0o755)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def repair_interrupted_write(directory: Path) -> None:
    """Undo what a write killed outright (no exception handler ran) left beside `directory`: the previous bundle
    moved aside between the two renames goes back, staged and replaced copies go."""
    for aside in sorted(directory.parent.glob(f".{directory.name}.old-*")):
        if (aside / "bundle").is_dir() and not directory.exists():
            os.replace(aside / "bundle", directory)
        shutil.rmtree(aside, ignore_errors=True)
    for staged in directory.parent.glob(f".{directory.name}.tmp-*"):
        shutil.rmtree(staged, ignore_errors=True)


def write_bundle(directory: Path, bundle: Bundle, reports: dict[str, str], key: bytes | None = None) -> Path:
    """Write bundle.json, the rendered reports ({file name: text}), manifest.json and, with `key`, signature.json
    into `directory`, replacing the bundle there.

    The new files are staged beside it, then two renames move the previous bundle aside and the new one in. An
    exception at any step (Ctrl-C included) leaves the previous bundle in place, or the new one once its rename
    is done; a write killed between the renames is repaired by the next write to the same place."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    repair_interrupted_write(directory)
    staged = _stage(directory, {BUNDLE_FILE: bundle.model_dump_json(indent=2) + "\n", **reports}, key)
    aside = None
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
        if directory.exists():
            os.replace(directory, aside / "bundle")
        os.replace(staged, directory)
    except BaseException:
        if aside is not None and (aside / "bundle").exists() and not directory.exists():
            os.replace(aside / "bundle", directory)
        raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    _sync_directory(directory.parent)
    return directory
