"""`k3forge task split` on real git repositories: a branch with core changes beside its kernel becomes
`<branch>-core` (BASE plus the paths outside the task's scope) and `<branch>-task` (HEAD's tree on top of it), the
task branch passes the check on the core one, and what cannot be split says why in one line."""

from __future__ import annotations

import pytest

from gates.cli import main
from gates.tasks.check import CannotCheck, check, read_branch, task_at_base
from gates.tasks.split import split
from tests.tasks.conftest import AGENT, KERNEL, OWNER, TRAILERS
from tests.tasks.test_task_check import kernel_change

HELPER = "tests/specialized/test_attn_res_fused.py"


def mixed_change(r) -> str:
    """The kernel re-gated, a test beside it, and two core changes (README, a gate module) in two commits."""
    r.write("README.md", "# k3forge\n\nThe fused mix.\n")
    r.write("gates/problems/attn_res.py", "# its gate problem\n")
    r.commit("core: the op's gate problem, README", AGENT, OWNER)
    kernel_change(r)
    r.write(HELPER, "def test_nothing_yet():\n    pass\n")
    return r.commit("attn_res: one pass", *TRAILERS, "Contract-change: attn_res.description: reworded")


def tree_paths(r, rev: str) -> dict[str, str]:
    return {b.path: b.hexsha for b in r.repo.commit(rev).tree.traverse() if b.type == "blob"}


def test_a_mixed_branch_splits_into_core_and_task(task_repo):
    head = mixed_change(task_repo)
    made = split(task_repo.repo, "main")
    assert (made.core_branch, made.task_branch) == ("task-core", "task-task")
    assert made.core_paths == ("README.md", "gates/problems/attn_res.py")
    assert set(made.task_paths) == {KERNEL, "contracts/attn_res.yaml", HELPER, "evidence/attn_res/cpu/bundle.json",
                                    "evidence/attn_res/cpu/manifest.json", "evidence/attn_res/cpu/report.html",
                                    "evidence/attn_res/cpu/report.md"}
    main_tree, core, task, head_tree = (tree_paths(task_repo, rev) for rev in ("main", "task-core", "task-task", head))
    assert task == head_tree  # the task branch is HEAD's tree exactly
    assert core == {**main_tree, "README.md": head_tree["README.md"],
                    "gates/problems/attn_res.py": head_tree["gates/problems/attn_res.py"]}
    assert task_repo.repo.head.commit.hexsha == head and not task_repo.repo.is_dirty(untracked_files=True)
    message = task_repo.repo.commit("task-task").message
    assert "Contract-change: attn_res.description: reworded" in message and "Task: attn_res_mix" in message
    core_message = task_repo.repo.commit("task-core").message
    assert "Task:" not in core_message and OWNER in core_message
    branch = read_branch(task_repo.repo, "task-core", "task-task")
    assert check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch).violations == []


def test_a_branch_of_several_tasks_splits_once_per_task(task_repo):
    """One GPU session gated two tasks' kernels on one branch: each split keeps its own Task: trailer only, so the
    task branch is judged as that task's and nothing else's."""
    mixed_change(task_repo)
    task_repo.write("gates/problems/mla_decode.py", "# another task's change\n")
    task_repo.commit("mla_decode: its change", "Task: mla_decode", AGENT, OWNER)
    made = split(task_repo.repo, "main", "attn_res_mix")
    assert "gates/problems/mla_decode.py" in made.core_paths
    message = task_repo.repo.commit("task-task").message
    assert "Task: attn_res_mix" in message and "Task: mla_decode" not in message
    branch = read_branch(task_repo.repo, "task-core", "task-task")
    assert check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch).violations == []


def test_the_cli_checks_the_task_branch_and_heads_the_summary_with_the_core_paths(task_repo, capsys, tmp_path):
    mixed_change(task_repo)
    summary = tmp_path / "summary.md"
    assert main(["task", "split", "--repo", str(task_repo.root), "--base", "main", "--summary", str(summary)]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["task-core: 2 core path(s), a pull request of their own; task-task: task "
                                "attn_res_mix's 7, checked on it"]
    assert out.startswith("### Split from `task`") and "- `gates/problems/attn_res.py`" in out
    assert "### Task check: every rule passes" in out and summary.read_text() == out.removesuffix("\n")


def test_named_paths_go_to_the_core_branch_too(task_repo):
    mixed_change(task_repo)
    made = split(task_repo.repo, "main", core_globs=("tests/specialized/**",))
    assert HELPER in made.core_paths and HELPER not in made.task_paths


@pytest.mark.parametrize("case, expected", [
    ("all in scope", "nothing to split"),
    ("all core", "nothing of task attn_res_mix's"),
    ("uncommitted", "uncommitted changes"),
    ("behind", "rebase onto it first"),
])
def test_what_cannot_be_split_says_why(task_repo, case, expected):
    if case == "all in scope":
        kernel_change(task_repo)
        task_repo.commit("attn_res: one pass", *TRAILERS)
    elif case == "all core":
        task_repo.write("README.md", "# k3forge\n\nMore.\n")
        task_repo.commit("readme", *TRAILERS)
    else:
        mixed_change(task_repo)
        if case == "uncommitted":
            task_repo.write("scratch.txt", "x\n")
        else:
            task_repo.repo.git.checkout("main")
            task_repo.write("NOTES.md", "main moved on\n")
            task_repo.commit("main moves", AGENT, OWNER)
            task_repo.repo.git.checkout("task")
    with pytest.raises(CannotCheck, match=expected):
        split(task_repo.repo, "main")
