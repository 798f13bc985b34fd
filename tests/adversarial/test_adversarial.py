"""Every known-bad candidate is rejected, with the status and the check a reviewer would expect.

Each runs the real gate (numerics, and on a GPU benchmarks) against the fixture contract with the candidate
as its implementation: a spawned process, secret-seeded inputs, verdicts in the gate.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path

import pytest

from gates.checks import benchmarks, contracts, numerics
from gates.checks import compile as compile_gate
from gates.core import caches, isolation, runner, sandbox
from gates.core.contracts import check_contracts
from gates.core.sources import REPO_ROOT, import_closure
from gates.core.status import GateResult, Status
from gates.evidence.bundle import covered_sources
from gates.evidence.signing import KEY_VAR
from gates.problems import load_problem
from tests.gates.fixtures.helpers import (
    KDA_CONTRACT,
    failed_checks,
    kda_contract,
    quick_options,
    run_gate,
    write_contract,
)

CANDIDATES = "tests.adversarial.candidates"

# candidate, the checks that catch it (at least one must fail; others may too). Memory that a candidate reads
# without writing holds garbage on CPU (its first run fails the tolerance) but, on a GPU, the caching allocator
# may hand it the reference's freed result (only the runs after poisoned memory differ: determinism).
REJECTED = [
    ("cached_by_pointer", {"state"}),
    ("cached_by_content", {"repeat"}),
    ("partial_write", {"tolerance", "determinism"}),
    ("mutates_input", {"mutation"}),
    ("aliases_input", {"aliasing"}),
    ("returns_its_buffer", {"fresh"}),
    ("scratches_its_last_output", {"fresh"}),
    ("keeps_prepared_weights", {"kept"}),
    ("keeps_every_output", {"kept"}),
    ("normal_inputs_only", {"tolerance"}),
    ("nan_on_large_inputs", {"finite"}),
    ("scales_rows_without_a_floor", {"finite"}),
    ("fails_at_batch_edge", {"tolerance"}),
    ("reuses_freed_buffer", {"tolerance", "determinism"}),
    ("accumulates_into_its_output", {"finite", "tolerance", "determinism"}),
    ("returns_subclass", {"plain"}),
    ("wrong_after_warmup", {"late"}),
    ("writes_past_its_state", {"bounds"}),
    ("reads_past_its_input", {"determinism"}),
    ("reseeds_the_rng", {"process"}),
    ("lowers_matmul_precision", {"process"}),
    ("scale_folded_slightly_off", {"tolerance"}),
    ("knows_grad_mode", {"tolerance", "determinism"}),
    ("state_in_bf16_at_large_batch", {"state", "trajectory", "repeat"}),
]


@functools.cache
def numerics_of(name: str) -> GateResult:
    return run_gate(numerics.GATE, kda_contract(implementation=f"{CANDIDATES}:{name}"))


@pytest.mark.parametrize("name, catches", REJECTED, ids=[r[0] for r in REJECTED])
def test_numerics_rejects(name, catches):
    result = numerics_of(name)
    assert result.status is Status.FAILED_NUMERICS, result.reason
    assert catches & failed_checks(result), failed_checks(result)


def test_shortcut_for_normal_inputs_fails_only_off_normal():
    failing = {r["dist"] for r in numerics_of("normal_inputs_only").details["rows"] if not r["passed"]}
    assert "normal" not in failing and {"heavy_tailed", "large"} <= failing


def test_a_missing_floor_fails_only_where_rows_are_zero():
    """NaN only in the mixed inputs (every fourth row zero), from batch 4 on: the other distributions never hold a
    zero row, so a gate without them would pass this candidate."""
    failing = {(r["dist"], r["batch"]) for r in numerics_of("scales_rows_without_a_floor").details["rows"]
               if not r["passed"]}
    assert failing and all(dist == "mixed" and batch >= 4 for dist, batch in failing)


def test_a_read_past_the_input_is_caught_though_the_first_run_is_right():
    """Run 1's zones hold 0xA5 (about -3e-16: the masked read adds -0 and the result is exact); the later runs' bytes
    (NaN, 3.4e38, a subnormal) make it differ, which a single canary byte would never show."""
    result = numerics_of("reads_past_its_input")
    assert not {"tolerance", "finite", "bounds"} & failed_checks(result), failed_checks(result)


def test_a_scale_off_inside_every_bound_is_caught_only_as_systematic():
    """0.3 % high in every element: about a third of a tolerance unit, under half the norm bound, so each failure
    is the systematic-error bound's (compare.SYSTEMATIC_SHARE) and no other."""
    result = numerics_of("scale_folded_slightly_off")
    examples = [e for c in result.details["checks"] if not c["passed"] for e in c["examples"]]
    assert examples and all("systematic error" in e for e in examples), examples
    rows = result.details["rows"]
    assert max(r["max_units"] for r in rows) < 1 and max(r["rel_l2"] for r in rows) < 5e-3


def test_envelope_claim_fails_at_its_edge():
    assert {r["batch"] for r in numerics_of("fails_at_batch_edge").details["rows"] if not r["passed"]} == {8}


def test_an_interior_shape_value_is_checked():
    """Heads 2, 3, 4: the odd head count lies between the edges and must be exercised in every run."""
    result = run_gate(numerics.GATE, kda_contract(implementation=f"{CANDIDATES}:wrong_at_odd_heads",
                                                  shapes={"heads": [2, 3, 4], "head_dim": [16]}))
    assert result.status is Status.FAILED_NUMERICS and "tolerance" in failed_checks(result)
    assert {r["point"].split(" · ")[1] for r in result.details["rows"] if not r["passed"]} == {"heads 3"}
    assert result.details["coverage"]["shapes"]["heads"]["exercised"] == [2, 3, 4]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batches_between_the_edges_are_drawn(seed):
    """Batch 1-8: the secret seed draws batches from every part of the range, so 2-4 is reached whatever the seed."""
    result = run_gate(numerics.GATE, kda_contract(implementation=f"{CANDIDATES}:wrong_for_short_batches"), seed=seed)
    assert result.status is Status.FAILED_NUMERICS
    assert {r["batch"] for r in result.details["rows"] if not r["passed"]} <= {2, 3, 4}


@pytest.mark.parametrize("seed", [1, 2, 20260101])
def test_a_kernel_wrong_at_one_batch_fails_whichever_batches_are_drawn(seed):
    """Every batch of the range runs at the cheapest shape: batch 6 fails among the drawn points or in the sweep
    (at the fixtures' seed 20260101 the draws miss it)."""
    result = run_gate(numerics.GATE, kda_contract(implementation=f"{CANDIDATES}:wrong_at_one_batch"), seed=seed)
    assert result.status is Status.FAILED_NUMERICS, result.reason
    failed_rows = {r["batch"] for r in result.details["rows"] if not r["passed"]}
    failed_sweep = result.details["sweep"]["failed"]
    assert failed_rows | {int(label.split()[1]) for label in failed_sweep} == {6}
    assert result.details["coverage"]["batch"]["exercised"] == list(range(1, 9))
    if seed == 20260101:
        assert not failed_rows and failed_sweep == ["batch 6 · heads 2 · head_dim 16 · bf16"]


def test_a_result_that_depends_on_the_autograd_mode_differs_between_runs():
    """Right only with autograd on: run 1 is called as the model's forward calls it (no_grad) and fails the tolerance,
    and the runs under the other modes differ from it bit for bit."""
    assert {"tolerance", "determinism"} <= failed_checks(numerics_of("knows_grad_mode"))


def test_a_tensor_method_replaced_during_a_call_and_put_back_after_is_an_error_of_the_candidate():
    """It forges the digest of the input it wrote through torch.Tensor.detach, patched only during its calls and put
    back when the caller drops the output: the worker checks the library surface right after every call, before it
    reads anything, and the reply names the method though it was put back by then."""
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.hides_its_writes:kda_decode"))
    assert result.status is Status.ERROR, result.reason
    assert result.reason.startswith("the candidate replaced torch.Tensor.detach:"), result.reason


def test_timer_patch_is_an_error_of_the_candidate():
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.patches_timer:kda_decode"))
    assert result.status is Status.ERROR
    assert "torch.cuda.Event.elapsed_time" in result.reason and "time.perf_counter" in result.reason


def test_timer_patch_is_caught_when_the_contract_is_checked(tmp_path):
    write_contract(tmp_path, implementation="tests.adversarial.patches_timer:kda_decode")
    (problem,) = check_contracts(tmp_path)
    assert "implementation" in problem and "replaced time.perf_counter" in problem


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", [f"{CANDIDATES}:side_stream", "tests.adversarial.patches_timer:kda_decode"])
def test_benchmarks_reject_on_gpu(implementation):
    """Work left on a side stream cannot be captured with the timed stream; a patched timer taints the process."""
    contract = kda_contract(implementation=implementation,
                            benchmark={"points": [{"batch": 1}, {"batch": 8}], "required_speedup": 0.1})
    result = run_gate(benchmarks.GATE, contract)
    assert result.status is Status.ERROR, result.summary


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["shares_a_workspace", "ignores_the_stream"])
def test_two_calls_at_once_on_two_streams_must_equal_each_call_alone(name):
    """Right in every call made alone (numerics, late calls); beside another call on another stream, as serving runs
    an op's calls side by side, the workspace kept between calls or the launch on the default stream shows. A call
    on the default stream may read its slot indices while the other stream still writes them, poisoned first: an
    index out of bounds then kills the process's CUDA context (a device-side assert, as on the H100 in session 28),
    and the gate ends in ERROR at this check."""
    result = numerics_of(name)
    if result.status is Status.ERROR:
        assert result.reason.startswith("concurrent:") and "device-side assert" in result.reason, result.reason
    else:
        assert result.status is Status.FAILED_NUMERICS, result.reason
        assert "concurrent" in failed_checks(result), failed_checks(result)


@pytest.mark.gpu
def test_scratch_trusted_to_start_zeroed_is_caught_on_the_gpu():
    """Right in a fresh process and in every later call on the block it cleared; the runs after poison hand it a
    poisoned block (worker.poison empties the allocator's cache and refills it), as serving hands it a used one."""
    result = numerics_of("trusts_fresh_scratch")
    assert result.status is Status.FAILED_NUMERICS, result.reason
    assert {"determinism", "finite", "tolerance"} & failed_checks(result), failed_checks(result)


@pytest.mark.gpu
@pytest.mark.parametrize("name, caught", [("kda_decode_reads_before_wait", True),
                                          ("kda_decode_waits_then_reads", False)])
def test_a_pdl_kernel_that_reads_its_activations_before_waiting_is_caught(name, caught):
    """Right in every call made alone; behind the late writer (it lets the candidate start, then writes the
    projection) the early read sees poison. The same kernel with griddepcontrol.wait first passes (an H100,
    session 32: `early` failed the first and passed the second)."""
    result = run_gate(numerics.GATE, kda_contract(implementation=f"tests.adversarial.reads_before_wait:{name}"))
    assert ("early" in failed_checks(result)) is caught, result.reason
    assert failed_checks(result) <= {"early"}, failed_checks(result)


@pytest.mark.gpu
def test_a_candidate_wrong_only_in_cuda_graphs_fails_the_production_replay_and_the_benchmarks_recheck():
    """Right in every eager call under the gate; the numerics' production replay (the dispatcher's CUDA graphs, in a
    process without the gate) differs bitwise from those calls, and what the benchmarks' replays computed is compared
    too: either layer alone fails it (the H200's first run, session 12: the numerics did)."""
    contract = kda_contract(implementation="tests.adversarial.wrong_when_captured:kda_decode",
                            benchmark={"points": [{"batch": 1}, {"batch": 8}], "required_speedup": 0.1})
    result = run_gate(numerics.GATE, contract)
    assert result.status is Status.FAILED_NUMERICS and "production replay" in result.reason, result.reason
    result = run_gate(benchmarks.GATE, contract)
    assert result.status is Status.FAILED_NUMERICS and "out" in result.reason, result.reason


def test_asking_whether_it_is_captured_is_listed_for_review():
    result = run_gate(contracts.GATE, kda_contract(implementation="tests.adversarial.wrong_when_captured:kda_decode"))
    assert result.status is Status.PASSED, result.reason  # kernels may ask (to skip a host sync): a reviewer reads why
    assert [(f["rule"], f["cheat"], f["where"]) for f in result.details["screen"] if f["rule"] == "capture"] == [
        ("capture", False, "tests/adversarial/wrong_when_captured.py:12")]


@pytest.mark.gpu
def test_a_candidate_that_slows_the_standard_is_judged_against_the_standard_alone():
    """A library function the standard calls, patched at import (nothing guarded): the standard beside the candidate
    is slower than the same graphs in a process that never imported it."""
    contract = kda_contract(implementation="tests.adversarial.slows_the_standard:kda_decode",
                            benchmark={"points": [{"batch": 1}], "required_speedup": 0.1})
    result = run_gate(benchmarks.GATE, contract)
    assert result.status is Status.ERROR and "slows the yardstick" in result.reason, result.reason


@pytest.mark.gpu
def test_a_candidate_that_adds_a_kernel_to_the_standard_is_flagged_and_judged_against_the_standard_alone():
    """The same, one GEMM more: whatever the time says (a flag past 1.08x, the speedup then judged over the standard
    alone; an ERROR past 1.25x), the standard's extra launch is flagged."""
    contract = kda_contract(implementation="tests.adversarial.slows_the_standard_a_little:kda_decode",
                            benchmark={"points": [{"batch": 1}], "required_speedup": 0.1})
    result = run_gate(benchmarks.GATE, contract)
    assert any("adds work to the yardstick" in flag for flag in result.flags), (result.status, result.flags)
    (row,) = [r for r in result.details["rows"] if not r.get("drawn")]
    assert row["kernels"]["standard"] > row["standard_alone_kernels"]


@pytest.mark.gpu
def test_a_candidate_fast_only_at_the_contracts_points_is_slower_between_them():
    """Timed against the reference as its standard (so the candidate's tuned path is exactly 1x): at batch 1 and 8 it
    meets the contract's 0.8x, at the batches drawn between them (2-7) it is ~0.25x."""
    contract = kda_contract(implementation="tests.adversarial.slow_between_points:kda_decode",
                            standard="model.kimi_k3.ops.kda_decode:kda_decode",
                            benchmark={"points": [{"batch": 1}, {"batch": 8}], "required_speedup": 0.8})
    result = run_gate(benchmarks.GATE, contract, bench_pairs=10, host_iters=5)
    assert result.status is Status.SLOWER, result.reason
    drawn = [r for r in result.details["rows"] if r.get("drawn")]
    assert len(drawn) == 2 and all(2 <= r["batch"] <= 7 and r["speedup"] < 0.5 for r in drawn), drawn
    assert all(r["speedup"] > 0.8 for r in result.details["rows"] if not r.get("drawn"))
    assert "drawn between the contract's points" in result.reason


# ---------------------------------------------------------------- issue 23: a candidate that rewrites its judge


def test_a_candidate_that_swaps_the_workers_call_path_is_caught_in_its_process():
    """The worker fingerprints its own functions before any candidate import and checks them after every request."""
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.rewrites_judge:kda_decode"))
    assert result.status is Status.ERROR and "gates.core.worker.call" in result.reason, result.reason


def test_a_candidate_that_rewrites_its_contract_at_import_is_judged_by_the_contract_as_it_was(tmp_path, monkeypatch):
    """The runner parses the contracts before the contract check imports any entry point (the first candidate code
    to run), and never reads them again."""
    (tmp_path / "contracts").mkdir()
    path = write_contract(tmp_path / "contracts", implementation="tests.adversarial.rewrites_contract:kda_decode")
    monkeypatch.setenv("K3FORGE_ADVERSARIAL_CONTRACT", str(path))
    monkeypatch.setattr(runner, "registered", lambda: [contracts.GATE, numerics.GATE])
    outcome = runner.gate_all(tmp_path / "contracts", tmp_path / "evidence", options=quick_options())
    assert "rtol: 10.0" in path.read_text()  # it did rewrite the file
    ((_, bundle),) = outcome.bundles
    assert bundle.contract["tolerance"]["rtol"] == 0.016
    assert {g.gate: g.status for g in bundle.gates}["numerics"] is Status.FAILED_NUMERICS


needs_confinement = pytest.mark.skipif(not isolation.available().startswith("confined"),
                                       reason="this machine allows no mount namespace: no OS wall to test")


@needs_confinement
def test_a_candidate_cannot_write_into_the_tree():
    """Confined, the write fails: the candidate's call raises (it fails the numerics), nothing is written."""
    mark = REPO_ROOT / "tests" / "adversarial" / "_written_by_a_candidate.py"
    try:
        result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.writes_tree:kda_decode"))
        assert result.status is Status.FAILED_NUMERICS and "Read-only file system" in result.reason, result.reason
        assert not mark.exists()
    finally:
        mark.unlink(missing_ok=True)


def test_a_candidate_that_writes_into_the_tree_unconfined_is_caught(monkeypatch):
    """Where the OS wall is missing, the sandbox's watch finds the write and undoes it."""
    monkeypatch.setattr(sandbox, "CONFINE", False)
    mark = REPO_ROOT / "tests" / "adversarial" / "_written_by_a_candidate.py"
    try:
        result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.writes_tree:kda_decode"))
        assert result.status is Status.ERROR
        assert "wrote to the repository: tests/adversarial/_written_by_a_candidate.py (added)" in result.reason
        assert "(undone)" in result.reason and not mark.exists()  # nothing it writes survives into the tree
    finally:
        mark.unlink(missing_ok=True)


@needs_confinement
def test_a_startup_hook_planted_in_the_installation_never_lands():
    """A `.pth` file beside torch would run in every later Python process; confined, the write fails, so every
    later process (here, the production replay and the candidate's own) starts clean."""
    from tests.adversarial import patches_the_installation as candidate

    candidate.RAN.unlink(missing_ok=True)
    try:
        result = run_gate(numerics.GATE,
                          kda_contract(implementation="tests.adversarial.patches_the_installation:kda_decode"))
        assert result.status is Status.PASSED, result.reason  # nothing it did had an effect
        assert result.details["confined"].startswith("confined in")
        assert not candidate.HOOK.exists() and not candidate.RAN.exists()
    finally:
        candidate.HOOK.unlink(missing_ok=True)
        candidate.RAN.unlink(missing_ok=True)


def test_a_usercustomize_planted_in_the_home_directory_is_caught_and_undone(tmp_path, monkeypatch):
    """The user site directory is under the home directory, which a confined child still writes: the watch finds
    the planted module after the reply and removes it (PYTHONUSERBASE points the candidate's process and the watch
    at a folder of the test's own)."""
    from tests.adversarial import plants_usercustomize as candidate

    monkeypatch.setenv("PYTHONUSERBASE", str(tmp_path / "userbase"))
    candidate.RAN.unlink(missing_ok=True)
    site_dir = sandbox.user_site()
    try:
        result = run_gate(numerics.GATE,
                          kda_contract(implementation="tests.adversarial.plants_usercustomize:kda_decode"))
        assert result.status is Status.ERROR, result.reason
        assert f"planted in Python's user site directory ({site_dir})" in result.reason, result.reason
        assert "usercustomize.py (added)" in result.reason and "(undone)" in result.reason
        assert not (site_dir / "usercustomize.py").exists() and not candidate.RAN.exists()
    finally:
        candidate.RAN.unlink(missing_ok=True)


def test_a_startup_hook_planted_unconfined_is_caught(monkeypatch):
    """Where the OS wall is missing, the watch compares the installation when the candidate's process has ended:
    the planted hook is an ERROR of the candidate, named, and left for a person to remove (nothing kept the
    bytes to undo it with)."""
    from tests.adversarial import patches_the_installation as candidate

    monkeypatch.setattr(sandbox, "CONFINE", False)
    try:
        result = run_gate(numerics.GATE,
                          kda_contract(implementation="tests.adversarial.patches_the_installation:kda_decode"))
        assert result.status is Status.ERROR, result.reason
        assert f"changed the Python installation, which every later process runs: {candidate.HOOK} (added)" in \
            result.reason and "reinstall" in result.reason
    finally:
        candidate.HOOK.unlink(missing_ok=True)
        candidate.RAN.unlink(missing_ok=True)


def test_a_process_the_candidate_leaves_behind_is_stopped_before_it_can_write():
    """A daemon (forked twice, a session of its own) that would write into the tree after the sandbox's last look:
    an ERROR of the candidate, and the daemon is stopped, so that nothing it would do happens."""
    from tests.adversarial import leaves_a_process as candidate

    candidate.PID_FILE.unlink(missing_ok=True)
    try:
        result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.leaves_a_process:kda_decode"))
        assert result.status is Status.ERROR and "left processes running outside it" in result.reason, result.reason
        daemon = int(candidate.PID_FILE.read_text())
        assert f"{daemon} (" in result.reason and "(stopped)" in result.reason
        time.sleep(candidate.WAIT_S + 1)
        assert not candidate.MARK.exists() and not Path(f"/proc/{daemon}").exists()
    finally:
        candidate.MARK.unlink(missing_ok=True)
        candidate.PID_FILE.unlink(missing_ok=True)


def test_a_candidate_right_only_in_the_gates_process_fails_the_production_replay():
    """Every call under the worker is right; the same calls through the dispatcher in a process without the gate
    are not (issue 23, class 3, production equivalence)."""
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.knows_its_process:kda_decode"))
    assert result.status is Status.FAILED_NUMERICS, result.reason
    assert failed_checks(result) == {"production"}, failed_checks(result)
    production = result.details["late_calls"]["production"]
    assert production["run"] and production["first_difference"] == 1


# ------------------------------------------------------------- issue 23: a static screen of the candidate's code

SCREENED = [
    ("tests.adversarial.rewrites_judge:kda_decode", "assigns gates.core.worker.call, which the gate judges"),
    ("tests.adversarial.patches_timer:kda_decode", "assigns time.perf_counter, which the gate judges or times"),
    ("tests.adversarial.knows_it_is_judged:by_imported_modules", "names the gate harness ('gates.core.worker')"),
    ("tests.adversarial.knows_it_is_judged:by_call_stack", "calls sys._getframe: reads the frames of whoever"),
    ("tests.adversarial.knows_it_is_judged:by_production_replay", "names the gate harness ('model.kimi_k3.replay')"),
    ("tests.adversarial.knows_it_is_judged:by_importing_the_replay",
     "imports model.kimi_k3.replay, the gate's production replay"),
    ("tests.adversarial.writes_tree:kda_decode", ".write_text(): writes into the repository"),
    ("tests.adversarial.hides_its_writes:kda_decode", "setattrs torch.Tensor.detach, which the gate judges or"),
]


@pytest.mark.parametrize("implementation, finding", SCREENED, ids=[s[0].split(".")[-1] for s in SCREENED])
def test_code_that_can_only_be_cheating_fails_the_contracts_gate_before_any_call(implementation, finding):
    result = run_gate(contracts.GATE, kda_contract(implementation=implementation))
    assert result.status is Status.ERROR and finding in result.reason, result.reason


@pytest.mark.parametrize("implementation", ["model.kimi_k3.specialized.kda_decode:kda_decode_cute",
                                            "model.kimi_k3.specialized.linear:linear_cute",
                                            "model.kimi_k3.specialized.attn_res_fused:attn_res_fused"])
def test_the_repository_kernels_pass_the_screen(implementation):
    """Nothing in the real kernels (and the toolkit they import) can only be cheating; what they do that a reviewer
    should see (the toolkit reading CUTE_DSL_ARCH from the environment) is listed."""
    result = run_gate(contracts.GATE, kda_contract(implementation=implementation))
    assert result.status is Status.PASSED, result.reason
    assert not any(f["cheat"] for f in result.details["screen"])
    if "cute" in implementation:
        assert any(f["rule"] == "environment" and f["where"].startswith("kernels/cute.py")
                   for f in result.details["screen"])


def test_a_thread_started_beside_the_call_is_listed_for_review():
    result = run_gate(contracts.GATE, kda_contract(implementation="tests.adversarial.starts_thread:kda_decode"))
    assert result.status is Status.PASSED, result.reason  # listed, not failed: the reviewer judges what it does
    assert [(f["rule"], f["cheat"], f["where"]) for f in result.details["screen"] if f["rule"] == "concurrency"] == [
        ("concurrency", False, "tests/adversarial/starts_thread.py:11")]


def test_asking_the_l2_to_keep_lines_is_listed_for_review():
    """One finding a line (the set-aside, the window, the stream attribute), not failed: an eviction hint for data
    reused within one call is legitimate; the benchmarks judge what the process actually set aside."""
    result = run_gate(contracts.GATE, kda_contract(implementation="tests.adversarial.keeps_lines_in_l2:kda_decode"))
    assert result.status is Status.PASSED, result.reason
    assert [(f["cheat"], f["where"]) for f in result.details["screen"] if f["rule"] == "l2_residency"] == [
        (False, f"tests/adversarial/keeps_lines_in_l2.py:{line}") for line in (15, 17, 22)]


@pytest.mark.gpu
def test_a_candidate_that_sets_aside_l2_for_its_state_fails_the_benchmarks():
    """Its outputs are right; its process set aside L2 for persisting accesses (released before timing)."""
    contract = kda_contract(implementation="tests.adversarial.keeps_lines_in_l2:kda_decode",
                            benchmark={"points": [{"batch": 1}], "required_speedup": 0.1})
    result = run_gate(benchmarks.GATE, contract)
    assert result.status is Status.ERROR and "persisting accesses" in result.reason, result.reason


# --------------------------------------------------------------- issue 23: freshness follows what runs


def test_a_helper_loaded_with_importlib_is_covered():
    contract = kda_contract(implementation="tests.adversarial.dynamic_helper:kda_decode")
    result = run_gate(numerics.GATE, contract)
    assert result.status is Status.PASSED, result.reason
    helper = REPO_ROOT / "tests" / "adversarial" / "late_helper.py"
    assert helper not in import_closure(["tests.adversarial.dynamic_helper"])  # no import statement names it
    assert "tests/adversarial/late_helper.py" in result.details["loaded"]
    sources = covered_sources(contract, KDA_CONTRACT, load_problem("kda_decode").source,
                              loaded=result.details["loaded"])
    assert {s.path: s.roles for s in sources}["tests/adversarial/late_helper.py"] == ["loaded"]


def test_a_data_file_read_at_run_time_is_covered():
    contract = kda_contract(implementation="tests.adversarial.reads_table:kda_decode")
    result = run_gate(numerics.GATE, contract)
    assert result.status is Status.PASSED, result.reason
    assert "tests/adversarial/reads_table.json" in result.details["loaded"]
    assert not any(path.startswith(("gates/", "contracts/", "evidence/")) or "__pycache__" in path
                   for path in result.details["loaded"])  # the judge's own files are versioned by its digest
    sources = covered_sources(contract, KDA_CONTRACT, load_problem("kda_decode").source,
                              loaded=result.details["loaded"])
    assert {s.path: s.roles for s in sources}["tests/adversarial/reads_table.json"] == ["loaded"]


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_the_compile_gate_builds_the_module_that_defines_the_entry_point():
    """The named module re-exports the entry point and offers another kernel's compile protocol: the gate asks the
    module that defines the function, which has none."""
    contract = kda_contract(op="reverse_scale", backend="cutedsl", shapes={"block": [128]},
                            implementation="tests.adversarial.compiles_another_kernel:reverse_scale",
                            benchmark={"points": [{"batch": 1}], "required_speedup": 1.0},
                            hardware={"declared": [{"arch": "sm_90", "devices": ["NVIDIA H200"]}]})
    result = run_gate(compile_gate.GATE, contract)
    assert result.status is Status.ERROR
    assert result.reason == "tests.adversarial.candidates defines no compile_keys or compile()"


# ------------------------------------------------------- the signing key out of the candidate's reach


def test_the_candidates_process_never_sees_the_signing_key(monkeypatch):
    """The key in the gate's environment (as `k3forge gate` is run to sign its bundles): the candidate's process is
    started without it, so not even the environment block its process began with holds it."""
    monkeypatch.setenv(KEY_VAR, "a-key-no-candidate-may-read")
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.reads_the_key:kda_decode"))
    assert result.status is Status.PASSED, result.reason


def _gate_cache_with_an_entry(tmp_path, monkeypatch) -> Path:
    """The gate's Triton cache, holding one compiled kernel, where the candidate knows to look for it."""
    from tests.adversarial.rewrites_compile_cache import KNOWN_CACHE_VAR

    entry = tmp_path / "triton" / "KEY" / "fused_recurrent_kda.cubin"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"the standard's compiled kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(KNOWN_CACHE_VAR, str(tmp_path / "triton"))
    return entry


@needs_confinement
def test_the_standards_compiled_kernels_are_out_of_the_candidates_reach(tmp_path, monkeypatch):
    """Confined, the candidate's process works in its own copy of the cache (which it may spoil for itself) and
    sees the gate's read-only: the gate's entry keeps its bytes and nothing is planted beside it, so the kernels
    every later process of the gate loads are the ones its compilers made."""
    from tests.adversarial.rewrites_compile_cache import PLANTED

    entry = _gate_cache_with_an_entry(tmp_path, monkeypatch)
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.rewrites_compile_cache:kda_decode"))
    assert result.status is Status.PASSED, result.reason
    assert entry.read_bytes() == b"the standard's compiled kernel"
    assert not (tmp_path / "triton" / PLANTED).exists()
    assert (Path(caches.candidate_env()["TRITON_CACHE_DIR"]) / PLANTED).exists()  # it did act: on its own copy


def test_a_candidate_that_rewrites_the_standards_compiled_kernels_unconfined_is_caught(tmp_path, monkeypatch):
    """Where the OS wall is missing, the gate's existing entries are held to their bytes: an ERROR, and the rewritten
    entry removed (its next use compiles it afresh). (An entry planted under a new key is out of the watch's reach
    there: PRACTICES says so.)"""
    monkeypatch.setattr(sandbox, "CONFINE", False)
    entry = _gate_cache_with_an_entry(tmp_path, monkeypatch)
    result = run_gate(numerics.GATE, kda_contract(implementation="tests.adversarial.rewrites_compile_cache:kda_decode"))
    assert result.status is Status.ERROR and "compile cache" in result.reason, result.reason
    assert not entry.exists()
