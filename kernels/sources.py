"""Which repository files a module depends on, read statically (nothing is executed), and their sha256.

Shared by the judge (gates.core.sources: what evidence covers) and the compile cache (kernels.cute: what an
on-disk compiled kernel was generated from).
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
