"""`k3forge task check` on real git repositories: each rule reports its violation with the path, a clean change
passes, and the CLI prints `path: rule: problem` lines (exit 1) and the PR summary."""

from __future__ import annotations

import json
import shutil

import pytest

from gates.cli import main
from gates.core.status import Status
from gates.evidence.index import write_index
from gates.tasks.check import check, read_branch, summary, task_at_base, unlisted_gate_device, unsaid_kernel_changes
from tests.tasks.conftest import (
    AGENT,
    CONTRACT,
    CPU_GATES,
    KERNEL,
    OWNER,
    TASK,
    TRAILERS,
    benchmarks,
    failed,
    not_run,
    passed,
)


def violations(r, base: str = "main") -> list[tuple[str, str, str]]:
    branch = read_branch(r.repo, base)
    report = check(task_at_base(r.repo, branch, "attn_res_mix"), branch)
    return [(v.path, v.rule, v.message) for v in report.violations]


def rules(found) -> set[tuple[str, str]]:
    return {(path, rule) for path, rule, _ in found}


def kernel_change(r, gates=CPU_GATES) -> None:
    """The kernel and its contract changed and re-gated: what a clean task commit holds."""
    r.edit(KERNEL)
    r.edit_contract()
    r.gate(gates=gates)


def test_a_clean_change_passes(task_repo, capsys):
    kernel_change(task_repo)
    task_repo.write("tests/specialized/test_attn_res_fused.py", "def test_nothing_yet():\n    pass\n")
    task_repo.commit("attn_res: one pass", *TRAILERS)
    assert violations(task_repo) == []
    assert main(["task", "check", "--repo", str(task_repo.root), "--base", "main",
                 "--link-base", "https://example.com/blob/x/"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "### Task check: every rule passes" in out
    assert "| attn_res | cpu | **PASSED** | contracts PASSED, numerics PASSED |" in out
    assert "[report.md](https://example.com/blob/x/evidence/attn_res/cpu/report.md)" in out
    assert "- [ ] The mix sums the sources in fp32." in out


@pytest.mark.parametrize("path, expected", [
    ("README.md", "outside the task's allowed paths"),
    ("gates/tasks/schema.py", "forbidden by the task (matches 'gates/**')"),
    ("tests/gates/test_more.py", "forbidden by the task (matches 'tests/gates/**')"),
    ("agent_tasks/attn_res_mix.yaml", "forbidden by the task (matches 'agent_tasks/**')"),
    ("evidence/kda_decode/sm_90/report.md", "evidence/ takes only generated bundles of the task's ops (attn_res) "
                                            "and of ops whose contract it may change"),
])
def test_a_change_outside_the_allowed_paths(task_repo, path, expected):
    task_repo.write(path, "edited by the agent\n")
    task_repo.commit("out of scope", *TRAILERS)
    assert (path, "scope", expected) in violations(task_repo)


def test_a_bundle_of_an_op_whose_contract_the_task_may_change_is_in_scope():
    """Two ops sharing a kernel file: the task that changes it re-makes the other op's bundle too."""
    from gates.scope.policy import change_problem

    allowed = ["contracts/attn_res.yaml", "contracts/mla_decode.yaml"]
    assert change_problem("evidence/mla_decode/cpu/report.md", ["attn_res"], allowed, []) is None
    assert change_problem("evidence/kda_decode/cpu/report.md", ["attn_res"], allowed, []) is not None
    assert change_problem("evidence/mla_decode/cpu/report.md", ["attn_res"], allowed, ["contracts/**"]) is not None


def test_a_kernel_changed_without_its_contract(task_repo):
    task_repo.edit(KERNEL)
    task_repo.gate()  # fresh evidence does not excuse an unchanged contract
    task_repo.commit("kernel only", *TRAILERS)
    (found,) = violations(task_repo)
    assert found[:2] == (KERNEL, "contract") and f"change {CONTRACT} with it" in found[2]


def test_a_gate_of_a_kernel_whose_contract_says_nothing_new_is_refused_before_it_runs(task_repo):
    """The contract rule asked before the GPU time is spent: a kernel changed since its bundle, its contract not."""
    task_repo.gate()
    assert unsaid_kernel_changes(task_repo.root, ["attn_res"], "cpu") == []
    task_repo.edit(KERNEL)
    (problem,) = unsaid_kernel_changes(task_repo.root, None, "cpu")
    assert problem.startswith(f"{CONTRACT}: unchanged since evidence/attn_res/cpu was made, while {KERNEL} changed")
    assert unsaid_kernel_changes(task_repo.root, ["attn_res"], "sm_90") == []  # no bundle there: a first gate
    assert unsaid_kernel_changes(task_repo.root, ["kda_decode"], "cpu") == []  # another op
    task_repo.edit_contract()
    assert unsaid_kernel_changes(task_repo.root, ["attn_res"], "cpu") == []


def test_a_gate_on_a_device_the_contract_does_not_list_is_refused_before_it_runs(task_repo):
    """Its bundle would not verify (a bundle from a device its contract does not list), so the GPU time is kept."""
    task_repo.edit_contract(hardware={"validated": [{"arch": "sm_90", "devices": ["NVIDIA H200"]}], "declared": []})
    (problem,) = unlisted_gate_device(task_repo.root, None, "sm_90", "NVIDIA H100 80GB HBM3")
    assert problem == (f"{CONTRACT}: hardware.validated lists NVIDIA H200 for sm_90, not NVIDIA H100 80GB HBM3, the "
                       "device here: add it there first (a bundle from an unlisted device does not verify)")
    assert unlisted_gate_device(task_repo.root, None, "sm_90", "NVIDIA H200") == []
    assert unlisted_gate_device(task_repo.root, ["kda_decode"], "sm_90", "NVIDIA H100 80GB HBM3") == []  # another op
    assert unlisted_gate_device(task_repo.root, None, "sm_100", "NVIDIA GB300") == []  # an arch it does not validate


def test_a_kernel_no_contract_names(task_repo):
    task_repo.write("model/kimi_k3/specialized/rogue/kernel.py", "def rogue(): ...\n")
    task_repo.commit("a kernel without a contract", *TRAILERS)
    assert rules(violations(task_repo)) == {("model/kimi_k3/specialized/rogue/kernel.py", "contract"),
                                            ("model/kimi_k3/specialized/rogue/kernel.py", "scope")}


@pytest.mark.parametrize("changed", [KERNEL, "model/kimi_k3/ops/attn_res.py"])
def test_stale_evidence(task_repo, changed):
    """The kernel, or the reference its evidence covers, changed after the bundle was made."""
    if changed == KERNEL:
        task_repo.edit_contract()
    task_repo.edit(changed)
    task_repo.commit("no re-gate", *TRAILERS)
    found = violations(task_repo)
    stale = [m for path, rule, m in found if (path, rule) == ("evidence/attn_res/cpu", "evidence")]
    assert any(m.startswith(f"stale: {changed}") and "changed since the evidence was made" in m for m in stale), found


def test_a_hand_edited_bundle(task_repo):
    kernel_change(task_repo)
    task_repo.edit("evidence/attn_res/cpu/report.md", "All good.\n")
    task_repo.commit("tidy the report", *TRAILERS)
    assert ("evidence/attn_res/cpu", "evidence",
            "evidence/attn_res/cpu/report.md: modified after the bundle was written (sha256 differs from the "
            "manifest)") in violations(task_repo)


@pytest.mark.parametrize("gates, expected", [
    ((passed("contracts"), not_run("compile"), passed("numerics"), not_run("benchmarks"),
      failed("evals", Status.FAILED_EVAL, "sampling: TV 0.4 > 0.1")),
     "the evals gate FAILED_EVAL: sampling: TV 0.4 > 0.1"),
    ((passed("contracts"), not_run("compile"), not_run("numerics"), not_run("benchmarks"), passed("evals")),
     "the numerics gate NOT_RUN: needs a CUDA GPU; this machine has none"),
    ((passed("contracts"), not_run("compile"), passed("numerics"), not_run("benchmarks")),
     "the evals gate is not in the bundle"),
])
def test_validated_means_passed(task_repo, gates, expected):
    """An intact, fresh bundle of a validated arch that failed, or skipped, a gate that applies there validates
    nothing, whatever its verdict says (a NOT_RUN gate leaves the verdict PASSED) and whatever the task requires."""
    task_repo.write_task({**TASK, "required_gates": ["contracts"]})
    task_repo.commit("core: a task that requires only the contract gate")
    task_repo.repo.git.checkout("-q", "-b", "task2")
    kernel_change(task_repo, gates)
    task_repo.commit("kernel", *TRAILERS)
    assert violations(task_repo, base="task") == [
        ("evidence/attn_res/cpu", "evidence", f"cpu is validated, but its bundle did not pass: {expected}")]


def test_a_failed_gate_the_task_requires_is_reported_once(task_repo):
    """The evidence rule names the gate that kept a validated bundle from passing; the gates rule says it again
    only for a bundle the evidence rule accepted."""
    task_repo.write_task({**TASK, "required_gates": ["contracts", "evals"]})
    task_repo.commit("core: a task that requires the evals")
    task_repo.repo.git.checkout("-q", "-b", "task2")
    kernel_change(task_repo, (passed("contracts"), not_run("compile"), passed("numerics"), not_run("benchmarks"),
                              failed("evals", Status.FAILED_EVAL, "sampling: TV 0.4 > 0.1")))
    task_repo.commit("kernel", *TRAILERS)
    assert violations(task_repo, base="task") == [
        ("evidence/attn_res/cpu", "evidence",
         "cpu is validated, but its bundle did not pass: the evals gate FAILED_EVAL: sampling: TV 0.4 > 0.1")]


def test_other_archs_bundles_beside_a_validated_one_are_records(task_repo):
    """Beside the validated arch's passing bundle, a bundle of an arch the contract does not validate (what a CPU
    machine can check of a GPU kernel) is held to neither the task's gates nor its speedups; with no validated
    bundle, it is all the evidence there is, and is."""
    task_repo.write_task({**TASK, "required_gates": ["contracts", "numerics", "benchmarks"],
                          "success": {"speedup": [{"batch": 1, "min": 1.5}]}})
    task_repo.commit("core: a task that asks for speedups")
    task_repo.repo.git.checkout("-q", "-b", "task2")
    record = (passed("contracts"), not_run("compile"), not_run("numerics"), not_run("benchmarks"))
    kernel_change(task_repo, (passed("contracts"), not_run("compile"), passed("numerics"), benchmarks({1: 1.6}),
                              passed("evals")))
    task_repo.gate(arch="sm_90", gates=record)
    task_repo.commit("kernel, and a record of another arch", *TRAILERS)
    assert violations(task_repo, base="task") == []
    task_repo.gate(gates=(passed("contracts"), not_run("compile"), passed("numerics"), benchmarks({1: 1.2}),
                          passed("evals")))
    task_repo.commit("kernel, slower", *TRAILERS)
    assert rules(violations(task_repo, base="task")) == {("evidence/attn_res/cpu", "thresholds")}
    task_repo.edit_contract(hardware={"validated": [], "declared": [{"arch": "cpu", "devices": ["cpu"]}]})
    task_repo.commit("kernel, nothing validated", *TRAILERS)
    assert {("evidence/attn_res/sm_90", "gates"), ("evidence/attn_res/sm_90", "thresholds")} <= \
        rules(violations(task_repo, base="task"))


def test_a_validated_arch_without_evidence(task_repo):
    task_repo.edit(KERNEL)
    task_repo.edit_contract()
    shutil.rmtree(task_repo.root / "evidence")
    task_repo.commit("drop the evidence", *TRAILERS)
    found = [m for path, rule, m in violations(task_repo) if rule == "evidence"]
    assert found == ["missing: no bundle for arch cpu; run the gates on an cpu machine (make gate) and commit "
                     "evidence/attn_res/cpu/"]


@pytest.mark.parametrize("drop, rule, expected", [
    (AGENT, "disclosure", "no Assisted-by: or Co-authored-by: trailer"),
    (OWNER, "owner", "no Signed-off-by: Name <email> of the human"),
])
def test_a_missing_trailer(task_repo, drop, rule, expected):
    kernel_change(task_repo)
    sha = task_repo.commit("kernel", *(t for t in TRAILERS if t != drop))
    ((path, found_rule, message),) = violations(task_repo)
    assert (path, found_rule) == (sha[:12], rule) and expected in message


def test_the_assistant_cannot_sign_off(task_repo):
    kernel_change(task_repo)
    task_repo.commit("kernel", "Task: attn_res_mix", "Co-authored-by: Claude <noreply@anthropic.com>",
                     "Signed-off-by: Claude <noreply@anthropic.com>")
    assert [rule for _, rule, _ in violations(task_repo)] == ["owner"]


def test_gates_thresholds_and_envelope(task_repo):
    """A task asking for benchmarks and speedups, a contract claiming TP 2 and a looser tolerance."""
    task_repo.write_task({**TASK, "required_gates": ["contracts", "numerics", "benchmarks"],
                          "success": {"speedup": [{"batch": 1, "min": 1.5}, {"batch": 8, "min": 1.2}],
                                      "numerics": {"max_rel_l2": 1e-6, "max_units": 3}}})
    task_repo.commit("core: tighter task")
    task_repo.repo.git.checkout("-q", "-b", "task2")
    task_repo.edit(KERNEL)
    task_repo.edit_contract(tp_sizes=[1, 2], state_tolerance={"atol": 1e-6, "rtol": 0.0, "max_rel_l2": 1e-7,
                                                               "max_units": 10})
    task_repo.gate(gates=(passed("contracts"), not_run("compile"), passed("numerics"), benchmarks({1: 1.3})))
    task_repo.commit("kernel", *TRAILERS)
    found = violations(task_repo, base="task")
    assert ("evidence/attn_res/cpu", "thresholds",
            "batch 1: 1.30× over the standard at batch 1 · sources 9 · hidden 7168 · fp32; "
            "the task requires 1.5×") in found
    assert any(p == "evidence/attn_res/cpu" and r == "thresholds" and m.startswith("batch 8: no speedup measured")
               for p, r, m in found)
    assert (CONTRACT, "thresholds", "tolerance.max_rel_l2 1e-05 is looser than the task's 1e-06") in found
    assert (CONTRACT, "thresholds", "state_tolerance.max_units 10 is looser than the task's 3") in found
    assert not any("state_tolerance.max_rel_l2" in m for _, _, m in found)  # the state's own bound is stricter
    assert (CONTRACT, "envelope", "claims TP size 2, outside the task's envelope") in found
    task_repo.edit_contract(tp_sizes=[1])
    task_repo.gate()  # benchmarks NOT_RUN
    task_repo.commit("kernel: TP 1 only", *TRAILERS)
    assert ("evidence/attn_res/cpu", "gates", "benchmarks NOT_RUN: needs a CUDA GPU; this machine has none") in \
        violations(task_repo, base="task")


def test_speedups_bind_at_the_batch_sizes_the_contract_claims(task_repo):
    """A contract that narrows its batch range (the standard serves the rest) answers for the task's speedups inside
    it only; a range that holds none of them is itself a violation."""
    task_repo.write_task({**TASK, "required_gates": ["contracts", "numerics", "benchmarks"],
                          "success": {"speedup": [{"batch": 1, "min": 1.5}, {"batch": 8, "min": 1.2}]}})
    task_repo.commit("core: tighter task")
    task_repo.repo.git.checkout("-q", "-b", "task2")
    task_repo.edit(KERNEL)
    def points(batch: int) -> dict:
        return {"points": [{"batch": batch, "shape": {"sources": 9, "hidden": 7168}}], "required_speedup": 1.2}

    task_repo.edit_contract(batch={"min": 1, "max": 4}, benchmark=points(1))
    task_repo.gate(gates=(passed("contracts"), not_run("compile"), passed("numerics"), benchmarks({1: 1.6})))
    task_repo.commit("kernel: batch 1-4", *TRAILERS)
    assert not [m for _, rule, m in violations(task_repo, base="task") if rule == "thresholds"]
    task_repo.edit_contract(batch={"min": 2, "max": 4}, benchmark=points(2))
    task_repo.gate(gates=(passed("contracts"), not_run("compile"), passed("numerics"), benchmarks({2: 1.6})))
    task_repo.commit("kernel: batch 2-4", *TRAILERS)
    assert [m for _, rule, m in violations(task_repo, base="task") if rule == "thresholds"] == [
        "the contract's batch range holds none of the task's speedup batch sizes (1, 8)"]


def test_points_drawn_between_the_contracts_are_the_gates_to_judge_not_the_tasks(task_repo):
    """The task's speedups bind at the contract's points; a point the gate drew (anew each run) at a task batch size
    is held to the standard's speed by the gate itself, so a run's draw cannot flip the task check."""
    task_repo.write_task({**TASK, "required_gates": ["contracts", "numerics", "benchmarks"],
                          "success": {"speedup": [{"batch": 1, "min": 1.5}]}})
    task_repo.commit("core: tighter task")
    task_repo.repo.git.checkout("-q", "-b", "task2")
    task_repo.edit(KERNEL)
    task_repo.gate(gates=(passed("contracts"), not_run("compile"), passed("numerics"),
                          benchmarks({1: 1.6}, drawn={1: 1.1})))
    task_repo.commit("kernel", *TRAILERS)
    assert not [m for _, rule, m in violations(task_repo, base="task") if rule == "thresholds"]


def test_the_evidence_index_must_match_the_bundles(task_repo):
    kernel_change(task_repo)
    write_index(task_repo.root / "evidence", task_repo.root)
    task_repo.commit("kernel with index", *TRAILERS)
    assert violations(task_repo) == []
    index = task_repo.root / "evidence" / "index.json"
    data = json.loads(index.read_text())
    data["bundles"][0]["verdict"] = "PASSED, trust me"
    index.write_text(json.dumps(data))
    task_repo.commit("index by hand", *TRAILERS)
    assert rules(violations(task_repo)) == {("evidence/index.json", "scope")}


def test_uncommitted_and_foreign_task(task_repo):
    kernel_change(task_repo)
    sha = task_repo.commit("kernel", "Task: another_task", AGENT, OWNER)
    task_repo.write("tests/specialized/scratch.py", "x = 1\n")
    branch = read_branch(task_repo.repo, "main")
    report = check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch)
    assert [str(v) for v in report.violations] == [
        f"{sha[:12]}: task: 'kernel': Task: another_task, but the task checked is attn_res_mix",
        "tests/specialized/scratch.py: committed: not committed: commit or stash it, the check judges commits"]


def test_cli_lists_violations_one_per_line(task_repo, capsys, tmp_path):
    task_repo.write("README.md", "agent was here\n")
    sha = task_repo.commit("readme", "Task: attn_res_mix")
    summary = tmp_path / "summary.md"
    assert main(["task", "check", "--repo", str(task_repo.root), "--base", "main", "--summary", str(summary)]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "README.md: scope: outside the task's allowed paths",
        f"{sha[:12]}: disclosure: 'readme': no Assisted-by: or Co-authored-by: trailer naming the AI that helped",
        f"{sha[:12]}: owner: 'readme': no Signed-off-by: Name <email> of the human who owns and ran this change "
        "(git commit -s), other than the assistant",
        "3 violation(s) of task attn_res_mix"]
    assert "### Task check: 3 violation(s)" in out and summary.read_text() == out.removesuffix("\n")
    assert "| `README.md` | scope | outside the task's allowed paths |" in out
    assert "### Evidence diff" in out and "No evidence bundle changed." in out


def test_a_loosened_contract_needs_a_stated_reason(task_repo, capsys):
    """The change widens its own tolerance to pass: the check names the value and fails until a commit trailer
    says why; the PR summary shows the move, then the reason."""
    kernel_change(task_repo)
    task_repo.edit_contract(tolerance={"atol": 1e-5, "rtol": 1e-5, "max_rel_l2": 1e-5, "max_units": 30.0})
    task_repo.gate()
    task_repo.commit("kernel", *TRAILERS)
    assert violations(task_repo) == [
        (CONTRACT, "loosening", "tolerance.max_units 3.0 → 30.0 loosens the contract: say why in a commit trailer "
                                "`Contract-change: attn_res.tolerance.max_units: <reason>`")]
    assert main(["task", "check", "--repo", str(task_repo.root), "--base", "main"]) == 1
    out, err = capsys.readouterr()
    assert "| attn_res | tolerance.max_units | `3.0` | `30.0` | **loosened: say why** |" in out
    assert f"{CONTRACT}: loosening: tolerance.max_units 3.0 → 30.0 loosens the contract" in err
    task_repo.edit(KERNEL, "# say why\n")
    task_repo.commit("kernel: say why the bound moved", *TRAILERS,
                     "Contract-change: attn_res.tolerance: one outlier of 30 units in the heavy-tailed inputs")
    assert [v for v in violations(task_repo) if v[1] == "loosening"] == []
    branch = read_branch(task_repo.repo, "main")
    assert ("| attn_res | tolerance.max_units | `3.0` | `30.0` | loosened; why: one outlier of 30 units in the "
            "heavy-tailed inputs |") in summary(check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch))


@pytest.mark.parametrize("reason", ["", "Contract-change: attn_res: it was needed",
                                    "Contract-change: attn_res.tolerance.atol: the atol moved, not the units",
                                    "Contract-change: attn_res.tolerance.max_units:"])
def test_a_reason_must_name_the_value(task_repo, reason):
    """Naming the op alone, another value, or giving no reason is no reason."""
    kernel_change(task_repo)
    task_repo.edit_contract(tolerance={"atol": 1e-5, "rtol": 1e-5, "max_rel_l2": 1e-5, "max_units": 30.0})
    task_repo.gate()
    task_repo.commit("kernel", *TRAILERS, *([reason] if reason else []))
    assert rules(violations(task_repo)) == {(CONTRACT, "loosening")}


def test_a_tightened_contract_needs_no_reason(task_repo):
    kernel_change(task_repo)
    task_repo.edit_contract(tolerance={"atol": 1e-6, "rtol": 1e-5, "max_rel_l2": 1e-5})
    task_repo.gate()
    task_repo.commit("kernel", *TRAILERS)
    assert violations(task_repo) == []
    branch = read_branch(task_repo.repo, "main")
    text = summary(check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch))
    assert "| attn_res | tolerance.atol | `1e-05` | `1e-06` |  |" in text


def test_the_summary_names_bundles_whose_candidate_code_ran_unconfined(task_repo):
    kernel_change(task_repo)
    task_repo.gate(isolation="not confined: unshare: Operation not permitted")
    task_repo.commit("kernel", *TRAILERS)
    branch = read_branch(task_repo.repo, "main")
    text = summary(check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch))
    assert "Candidate code ran without the OS wall" in text
    assert "- attn_res / cpu: not confined: unshare: Operation not permitted" in text
    task_repo.gate(isolation="confined in a mount namespace: read-only /repo; no capabilities")
    task_repo.commit("kernel again", *TRAILERS)
    branch = read_branch(task_repo.repo, "main")
    assert "without the OS wall" not in summary(check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch))


@pytest.mark.parametrize("tasks, expected", [
    ((None, None), "no task: no commit in main..HEAD has a `Task: NAME` trailer"),
    (("a_task", "attn_res_mix"), "several tasks (a_task, attn_res_mix)"),
])
def test_cli_names_what_is_missing_to_pick_the_task(task_repo, capsys, tasks, expected):
    for i, task in enumerate(tasks):
        task_repo.edit(KERNEL, f"# step {i}\n")
        task_repo.commit(f"step {i}", *([f"Task: {task}"] if task else []), AGENT, OWNER)
    assert main(["task", "check", "--repo", str(task_repo.root), "--base", "main"]) == 2
    assert expected in capsys.readouterr().err


def test_cli_bad_base(task_repo, capsys):
    assert main(["task", "check", "--repo", str(task_repo.root), "--base", "nope", "--task", "attn_res_mix"]) == 2
    assert "--base nope: not a revision of" in capsys.readouterr().err


def test_a_task_op_that_validates_no_arch(task_repo):
    task_repo.edit(KERNEL)
    task_repo.edit_contract(hardware={"validated": [], "declared": [{"arch": "cpu", "devices": ["cpu"]}]})
    task_repo.commit("kernel, nothing validated", *TRAILERS)
    branch = read_branch(task_repo.repo, "main")
    report = check(task_at_base(task_repo.repo, branch, "attn_res_mix"), branch)
    assert [str(v) for v in report.violations] == [
        f"{CONTRACT}: evidence: the contract validates no arch: list the arch under hardware.validated, run the "
        "gates on it (make gate) and commit evidence/attn_res/<arch>/"]
    assert "No bundle yet: no contract this change touches validates an arch." in summary(report)
