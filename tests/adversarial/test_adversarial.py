"""Every known-bad candidate is rejected, with the status and the check a reviewer would expect.

Each runs the real gate (numerics, and on a GPU benchmarks) against the fixture contract with the candidate
as its implementation: a spawned process, secret-seeded inputs, verdicts in the gate.
"""

from __future__ import annotations

import functools

import pytest

from gates.checks import benchmarks, numerics
from gates.core.contracts import check_contracts
from gates.core.status import GateResult, Status
from tests.gates.fixtures.helpers import failed_checks, kda_contract, run_gate, write_contract

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
    ("normal_inputs_only", {"tolerance"}),
    ("nan_on_large_inputs", {"finite"}),
    ("fails_at_batch_edge", {"tolerance"}),
    ("reuses_freed_buffer", {"tolerance", "determinism"}),
    ("accumulates_into_its_output", {"finite", "tolerance", "determinism"}),
    ("returns_subclass", {"plain"}),
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
