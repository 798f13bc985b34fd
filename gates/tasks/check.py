"""`k3forge task check`: the commits of a branch (BASE..HEAD) against the rules of their task.

What changed is the diff from the merge base of BASE and HEAD to HEAD; the commits are those HEAD has and BASE
has not. Everything is read from the repository given (its working tree at HEAD, which must be clean), never
from the checkout this code runs from, so CI can run the base branch's checker on a pull request's tree.

The rules (RULES) each report `path: rule: message` violations; `check` gathers them with what a reviewer
needs next to them (the touched kernels, their evidence) into a Report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import git

from gates.core.contracts import validation_problems
from gates.core.registry import registered
from gates.core.status import Status
from gates.evidence.bundle import BUNDLE_FILE, MANIFEST_FILE, Bundle, covered_sources, load_bundle
from gates.evidence.diff import DiffError, Move, contract_changes, render_markdown
from gates.evidence.diff import diff as evidence_diff
from gates.evidence.index import index_rows
from gates.evidence.report import render_index
from gates.evidence.verify import verify_bundle
from gates.scope.policy import EVIDENCE_INDEX, bundle_key, change_problem
from gates.tasks.render import render
from gates.tasks.schema import TASKS_DIR, Task, TaskError, read_task
from kernels.contract import Contract, ContractError, contract_files, evidence_dir, load_contract
from kernels.sources import sha256_file

SPECIALIZED = "model/kimi_k3/specialized/"
# Kernel sources: changing one means changing its contract too (a kernel package's notes and results do not).
KERNEL_SOURCES = (".py", ".cu", ".cuh", ".cpp", ".cc", ".c", ".h", ".hpp")
DISCLOSURE_KEYS = ("assisted-by", "co-authored-by")
SIGN_OFF_KEY = "signed-off-by"
TASK_KEY = "task"
REASON_KEY = "contract-change"  # Contract-change: <op>.<value>: <why the bar moved>
PERSON = re.compile(r"^(?P<name>[^<>]*\S)\s*<(?P<email>[^<>\s]+@[^<>\s]+)>$")

RULES = {
    "scope": "every changed path is inside the task's allowed paths and outside its forbidden ones; evidence/ "
             "takes only the task ops' generated bundles and a regenerated index",
    "contract": "a changed kernel source under model/kimi_k3/specialized/ belongs to a contract, and that "
                "contract (contracts/<op>.yaml) changed with it and loads",
    "evidence": "every kernel the change touches (its contract, its sources, or any file its evidence covers) "
                "has, for each validated arch, a bundle evidence/<op>/<arch>/ that is intact and fresh, and in "
                "which every gate that applies on that arch PASSED (validated means passed)",
    "gates": "in those bundles, each gate the task requires PASSED (where an op has a validated bundle, its bundles "
             "of other archs are records of what those machines could check, held to neither this rule nor the "
             "speedups)",
    "thresholds": "the bundles meet the task's speedup at each of its batch sizes, and the contract's "
                  "tolerance is no looser than the task's numerics bounds",
    "envelope": "the contract of a task op claims nothing outside the task's envelope",
    "loosening": "every contract value the change loosens against the merge base (a wider tolerance or envelope, a "
                 "lower speedup or roofline bar, a benchmark point dropped, another reference or standard) is named "
                 "with its reason in a commit trailer `Contract-change: <op>.<value>: <reason>`; the PR summary "
                 "shows each with its reason",
    "disclosure": "every commit names the AI that helped: an Assisted-by: or Co-authored-by: trailer",
    "owner": "every commit carries Signed-off-by: Name <email> of the human who owns and ran it, "
             "someone other than the disclosed assistant",
    "task": "commits that name a task with a Task: trailer name the task being checked",
    "committed": "the working tree is clean: the check judges commits",
}


class CannotCheck(Exception):
    """What the check needs and does not have (a repository, a base, a task); no verdict."""


@dataclass(frozen=True)
class Violation:
    path: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.rule}: {self.message}"


@dataclass(frozen=True)
class CommitInfo:
    sha: str
    summary: str
    trailers: tuple[tuple[str, str], ...]

    @property
    def short(self) -> str:
        return self.sha[:12]

    def values(self, *keys: str) -> list[str]:
        return [v.strip() for k, v in self.trailers if k.lower() in keys]


@dataclass(frozen=True)
class Branch:
    """BASE..HEAD as git tells it: the changed paths (both sides of a rename), the non-merge commits."""

    root: Path
    base: str
    base_sha: str
    head_sha: str
    merge_base_sha: str
    changed: tuple[str, ...]
    commits: tuple[CommitInfo, ...]
    uncommitted: tuple[str, ...]


def open_repo(path: Path) -> git.Repo:
    try:
        return git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise CannotCheck(f"{path}: not inside a git repository") from None


def default_base(repo: git.Repo) -> str:
    for rev in ("origin/main", "main"):
        try:
            repo.commit(rev)
            return rev
        except (git.BadName, ValueError):
            continue
    raise CannotCheck(f"{repo.working_tree_dir}: no origin/main or main to compare with; pass --base REV")


def read_branch(repo: git.Repo, base: str, head: str = "HEAD") -> Branch:
    """BASE..`head`; the working tree (its uncommitted paths, the files the rules read) must be `head`'s."""
    try:
        base_commit = repo.commit(base)
    except (git.BadName, ValueError):
        raise CannotCheck(f"--base {base}: not a revision of {repo.working_tree_dir}") from None
    head = repo.commit(head)
    merge_bases = repo.merge_base(base_commit, head)
    if not merge_bases:
        raise CannotCheck(f"--base {base}: shares no history with HEAD")
    changed = {p for d in merge_bases[0].diff(head) for p in (d.a_path, d.b_path) if p}
    commits = [CommitInfo(c.hexsha, c.summary, tuple(c.trailers_list))
               for c in repo.iter_commits(f"{base_commit.hexsha}..{head.hexsha}") if len(c.parents) < 2]
    return Branch(Path(repo.working_tree_dir).resolve(), base, base_commit.hexsha, head.hexsha,
                  merge_bases[0].hexsha, tuple(sorted(changed)), tuple(reversed(commits)), uncommitted_paths(repo))


def uncommitted_paths(repo: git.Repo) -> tuple[str, ...]:
    """Paths `git status` lists (untracked ones too, ignored ones not); a rename's source follows it."""
    entries = iter(repo.git.status("--porcelain", "--untracked-files=all", "-z").split("\0"))
    paths = set()
    for entry in entries:
        if len(entry) > 3:
            paths.add(entry[3:])
            if "R" in entry[:2] or "C" in entry[:2]:
                paths.add(next(entries))
    return tuple(sorted(paths))


def task_name(branch: Branch, given: str | None) -> str:
    """The task to check: the one given, else the one the commits' Task: trailers name."""
    if given:
        return given
    named = sorted({v for c in branch.commits for v in c.values(TASK_KEY)})
    if len(named) == 1:
        return named[0]
    if named:
        raise CannotCheck(f"the commits in {branch.base}..HEAD name several tasks ({', '.join(named)}); "
                          "one pull request serves one task: pass --task NAME")
    raise CannotCheck(f"no task: no commit in {branch.base}..HEAD has a `Task: NAME` trailer; add one "
                      "(git commit --trailer 'Task: NAME') or pass --task NAME")


def task_at_base(repo: git.Repo, branch: Branch, name: str) -> Task:
    """The task as the base branch has it: a pull request is judged by the rules it merges into, not by rules
    it rewrote (agent_tasks/ is core, so rewriting them is itself a violation)."""
    return task_at(repo, branch.base_sha, branch.base, name)


def task_at(repo: git.Repo, sha: str, rev: str, name: str) -> Task:
    """Task `name` as commit `sha` (named `rev` in messages) has it; TaskError names the tasks there if not."""
    tree = repo.commit(sha).tree

    def text(path: str) -> str | None:
        try:
            return (tree / path).data_stream.read().decode()
        except KeyError:
            return None

    found = text(f"{TASKS_DIR}/{name}.yaml")
    source = f"{rev}:{TASKS_DIR}/{name}.yaml"  # as git names a file of a revision
    if found is None:
        try:
            known = sorted(b.name.removesuffix(".yaml") for b in (tree / TASKS_DIR).blobs if b.name.endswith(".yaml"))
        except KeyError:
            known = []
        raise TaskError(f"{source}: <file>: no task {name!r} on {rev}; tasks there: {', '.join(known) or 'none'}")
    return read_task(found, text(f"{TASKS_DIR}/{name}.md"), source)


@dataclass(frozen=True)
class Kernel:
    """A contract at HEAD, the files that are its kernel, and the files its evidence covers."""

    contract: Contract
    contract_path: str
    unit: str  # a package directory (ends with /) or one module file
    covered: frozenset[str]  # what a bundle made now would cover, and what the committed bundles recorded

    @property
    def op(self) -> str:
        return self.contract.op

    def owns(self, path: str) -> bool:
        return path.startswith(self.unit) if self.unit.endswith("/") else path == self.unit

    def touched_by(self, path: str) -> bool:
        return path == self.contract_path or path in self.covered or (self.owns(path) and is_kernel_source(path))


def is_kernel_source(path: str) -> bool:
    return path.endswith(KERNEL_SOURCES)


def kernel_unit(module: str, root: Path) -> str:
    """The kernel an implementation module belongs to: its top-level package or module under specialized/,
    else its own package directory or module file."""
    path = module.replace(".", "/")
    if path.startswith(SPECIALIZED):
        path = SPECIALIZED + path[len(SPECIALIZED):].split("/")[0]
    return f"{path}/" if (root / path).is_dir() else f"{path}.py"


def read_kernels(root: Path) -> tuple[dict[str, Kernel], dict[str, list[str]]]:
    """Every contract at HEAD as a Kernel by op, and the error lines of those that do not load, by path."""
    kernels, errors = {}, {}
    for path in contract_files(root / "contracts"):
        rel = path.relative_to(root).as_posix()
        try:
            contract = load_contract(path)
        except ContractError as e:
            errors[rel] = [line.replace(f"{path}: ", "", 1) for line in str(e).splitlines()]
            continue
        problem = root / "gates" / "problems" / f"{contract.op}.py"
        covered = {s.path for s in covered_sources(contract, path, problem if problem.is_file() else None, root)}
        for arch in contract.archs_validated:  # a file deleted since the evidence was made is in no closure now
            try:
                covered |= {s.path for s in load_bundle(root / evidence_dir(contract.op, arch)).sources}
            except (OSError, ValueError):
                pass  # missing or unreadable: check_evidence says so
        kernels[contract.op] = Kernel(contract, rel, kernel_unit(contract.implementation.partition(":")[0], root),
                                      frozenset(covered))
    return kernels, errors


@dataclass
class Evidence:
    """One bundle directory as the check found it: its bundle (None when unreadable) and what is wrong with it."""

    op: str
    arch: str
    directory: str
    bundle: Bundle | None
    problems: list[str]
    # gates whose failures the evidence rule reports (those that apply on a validated arch): not said again
    validated_gates: frozenset[str] = frozenset()

    def statuses(self) -> dict[str, str]:
        return {g.gate: g.status.value for g in self.bundle.gates} if self.bundle else {}

    def speedups(self) -> dict[int, tuple[float, str]]:
        """The lowest speedup measured at each batch size at the contract's points, with the point it was measured
        at. Points the gate drew between them are its own to judge (drawn anew each run, at the standard's speed)."""
        bench = next((g for g in self.bundle.gates if g.gate == "benchmarks"), None) if self.bundle else None
        worst: dict[int, tuple[float, str]] = {}
        for row in bench.details.get("rows", []) if bench else []:
            if row.get("drawn"):
                continue
            if row["batch"] not in worst or row["speedup"] < worst[row["batch"]][0]:
                worst[row["batch"]] = (row["speedup"], row["point"])
        return worst


def read_evidence(root: Path, op: str, arch: str) -> Evidence:
    rel = evidence_dir(op, arch)
    directory = root / rel
    if not (directory / BUNDLE_FILE).is_file() and not (directory / MANIFEST_FILE).is_file():
        return Evidence(op, arch, rel, None, [f"missing: no bundle for arch {arch}; run the gates on an {arch} "
                                              f"machine (make gate) and commit {rel}/"])
    problems = [p.replace(f"{root}/", "").removeprefix(f"{rel}: ") for p in verify_bundle(directory, root)]
    try:
        bundle = load_bundle(directory)
    except (OSError, ValueError):
        return Evidence(op, arch, rel, None, problems)
    if (bundle.op, bundle.arch) != (op, arch):
        problems.append(f"{rel}/{BUNDLE_FILE}: holds {bundle.op} on {bundle.arch}, not {op} on {arch}")
    return Evidence(op, arch, rel, bundle, problems)


@dataclass
class Report:
    task: Task
    branch: Branch
    kernels: list[Kernel] = field(default_factory=list)  # touched by the change
    contract_changes: list[Move] = field(default_factory=list)  # judged contract values moved since the merge base
    reasons: dict[str, str] = field(default_factory=dict)  # Move.name: the reason its Contract-change trailer gives
    evidence: list[Evidence] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations

    def task_kernels(self) -> list[Kernel]:
        return [k for k in self.kernels if k.op in self.task.ops]


# ------------------------------------------------------------------------------------------------ rules


def check_scope(task: Task, branch: Branch) -> list[Violation]:
    """The policy's verdict on each changed path; a changed index is judged by check_index, a task op's bundle by
    check_evidence."""
    return [Violation(path, "scope", why) for path in branch.changed
            if (why := change_problem(path, task.ops, task.allowed_globs, task.forbidden_globs))]


def check_contracts(branch: Branch, kernels: dict[str, Kernel], errors: dict[str, list[str]]) -> list[Violation]:
    changed = set(branch.changed)
    out = [Violation(rel, "contract", line) for rel, lines in errors.items() if rel in changed for line in lines]
    for path in branch.changed:
        if not path.startswith(SPECIALIZED) or path == f"{SPECIALIZED}__init__.py" or not is_kernel_source(path):
            continue
        owner = next((k for k in kernels.values() if k.owns(path)), None)
        if owner is None:
            if (branch.root / path).exists():
                out.append(Violation(path, "contract", "no contract names this kernel: add contracts/<op>.yaml "
                                                       "whose implementation points into it"))
        elif owner.contract_path not in changed:
            out.append(Violation(path, "contract", f"kernel changed without its contract: change "
                                                   f"{owner.contract_path} with it (say what changed)"))
    return out


def current_digest(root: Path, path: str) -> str | None:
    file = root / path
    return sha256_file(file) if file.is_file() else None


def unsaid_kernel_changes(root: Path, ops: list[str] | None, arch: str) -> list[str]:
    """The contract rule, asked before a gate rather than after it: for each op (every contract when None) whose
    committed bundle on `arch` recorded its contract as it is now while one of its kernel sources changed since.
    A gate run then makes a bundle of a contract that no longer describes the kernel, and fixing the contract
    afterwards stales that bundle (the bundle covers the contract): the GPU time is spent twice."""
    kernels, _ = read_kernels(root)
    out = []
    for op, k in sorted(kernels.items()):
        if ops is not None and op not in ops:
            continue
        try:
            bundle = load_bundle(root / evidence_dir(op, arch))
        except (OSError, ValueError):
            continue  # no bundle yet (a first gate), or one `evidence verify` reports
        recorded = {s.path: s.sha256 for s in bundle.sources}
        if current_digest(root, k.contract_path) != recorded.get(k.contract_path):
            continue
        changed = sorted(p for p in k.covered | recorded.keys()
                         if k.owns(p) and is_kernel_source(p) and current_digest(root, p) != recorded.get(p))
        if changed:
            out.append(f"{k.contract_path}: unchanged since {evidence_dir(op, arch)} was made, while "
                       f"{', '.join(changed)} changed: say what changed in the contract before the gate (its "
                       "bundle covers the contract; task check's contract rule)")
    return out


def unlisted_gate_device(root: Path, ops: list[str] | None, arch: str, device: str) -> list[str]:
    """Asked before a gate too: for each op (every contract when None) whose contract validates `arch` on devices
    other than `device`, the card the gate would run on. Its bundle would not verify (`evidence verify`: a bundle
    from a device its contract does not list), so the GPU time would buy nothing."""
    kernels, _ = read_kernels(root)
    return [f"{k.contract_path}: hardware.validated lists {', '.join(hw.devices)} for {arch}, not {device}, the "
            f"device here: add it there first (a bundle from an unlisted device does not verify)"
            for op, k in sorted(kernels.items()) if ops is None or op in ops
            for hw in k.contract.hardware.validated if hw.arch == arch and device not in hw.devices]


def check_evidence(task: Task, branch: Branch, touched: list[Kernel]) -> tuple[list[Evidence], list[Violation]]:
    found: dict[tuple[str, str], Evidence] = {}
    out = []
    for k in touched:
        if not k.contract.archs_validated and k.op in task.ops:
            out.append(Violation(k.contract_path, "evidence", "the contract validates no arch: list the arch under "
                                 "hardware.validated, run the gates on it (make gate) and commit "
                                 f"evidence/{k.op}/<arch>/"))
        for arch in k.contract.archs_validated:
            ev = found[(k.op, arch)] = read_evidence(branch.root, k.op, arch)
            if ev.bundle is not None and not ev.problems:  # what `contract check` refuses, refused here too
                ev.validated_gates = frozenset(g.name for g in registered() if not g.inapplicable(k.contract, arch))
                out += [Violation(ev.directory, "evidence", f"{arch} is validated, but its bundle did not pass: {p}")
                        for p in validation_problems(ev.bundle, k.contract, arch)]
    for path in branch.changed:  # bundles the change writes, validated or not
        key = bundle_key(path)
        if key and key not in found and (branch.root / evidence_dir(*key)).is_dir():
            found[key] = read_evidence(branch.root, *key)
    for ev in found.values():
        out += [Violation(ev.directory, "evidence", p) for p in ev.problems]
    return list(found.values()), out


def check_index(branch: Branch) -> list[Violation]:
    """A changed evidence index must be what the gate runner writes for the committed bundles."""
    out = []
    evidence = branch.root / "evidence"
    rows = index_rows(evidence, branch.root) if evidence.is_dir() else []
    for rel in EVIDENCE_INDEX:
        if rel not in branch.changed:
            continue
        path = branch.root / rel
        if not path.is_file():
            out.append(Violation(rel, "scope", "the evidence index is core: regenerate it, never remove it"))
            continue
        text = path.read_text()
        try:
            same = json.loads(text).get("bundles") == rows if rel.endswith(".json") else text == render_index(rows)
        except (ValueError, AttributeError):
            same = False
        if not same:
            out.append(Violation(rel, "scope", "does not match the committed bundles: leave it as the gate runner "
                                               "wrote it (k3forge gate)"))
    return out


def judged(task: Task, evidence: list[Evidence]) -> list[Evidence]:
    """The task ops' bundles the gates and thresholds rules hold to the task: every one of an op with no validated
    bundle, else its validated archs' only. A CPU bundle re-made beside a GPU kernel's H200 bundle records the
    contract and compile gates a CPU machine can run; the numerics and speedups it cannot measure are the validated
    bundle's to show."""
    validated = {ev.op for ev in evidence if ev.validated_gates}
    return [ev for ev in evidence if ev.bundle is not None and ev.op in task.ops
            and (ev.validated_gates or ev.op not in validated)]


def check_gates(task: Task, evidence: list[Evidence]) -> list[Violation]:
    """The task's required gates that did not pass, less those the evidence rule reports for a validated arch's
    bundle (every gate that applies there)."""
    out = []
    for ev in judged(task, evidence):
        results = {g.gate: g for g in ev.bundle.gates}
        for name in task.required_gates:
            if name in ev.validated_gates:
                continue
            g = results.get(name)
            if g is None:
                out.append(Violation(ev.directory, "gates", f"{name}: not in the bundle (the task requires it)"))
            elif g.status is not Status.PASSED:
                out.append(Violation(ev.directory, "gates", f"{name} {g.status.value}: {g.reason or g.summary}"))
    return out


def check_thresholds(task: Task, touched: list[Kernel], evidence: list[Evidence]) -> list[Violation]:
    out = []
    bounds = task.success.numerics
    for k in (k for k in touched if k.op in task.ops):
        for tol_name in ("tolerance", "state_tolerance"):
            if (tol := getattr(k.contract, tol_name)) is None:
                continue
            for name in ("atol", "rtol", "max_rel_l2", "max_units"):
                bound = getattr(bounds, name)
                if bound is not None and getattr(tol, name) > bound:
                    out.append(Violation(k.contract_path, "thresholds",
                                         f"{tol_name}.{name} {getattr(tol, name):g} is "
                                         f"looser than the task's {bound:g}"))
            if bounds.min_close_fraction is not None and tol.min_close_fraction < bounds.min_close_fraction:
                out.append(Violation(k.contract_path, "thresholds", f"{tol_name}.min_close_fraction "
                                     f"{tol.min_close_fraction:g} is looser than the task's "
                                     f"{bounds.min_close_fraction:g}"))
    envelopes = {k.op: k.contract.batch for k in touched}
    for ev in judged(task, evidence):
        measured = ev.speedups()
        # A contract narrows its envelope where its kernel is not faster (the standard serves the rest), so the
        # task's speedups bind at the batch sizes it claims; it must claim at least one of them.
        claimed = [w for w in task.success.speedup if ev.op not in envelopes or w.batch in envelopes[ev.op]]
        if task.success.speedup and not claimed:
            out.append(Violation(ev.directory, "thresholds", "the contract's batch range holds none of the task's "
                                 f"speedup batch sizes ({', '.join(str(w.batch) for w in task.success.speedup)})"))
        for want in claimed:
            if want.batch not in measured:
                out.append(Violation(ev.directory, "thresholds", f"batch {want.batch}: no speedup measured (the "
                                     f"task requires {want.min:g}×; the contract needs a benchmark point there "
                                     "and the benchmarks gate must run)"))
            elif (got := measured[want.batch])[0] < want.min:
                out.append(Violation(ev.directory, "thresholds", f"batch {want.batch}: {got[0]:.2f}× over the "
                                     f"standard at {got[1]}; the task requires {want.min:g}×"))
    return out


def check_envelope(task: Task, touched: list[Kernel]) -> list[Violation]:
    out, env = [], task.envelope
    for k in (k for k in touched if k.op in task.ops):
        c = k.contract
        claims = [h.arch for h in (*c.hardware.validated, *c.hardware.declared)]
        found = [f"arch {a}" for a in claims if a not in env.archs]
        found += [f"TP size {t}" for t in c.tp_sizes if t not in env.tp_sizes]
        for name, got, allowed in (("batch", c.batch, env.batch), ("spec_tokens", c.spec_tokens, env.spec_tokens)):
            if got.min not in allowed or got.max not in allowed:
                found.append(f"{name} {got.min}..{got.max} (task: {allowed.min}..{allowed.max})")
        out += [Violation(k.contract_path, "envelope", f"claims {what}, outside the task's envelope") for what in found]
    return out


def stated_reasons(branch: Branch) -> dict[str, str]:
    """{<op>.<value>: reason} from the commits' `Contract-change:` trailers (a later commit's reason first)."""
    reasons: dict[str, str] = {}
    for c in branch.commits:
        for value in c.values(REASON_KEY):
            name, _, why = value.partition(":")
            if why.strip():
                reasons[name.strip()] = "; ".join(filter(None, (why.strip(), reasons.get(name.strip()))))
    return reasons


def reason_for(move: Move, reasons: dict[str, str]) -> str | None:
    """The reason that names this value, or a field above it (attn_res.tolerance covers attn_res.tolerance.atol);
    naming the op alone explains nothing."""
    for name, why in reasons.items():
        if "." in name and (move.name == name or move.name.startswith((f"{name}.", f"{name}["))):
            return why
    return None


def contract_moves_since_base(branch: Branch) -> tuple[list[Move], list[Violation]]:
    """The judged contract values that moved from the merge base to HEAD; one violation when they cannot be read."""
    try:
        return contract_changes(branch.merge_base_sha, branch.head_sha, branch.root), []
    except DiffError as e:
        return [], [Violation("contracts/", "loosening", f"cannot compare the contracts with the merge base: {e}")]


def check_loosening(moves: list[Move], reasons: dict[str, str]) -> list[Violation]:
    """Each loosened value without a reason (`reasons`: by Move.name, as check() matched them)."""
    return [Violation(f"contracts/{m.contract}.yaml", "loosening",
                      f"{m.path} {json.dumps(m.base)} → {json.dumps(m.head)} loosens the contract: say why in a "
                      f"commit trailer `Contract-change: {m.name}: <reason>`")
            for m in moves if m.loosened and m.name not in reasons]


def check_commits(task: Task, branch: Branch) -> list[Violation]:
    out = []
    for c in branch.commits:
        assistants = c.values(*DISCLOSURE_KEYS)
        if not assistants:
            out.append(Violation(c.short, "disclosure", f"{c.summary!r}: no Assisted-by: or Co-authored-by: "
                                                        "trailer naming the AI that helped"))
        assistant_emails = {m["email"].lower() for a in assistants if (m := PERSON.match(a))}
        owners = [m for s in c.values(SIGN_OFF_KEY) if (m := PERSON.match(s))]
        if not any(m["email"].lower() not in assistant_emails for m in owners):
            out.append(Violation(c.short, "owner", f"{c.summary!r}: no Signed-off-by: Name <email> of the human "
                                                   "who owns and ran this change (git commit -s), other than the "
                                                   "assistant"))
        for named in c.values(TASK_KEY):
            if named != task.name:
                out.append(Violation(c.short, "task", f"{c.summary!r}: Task: {named}, but the task checked is "
                                                      f"{task.name}"))
    return out


def check_committed(branch: Branch) -> list[Violation]:
    return [Violation(p, "committed", "not committed: commit or stash it, the check judges commits")
            for p in branch.uncommitted]


def check(task: Task, branch: Branch) -> Report:
    kernels, errors = read_kernels(branch.root)
    touched = [k for k in kernels.values() if any(k.touched_by(p) for p in branch.changed)]
    evidence, evidence_violations = check_evidence(task, branch, touched)
    moves, unreadable = contract_moves_since_base(branch)
    stated = stated_reasons(branch)
    reasons = {m.name: why for m in moves if m.loosened and (why := reason_for(m, stated))}
    violations = (check_scope(task, branch) + check_index(branch) + check_contracts(branch, kernels, errors)
                  + evidence_violations + check_gates(task, evidence)
                  + check_thresholds(task, touched, evidence)
                  + check_envelope(task, touched) + unreadable + check_loosening(moves, reasons)
                  + check_commits(task, branch) + check_committed(branch))
    return Report(task, branch, kernels=touched, contract_changes=moves, reasons=reasons, evidence=evidence,
                  violations=violations)


def summary(report: Report, link_base: str = "") -> str:
    """The pull request summary in Markdown; file links are `link_base` + the repository path."""
    def people(*keys: str) -> list[str]:
        return sorted({v for c in report.branch.commits for v in c.values(*keys)})

    b = report.branch
    try:
        moved = render_markdown(evidence_diff(b.merge_base_sha, b.head_sha, b.root), b.merge_base_sha[:12],
                                b.head_sha[:12], report.contract_changes, report.reasons)
    except DiffError as e:
        moved = f"The evidence diff could not be made: {e}"
    return render("pr_summary.md.j2", r=report, rules=list(RULES), owners=people(SIGN_OFF_KEY),
                  assistants=people(*DISCLOSURE_KEYS), link=lambda path: f"{link_base}{path}",
                  evidence_diff=moved.replace("## Evidence diff", "### Evidence diff", 1))
