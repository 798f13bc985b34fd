"""Which paths an agent task may change.

A task allows globs inside ALLOWED_ROOTS; CORE_FORBIDDEN applies to every task whatever its template says, and
a template may forbid more (forbidden wins over allowed). `{op}` in a glob stands for each of the task's ops.
Globs: `**` spans directories, `*` and `?` stay inside one path segment.

evidence/ is core, with two exceptions a change may carry: the generated bundle files of the task's ops
(`evidence/<op>/<arch>/<file>`, which `k3forge task check` verifies) and the regenerated index (EVIDENCE_INDEX,
which it compares with what the gate runner writes).
"""

from __future__ import annotations

import re
from functools import cache

from gates.evidence.index import INDEX_JSON, INDEX_MD

OP_PLACEHOLDER = "{op}"
ALLOWED_ROOTS = ("model/kimi_k3/", "contracts/", "tests/")
# Core: the gate and its tests, the kernel toolkit, the templates themselves, and evidence (which only the gate
# runner writes: a task's generated bundles are admitted by `k3forge task check`, which verifies them).
CORE_FORBIDDEN = ("gates/**", "kernels/**", "agent_tasks/**", "evidence/**",
                  "tests/gates/**", "tests/adversarial/**", "tests/tasks/**")
EVIDENCE_INDEX = (f"evidence/{INDEX_JSON}", f"evidence/{INDEX_MD}")


@cache
def glob_regex(pattern: str) -> re.Pattern:
    """`**/` matches any number of directories, a final `**` anything; `*` and `?` stay inside one segment."""
    parts, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        else:
            parts.append({"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])))
            i += 1
    return re.compile("".join(parts) + r"\Z")


def matches(path: str, pattern: str) -> bool:
    return glob_regex(pattern).match(path) is not None


def first_match(path: str, patterns: list[str] | tuple[str, ...]) -> str | None:
    return next((p for p in patterns if matches(path, p)), None)


def check_glob(pattern: str) -> str:
    """The pattern, if it is a glob a template may write; else ValueError saying why."""
    if pattern.startswith("/") or "\\" in pattern or ".." in pattern.split("/"):
        raise ValueError(f"{pattern!r}: a path relative to the repository root, with / separators")
    if re.search(r"[{}]", pattern.replace(OP_PLACEHOLDER, "")):
        raise ValueError(f"{pattern!r}: the only placeholder is {OP_PLACEHOLDER}")
    return pattern


def expand(pattern: str, ops: list[str]) -> list[str]:
    """The pattern once per op where it holds {op}, else as it is."""
    return [pattern.replace(OP_PLACEHOLDER, op) for op in ops] if OP_PLACEHOLDER in pattern else [pattern]


def allowed_glob_problem(glob: str) -> str | None:
    """Why a template may not allow this (expanded) glob, or None."""
    if not glob.startswith(ALLOWED_ROOTS):
        return f"{glob!r} is outside {', '.join(ALLOWED_ROOTS)}"
    if core := first_match(glob, CORE_FORBIDDEN):
        return f"{glob!r} lies inside the core path {core!r}"
    return None


def path_problem(path: str, allowed: list[str], forbidden: list[str]) -> str | None:
    """Why a changed path is outside the (expanded) globs (None when inside). Forbidden wins over allowed."""
    if glob := first_match(path, forbidden):
        return f"forbidden by the task (matches {glob!r})"
    if first_match(path, allowed) is None:
        return "outside the task's allowed paths"
    return None


def bundle_key(path: str) -> tuple[str, str] | None:
    """(op, arch) for a file of a bundle directory evidence/<op>/<arch>/<file>."""
    parts = path.split("/")
    return (parts[1], parts[2]) if len(parts) == 4 and parts[0] == "evidence" else None


def change_problem(path: str, ops: list[str], allowed: list[str], forbidden: list[str]) -> str | None:
    """Why a task with these ops and globs may not change `path`, evidence/'s two exceptions included (None
    when it may; what the changed bundle or index holds is judged elsewhere). Bundles: of the task's ops, and of
    any op whose contract the task may change (a kernel file two ops share: the other op's bundle goes stale with
    it and must be made again in the same change)."""
    if path in EVIDENCE_INDEX:
        return None
    if key := bundle_key(path):
        if key[0] in ops or path_problem(f"contracts/{key[0]}.yaml", allowed, forbidden) is None:
            return None
        return (f"evidence/ takes only generated bundles of the task's ops ({', '.join(ops)}) and of ops whose "
                "contract it may change")
    return path_problem(path, allowed, forbidden)
