"""Which source files a piece of evidence depends on, and their sha256.

A contract covers its implementation, reference and standard entry points, the contract YAML and the op's
problem file (gates.evidence.bundle.covered_sources). Each entry point's module is followed through its imports
(read statically, nothing is executed) to every module file inside the repository, package `__init__`s
included: edit any of them and the evidence is stale. The gates add what the candidate's processes actually loaded
from the repository while they ran (a module imported with importlib that no import statement names), recorded by
the worker at run time.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kernels.sources import REPO_ROOT, import_closure, module_file, sha256_file

__all__ = ["HARNESS_DIRS", "REPO_ROOT", "harness_digest", "import_closure", "in_repository", "module_file",
           "relative", "repository_path", "resolve", "sha256_file"]


# The judge: the judging core, the gates, the evals, the op problems; timing, roofline and contracts in kernels/.
HARNESS_DIRS = ("gates/core", "gates/checks", "gates/evals", "gates/problems", "kernels")


def harness_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the gate code (every Python file under HARNESS_DIRS): which version of the judge produced a
    bundle. Evidence writing and reports (`k3forge evidence render` applies templates to old bundles), the
    command line, the task workflow and session scripts judge nothing, so they are not in it. Not part of
    freshness (a gate fix would stale every GPU bundle at once); `evidence verify` says when it differs."""
    h = hashlib.sha256()
    for d in HARNESS_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            if path.is_file():
                h.update(f"{path.relative_to(root).as_posix()}\0{sha256_file(path)}\n".encode())
    return h.hexdigest()


def repository_path(path: str | Path | None, root: Path = REPO_ROOT) -> str | None:
    """A file's path relative to the repository root when it is one of the repository's own files (not inside a
    hidden directory such as a virtual environment), else None."""
    if path is None:
        return None
    path = Path(path).resolve()
    if not path.is_relative_to(root):
        return None
    rel = path.relative_to(root)
    return None if any(part.startswith(".") for part in rel.parts) else rel.as_posix()


def in_repository(module) -> bool:
    """Whether a loaded module's file is one of the repository's own."""
    return repository_path(getattr(module, "__file__", None)) is not None


def relative(path: Path, root: Path = REPO_ROOT) -> str:
    """The path as a bundle records it: relative to the repository root where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def resolve(recorded: str, root: Path = REPO_ROOT) -> Path:
    path = Path(recorded)
    return path if path.is_absolute() else root / path
