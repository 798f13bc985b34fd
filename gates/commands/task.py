"""`k3forge task list | show NAME | new NAME --op OP | check | split`: agent task templates (agent_tasks/) and the
check a pull request must pass.

check: every violation prints as `path: rule: problem` on stderr (exit 1), the PR summary in Markdown on
stdout (and into --summary FILE). A malformed template, an unknown base or no task to check exits 2.
split: the branch's core changes and its task's change as two branches (gates/tasks/split.py), then check on the
task branch against the core one, its summary headed by where the core half went.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.table import Table

from gates.core.sources import REPO_ROOT
from gates.scope.policy import CORE_FORBIDDEN
from gates.tasks.schema import TASKS_DIR, TaskError, brief_path, find_task, load_tasks
from model.kimi_k3.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError


def register(sub) -> None:
    p = sub.add_parser("task", help="agent task templates: list, show, scaffold, check a branch")
    verbs = p.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("list", help="every task template")
    show = verbs.add_parser("show", help="a task's rules and its brief")
    show.add_argument("name")
    new = verbs.add_parser("new", help="scaffold a contract draft, a kernel module and a test for one op of a task")
    new.add_argument("name")
    new.add_argument("--op", required=True, help="one of the task's ops")
    new.add_argument("--backend", choices=("cutedsl", "triton", "torch"), default="cutedsl")
    new.add_argument("--owner", help="the human owner for the contract, 'Name <email>' (default: git user)")
    new.add_argument("--adopt", metavar="MODULE:FUNCTION",
                     help="a kernel written before its contract: its entry point; write only the missing files")
    check = verbs.add_parser("check", help="check BASE..HEAD against its task's rules; print the PR summary")
    split = verbs.add_parser("split", help="a branch with core changes beside its kernel as two branches, "
                                           "<branch>-core and <branch>-task; check the task one on the core one")
    for v in (check, split):
        v.add_argument("--base", help="the branch the pull request merges into (default: origin/main, else main)")
        v.add_argument("--task", help="the task (default: the `Task:` trailer of the commits)")
        v.add_argument("--summary", type=Path, help="also write the Markdown summary to this file")
        v.add_argument("--link-base", default="",
                       help="prefix of file links in the summary, e.g. https://github.com/ORG/REPO/blob/SHA/")
        v.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout to judge (default: here)")
    split.add_argument("--core", action="append", default=[], metavar="GLOB",
                       help="also put these paths on the core branch, though the task may change them (repeatable)")
    for v in (ls, show, new):
        v.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    ls.set_defaults(func=run_list)
    show.set_defaults(func=run_show)
    new.set_defaults(func=run_new)
    check.set_defaults(func=run_check)
    split.set_defaults(func=run_split)


def _task(root: Path, name: str):
    try:
        return find_task(root, name)
    except TaskError as e:
        raise UsageError(str(e)) from None


def run_list(args) -> int:
    tasks, problems = load_tasks(args.root / TASKS_DIR)
    if tasks:
        table = Table(title=f"tasks ({TASKS_DIR}/)")
        for col in ("name", "ops", "title"):
            table.add_column(col)
        for task in tasks.values():
            table.add_row(task.name, ", ".join(task.ops), escape(task.title))
        Console().print(table)
    for line in problems:
        print(line, file=sys.stderr)
    if not tasks and not problems:
        print(f"no tasks under {args.root / TASKS_DIR}")
    return EXIT_USAGE if problems else EXIT_OK


def run_show(args) -> int:
    from gates.tasks.check import RULES
    from model.kimi_k3.ops.registry import OPS

    task = _task(args.root, args.name)
    out = Console(highlight=False)
    env = task.envelope
    table = Table(title=f"task {task.name}: {escape(task.title)}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    registered = [f"{op}" + ("" if op in OPS else " (not in the op registry yet)") for op in task.ops]
    rows = {
        "ops": ", ".join(registered),
        "allowed": "\n".join(task.allowed_globs),
        "forbidden": "\n".join(f"{g} (core)" if g in CORE_FORBIDDEN else g for g in task.forbidden_globs),
        "required gates": ", ".join(task.required_gates),
        "envelope": f"{', '.join(env.archs)} · TP {', '.join(map(str, env.tp_sizes))} · batch {env.batch.min}.."
                    f"{env.batch.max} · spec tokens {env.spec_tokens.min}..{env.spec_tokens.max}",
        "speedup": ", ".join(f"batch {s.batch}: {s.min:g}×" for s in task.success.speedup) or "-",
        "numerics": ", ".join(f"{k} {v:g}" for k, v in task.success.numerics.model_dump(exclude_none=True).items())
                    or "-",
        "checklist": "\n".join(f"- {item}" for item in task.checklist),
        "task check": "\n".join(f"{rule}: {what}" for rule, what in RULES.items()),
    }
    for key, value in rows.items():
        table.add_row(key, escape(value))
    out.print(table)
    out.print(Markdown(brief_path(args.root / TASKS_DIR / f"{task.name}.yaml").read_text()))
    return EXIT_OK


def _git_owner(root: Path) -> str | None:
    import git

    try:
        reader = git.Repo(root, search_parent_directories=True).config_reader()
        return f"{reader.get_value('user', 'name')} <{reader.get_value('user', 'email')}>"
    except Exception:  # no repository or no identity configured: the caller asks for --owner
        return None


def run_new(args) -> int:
    from gates.tasks.scaffold import ScaffoldError, scaffold, write

    task = _task(args.root, args.name)
    owner = args.owner or _git_owner(args.root)
    if not owner:
        raise UsageError("task new: name the contract's human owner with --owner 'Name <email>' (no git identity)")
    try:
        written, kept = write(args.root, scaffold(task, args.op, args.backend, owner, args.adopt),
                              keep_existing=args.adopt is not None)
    except ScaffoldError as e:
        raise UsageError(f"task new: {e}") from None
    for path in written:
        print(f"wrote {path.relative_to(args.root)}")
    for path in kept:
        print(f"kept {path.relative_to(args.root)} (already there)")
    problem = Path(args.root, "gates", "problems", f"{args.op}.py")
    if not problem.is_file():
        print(f"note: no {problem.relative_to(args.root)}: without the op's problem (its input generator, checker and "
              "cost) the numerics, benchmarks and evals gates cannot judge the kernel. It is judge code, outside "
              "every task's scope: ask the maintainers for it (or propose one in a commit of its own for them to "
              "adopt); gates/problems/moe_route.py is a model.")
    print(f"next: read {TASKS_DIR}/{task.name}.md, write the kernel, run its test, `k3forge contract check`, then "
          f"`make gate` on a GPU of the envelope; commit with trailers Task: {task.name}, Assisted-by: and "
          "Signed-off-by: (git commit -s), then `k3forge task check`")
    return EXIT_OK


def run_check(args) -> int:
    from gates.tasks.check import CannotCheck, default_base, open_repo, read_branch, task_name

    try:
        repo = open_repo(args.repo)
        branch = read_branch(repo, args.base or default_base(repo))
        name = task_name(branch, args.task)
    except CannotCheck as e:
        raise UsageError(f"task check: {e}") from None
    return _judge(args, repo, branch, name)


def run_split(args) -> int:
    from gates.tasks.check import CannotCheck, default_base, open_repo, read_branch
    from gates.tasks.split import split, split_note

    try:
        repo = open_repo(args.repo)
        made = split(repo, args.base or default_base(repo), args.task, tuple(args.core))
        branch = read_branch(repo, made.core_branch, made.task_branch)
    except CannotCheck as e:
        raise UsageError(f"task split: {e}") from None
    except TaskError as e:
        raise UsageError(str(e)) from None
    print(f"{made.core_branch}: {len(made.core_paths)} core path(s), a pull request of their own; "
          f"{made.task_branch}: task {made.task}'s {len(made.task_paths)}, checked on it", file=sys.stderr)
    return _judge(args, repo, branch, made.task, split_note(made))


def _judge(args, repo, branch, name: str, preamble: str = "") -> int:
    """The task's rules on `branch`: the summary on stdout (and --summary), violations on stderr."""
    from gates.tasks.check import check, summary, task_at_base

    try:
        task = task_at_base(repo, branch, name)
    except TaskError as e:
        raise UsageError(str(e)) from None
    report = check(task, branch)
    text = preamble + summary(report, args.link_base)
    print(text)
    if args.summary:
        args.summary.write_text(text)
    for violation in report.violations:
        print(violation, file=sys.stderr)
    if report.violations:
        print(f"{len(report.violations)} violation(s) of task {name}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
