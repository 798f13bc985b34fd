"""Which source files a piece of evidence depends on, and their sha256.

A contract covers its implementation, reference and standard entry points, the contract YAML and the op's
problem file (gates.evidence.bundle.covered_sources). Each entry point's module is followed through its imports
(read statically, nothing is executed) to every module file inside the repository, package `__init__`s
included: edit any of them and the evidence is stale. The gates add what the candidate's processes actually loaded
from the repository while they ran (a module imported with importlib that no import statement names), recorded by
the worker at run time.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def module_file(module: str, root: Path) -> Path | None:
    """The file of a dotted module inside `root` (a package's __init__.py), or None outside it."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path, root: Path) -> str:
    """The package a module file belongs to: model/kimi_k3/ops/kda.py and .../ops/__init__.py -> model.kimi_k3.ops."""
    return ".".join(path.relative_to(root).with_suffix("").parts[:-1])


def _imported(path: Path, root: Path) -> set[str]:
    """Dotted names a module imports (absolute form), with `from pkg import sub` giving pkg.sub too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(path, root)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return {n for n in names if n}


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_closure(modules: list[str], root: Path = REPO_ROOT) -> list[Path]:
    """Every file inside `root` that importing `modules` would load, found statically."""
    seen: dict[Path, None] = {}
    todo = [m for module in modules for m in _with_parents(module)]
    while todo:
        path = module_file(todo.pop(), root)
        if path is None or path in seen:
            continue
        seen[path] = None
        todo.extend(m for name in _imported(path, root) for m in _with_parents(name))
    return sorted(seen)


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
