"""The evidence bundle: `evidence/<op>/<arch>/` with bundle.json, report.md, report.html and manifest.json.

bundle.json follows the versioned `Bundle` schema: what was checked (the commit, and the sha256 of every source
file the contract covers), where (the environment), how (the gate options and seed) and what every gate
found. manifest.json holds the sha256 of each other file. A bundle is written into a temporary directory next
to its place and renamed into it, so a failed or interrupted run never leaves half a bundle.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gates.core.machine import Environment
from gates.core.registry import GateOptions
from gates.core.sources import REPO_ROOT, import_closure, module_file, relative, sha256_file
from gates.core.status import GateResult, Status, worst
from kernels.contract import Contract

SCHEMA_VERSION = 2
BUNDLE_FILE, MANIFEST_FILE = "bundle.json", "manifest.json"
SOURCE_ROLES = ("contract", "problem", "implementation", "reference", "standard", "dependency")


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

    schema_version: Literal[2] = SCHEMA_VERSION
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
    verdict: Status = Field(description="the worst status of any gate that ran (NOT_RUN when none ran)")

    @model_validator(mode="after")
    def _verdict_follows_the_gates(self) -> "Bundle":
        if self.verdict is not worst(g.status for g in self.gates):
            raise ValueError(f"verdict {self.verdict.value} does not follow from the gates' statuses")
        return self

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
                    root: Path = REPO_ROOT) -> list[SourceFile]:
    """The contract, the problem file, and every repository file the implementation, reference and standard
    import. Each file's roles: what the contract names it as, or `dependency` for a file one of those imports.
    The gate harness itself (the rest of gates/) is versioned by the commit, not by the evidence."""
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
    paths = set(named) | {p for closure in closures for p in closure}
    order = {r: i for i, r in enumerate(SOURCE_ROLES)}
    files = [SourceFile(path=relative(p, root), roles=sorted(named.get(p, {"dependency"}), key=order.get),
                        sha256=sha256_file(p)) for p in paths]
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


def write_bundle(directory: Path, bundle: Bundle, reports: dict[str, str]) -> Path:
    """Write bundle.json, the rendered reports ({file name: text}) and manifest.json into `directory`, atomically."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        files = {BUNDLE_FILE: bundle.model_dump_json(indent=2) + "\n", **reports}
        for name, text in files.items():
            (tmp / name).write_text(text)
        manifest = {"schema_version": SCHEMA_VERSION, "files": {name: sha256_file(tmp / name) for name in sorted(files)}}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        os.chmod(tmp, 0o755)
        old = None
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old / "bundle")
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def load_bundle(directory: Path) -> Bundle:
    return Bundle.model_validate_json((Path(directory) / BUNDLE_FILE).read_text())
