"""The numerics gate on an honest candidate, and where it cannot run or has nothing to run against."""

import pytest

from gates.checks import numerics
from gates.core.status import Status
from tests.gates.fixtures.helpers import failed_checks, kda_contract, quick_options, run_gate


def test_the_reference_as_candidate_passes_every_check():
    result = run_gate(numerics.GATE, kda_contract())
    assert result.status is Status.PASSED, result.reason
    assert failed_checks(result) == set()
    on_gpu = result.details["device"] == "cuda"  # two streams at once: a GPU's check only
    assert {c["check"] for c in result.details["checks"]} == set(numerics.CHECKS) - set(
        () if on_gpu else numerics.GPU_CHECKS)
    assert (result.details["late_calls"]["concurrent"] == {"pairs": 4, "calls": 8, "at_once": 8}) if on_gpu else (
        result.details["late_calls"]["concurrent"] is None)
    batches = sorted({r["batch"] for r in result.details["rows"]})
    assert batches[0] == 1 and batches[-1] == 8 and len(batches) == 4  # both edges, two drawn between them
    assert {r["dist"] for r in result.details["rows"]} == {"normal", "heavy_tailed", "large", "mixed"}
    assert all(r["max_abs"] == 0 for r in result.details["rows"])
    assert [t["steps"] for t in result.details["trajectories"]] == [8] * 4
    production = result.details["late_calls"]["production"]
    assert production["run"] and production["first_difference"] is None
    assert production["calls"] == numerics.LATE_CALLS and production["dispatch"]["standard"] == 0


def test_the_standard_is_measured_beside_for_comparison_never_judged():
    """The standard's errors on the same inputs sit next to the candidate's; one that cannot run here (FLA needs
    CUDA) is said so, and neither changes the verdict."""
    beside_fla = run_gate(numerics.GATE, kda_contract())
    assert all(r["standard"] is None for r in beside_fla.details["rows"])
    assert "CUDA" in beside_fla.details["standard_not_run"][0] and beside_fla.status is Status.PASSED
    wrong = run_gate(numerics.GATE, kda_contract(standard="tests.adversarial.candidates:normal_inputs_only"))
    assert wrong.status is Status.PASSED  # the standard's own misses are context, not the candidate's failure
    by_dist = {r["dist"]: r["standard"] for r in wrong.details["rows"] if r["batch"] == 1}
    assert by_dist["normal"]["close_fraction"] == 1.0 and by_dist["large"]["close_fraction"] < 1.0


def test_a_gpu_only_candidate_is_not_run_on_cpu():
    result = run_gate(numerics.GATE, kda_contract(backend="cutedsl"))
    assert result.status is Status.NOT_RUN
    assert result.reason == "backend cutedsl runs only on a CUDA GPU; this machine has none"


def test_an_op_without_a_problem_is_an_error():
    result = run_gate(numerics.GATE, kda_contract(op="rope_fused"))
    assert result.status is Status.ERROR
    assert "no problem for op 'rope_fused': write gates/problems/rope_fused.py" in result.reason


def test_an_envelope_the_problem_cannot_check_is_an_error():
    result = run_gate(numerics.GATE, kda_contract(spec_tokens={"min": 0, "max": 7}))
    assert result.status is Status.ERROR and "spec_tokens 7" in result.reason


def test_the_state_may_have_its_own_tolerance():
    """The state's largest error is judged by the contract's state_tolerance where it sets one, else by the
    outputs' tolerance (3 units by default); the outputs keep theirs."""
    off = "tests.adversarial.candidates:one_state_element_off"
    strict = run_gate(numerics.GATE, kda_contract(implementation=off))
    assert strict.status is Status.FAILED_NUMERICS and "state" in failed_checks(strict)
    state_check = next(c for c in strict.details["checks"] if c["check"] == "state")
    assert "tolerance units (limit 3)" in state_check["examples"][0]
    # the fixture's state is small (512 elements a sequence): one element is 0.2 % of it and of its norm
    state_tol = {"atol": 1e-3, "rtol": 1.6e-2, "max_rel_l2": 5e-2, "min_close_fraction": 0.99, "max_units": 10}
    loose = run_gate(numerics.GATE, kda_contract(implementation=off, state_tolerance=state_tol))
    assert {"state", "tolerance"}.isdisjoint(failed_checks(loose)), loose.reason
    assert loose.details["state_tolerance"]["max_units"] == 10 and strict.details["state_tolerance"] is None
    outputs_loose = run_gate(numerics.GATE, kda_contract(implementation=off, tolerance=state_tol))
    assert "state" not in failed_checks(outputs_loose)  # without a state_tolerance the outputs' bound applies


def test_a_failure_names_the_input_seed_that_reproduces_it():
    """Each failing example carries its input's seed: the problem draws the same input from it again, and the
    candidate fails there the same way, so a failure on the GPU can be studied without rerunning the gate."""
    import re

    from gates.core.compare import check_tensor
    from gates.problems import envelope_points, load_problem, seed_for
    from tests.adversarial.candidates import one_state_element_off

    contract = kda_contract(implementation="tests.adversarial.candidates:one_state_element_off")
    result = run_gate(numerics.GATE, contract)
    example = next(c for c in result.details["checks"] if c["check"] == "state")["examples"][0]
    where = re.match(r"(.+), (\w+) #\d+ \(input seed (\d+)\), run \d+: .*= ([\d.]+) tolerance units", example)
    assert where, example
    label, dist, seed, units = where[1], where[2], int(where[3]), float(where[4])
    problem = load_problem("kda_decode")
    points = envelope_points(contract, problem, seed_for(quick_options().seed, "numerics", "points"))
    point = next(p for p in points if p.label == label)
    case = problem.generate_input(point, seed, dist)
    proj, conv, ssm, slots, w = case.args
    ref_ssm, got_ssm = ssm.clone(), ssm.clone()
    problem.reference(proj, conv.clone(), ref_ssm, slots, w)
    one_state_element_off(proj, conv.clone(), got_ssm, slots, w)
    again = check_tensor("state", got_ssm, ref_ssm, contract.tolerance)
    assert not again.passed and again.max_units == pytest.approx(units, rel=5e-3)  # the report prints 3 digits


def held(*entries: tuple[int, int, bool]) -> list[dict]:
    return [{"call": k, "bytes": b, "layout_served": served} for k, b, served in entries]


def test_memory_a_new_shape_keeps_is_reported_not_judged():
    """A workspace per shape (the first call of each layout) is what a serving engine pays once; only what grows
    over inputs of a shape already served, or over the later calls, is kept memory."""
    point = numerics.Point(batch=1, spec_tokens=0, shape=(("heads", 2),), dtype="bf16")
    findings = numerics.Findings()
    mib = 1 << 20
    kept = numerics.check_kept(point, held((-1, 0, False), (0, mib, False), (1, 2 * mib, False), (2, 2 * mib, True),
                                           (3, 2 * mib, True), (9, 2 * mib, True)), 4, 10, findings)
    assert not findings and kept == {"first_call_bytes": mib, "per_input_bytes": 0, "new_inputs": 2,
                                     "later_calls_bytes": 0}
    kept = numerics.check_kept(point, held((-1, 0, False), (0, 0, False), (1, 8192, True), (2, 16384, True),
                                           (3, 16384, True), (9, 16384 + 8192, True)), 4, 10, findings)
    assert kept["per_input_bytes"] == 16384 and kept["later_calls_bytes"] == 8192
    assert findings.counts["kept"] == 2
