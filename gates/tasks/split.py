"""`k3forge task split`: a branch that changed core code beside its task's kernel, as two pull requests.

A new op's kernel usually needs core changes the task may not make: the op added to the task's template, its gate
problem, a session script, notes. `task check` rightly refuses them on the kernel's branch. `split` separates
them without touching the working tree: `<branch>-core` is BASE plus every changed path outside the task's scope
(a pull request reviewed as core code, under no task), and `<branch>-task` is `<branch>-core` plus the rest, whose
tree is HEAD's exactly. The task branch is then checked against the core branch, so the task's rules (its scope,
its contracts, its evidence) judge the kernel as the template on the core branch defines it.

Each new branch has one commit. The core commit keeps the commits' sign-offs and disclosures; the task commit keeps
every trailer (each Contract-change: reason) but the Task: of another task (a branch that carried several tasks'
kernels through one GPU session is split once per task, each split checked as its own task), and both list the
commits they were made from.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import git

from gates.scope.policy import change_problem, first_match
from gates.tasks.check import (
    DISCLOSURE_KEYS,
    SIGN_OFF_KEY,
    TASK_KEY,
    Branch,
    CannotCheck,
    read_branch,
    task_at,
    task_name,
)

CORE_TRAILERS = (SIGN_OFF_KEY, *DISCLOSURE_KEYS)


@dataclass(frozen=True)
class Split:
    task: str
    source: str  # the branch split (or HEAD's sha when detached)
    core_branch: str
    task_branch: str
    core_paths: tuple[str, ...]
    task_paths: tuple[str, ...]


def message(subject: str, branch: Branch, keys: tuple[str, ...] | None, task: str | None = None) -> str:
    """A commit message: the subject, the source commits' subjects, their trailers (those named by `keys`, or
    all but, when `task` is given, a Task: naming another task), each once, in the order first given."""
    lines = [subject, "", "Made by `k3forge task split` from:"]
    lines += [f"- {c.short} {c.summary}" for c in branch.commits]
    trailers: list[str] = []
    for c in branch.commits:
        for key, value in c.trailers:
            line = f"{key}: {value.strip()}"
            other_task = task is not None and key.lower() == TASK_KEY and value.strip() != task
            if (key.lower() in keys if keys is not None else not other_task) and line not in trailers:
                trailers.append(line)
    return "\n".join([*lines, "", *trailers]) if trailers else "\n".join(lines)


def tree_with(repo: git.Repo, head: str, paths: list[str], source: str) -> str:
    """HEAD's tree with `paths` set as they are in `source` (removed where `source` lacks them), through a
    scratch index: neither the working tree nor the repository's index is touched."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(scratch, "index")}
        repo.git.read_tree(head, env=env)
        for path in paths:
            listed = repo.git.ls_tree(source, "--", path)
            if listed:
                mode_type_sha = listed.split("\t", 1)[0].split()
                repo.git.update_index("--add", "--cacheinfo", f"{mode_type_sha[0]},{mode_type_sha[2]},{path}", env=env)
            else:
                repo.git.update_index("--force-remove", "--", path, env=env)
        return repo.git.write_tree(env=env)


def split(repo: git.Repo, base: str, given_task: str | None = None, core_globs: tuple[str, ...] = ()) -> Split:
    """`core_globs`: paths the task may change that go to the core branch all the same (a helper beside a kernel
    that its contract does not cover, say), named by the author, listed in the summary like the rest."""
    branch = read_branch(repo, base)
    if branch.uncommitted:
        raise CannotCheck(f"uncommitted changes ({', '.join(branch.uncommitted[:3])}...): commit them first; "
                          "the split is made of commits")
    if branch.merge_base_sha != branch.base_sha:
        raise CannotCheck(f"HEAD is not on top of {base}: rebase onto it first (the core branch starts at {base})")
    name = task_name(branch, given_task)
    task = task_at(repo, branch.head_sha, "HEAD", name)  # HEAD's template goes to the core branch, whose rules judge
    core = [p for p in branch.changed if first_match(p, core_globs)
            or change_problem(p, task.ops, task.allowed_globs, task.forbidden_globs)]
    rest = [p for p in branch.changed if p not in core]
    if not core:
        raise CannotCheck(f"nothing to split: every path {base}..HEAD changes is in task {name}'s scope; "
                          "run `k3forge task check`")
    if not rest:
        raise CannotCheck(f"nothing of task {name}'s in {base}..HEAD: it is a core change, reviewed as one")
    source = repo.active_branch.name if not repo.head.is_detached else branch.head_sha[:12]
    core_tree = tree_with(repo, branch.head_sha, rest, branch.base_sha)
    core_sha = repo.git.commit_tree(core_tree, "-p", branch.base_sha, "-m", message(
        f"{source}: the core changes beside task {name}'s kernel (k3forge task split; reviewed as core code)",
        branch, CORE_TRAILERS))
    task_sha = repo.git.commit_tree(repo.commit(branch.head_sha).tree.hexsha, "-p", core_sha, "-m", message(
        f"{source}: task {name}'s change (k3forge task split; on {source}-core)", branch, None, name))
    core_branch, task_branch = f"{source}-core", f"{source}-task"
    repo.git.branch("-f", core_branch, core_sha)
    repo.git.branch("-f", task_branch, task_sha)
    return Split(name, source, core_branch, task_branch, tuple(core), tuple(rest))


def split_note(s: Split) -> str:
    """The summary's preamble: where the core half went, and what it holds."""
    paths = "\n".join(f"- `{p}`" for p in s.core_paths)
    return (f"### Split from `{s.source}`\n\n`k3forge task split` made this branch, `{s.task_branch}`, from "
            f"`{s.source}`: its {len(s.core_paths)} path(s) outside task `{s.task}`'s scope are on `{s.core_branch}`, "
            "the base judged here, a pull request of their own to be reviewed as core code and merged first.\n\n"
            f"<details><summary>Core paths on {s.core_branch}</summary>\n\n{paths}\n</details>\n\n")
