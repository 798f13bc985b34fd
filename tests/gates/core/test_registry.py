"""The gate registry and runner: order, prerequisites, crashes, and a model-level eval plugged in."""

from gates.core.registry import Gate, registered
from gates.core.runner import run_gates
from gates.core.status import GateResult, Status, worst
from kernels.arch import detect
from tests.gates.fixtures.helpers import KDA_CONTRACT, kda_contract, quick_options


def _gate(name, status=Status.PASSED, needs=()):
    return Gate(name, name.title(), f"{name} passes",
                lambda ctx: GateResult(gate=name, title=name.title(), status=status, summary=name), needs=needs)


def test_registered_order():
    assert [g.name for g in registered()] == ["contracts", "compile", "numerics", "benchmarks", "evals"]


def test_prerequisites_crashes_and_an_eval_gate():
    def crash(ctx):
        raise RuntimeError("boom")

    gates = [_gate("numerics", Status.FAILED_NUMERICS), _gate("evals_long_context", needs=("numerics",)),
             Gate("crashy", "Crashy", "never raises", crash), _gate("evals_sampling", Status.FAILED_EVAL)]
    results = run_gates(kda_contract(), KDA_CONTRACT, detect(), quick_options(), gates=gates)
    assert [r.status for r in results] == [Status.FAILED_NUMERICS, Status.NOT_RUN, Status.ERROR, Status.FAILED_EVAL]
    assert results[1].reason == "the numerics gate FAILED_NUMERICS"
    assert results[2].reason == "RuntimeError: boom" and "Traceback" in results[2].details["traceback"]


def test_worst_status():
    assert worst([Status.PASSED, Status.NOT_RUN, Status.SLOWER]) is Status.SLOWER
    assert worst([Status.FAILED_EVAL, Status.ERROR]) is Status.ERROR
    assert worst([Status.NOT_RUN]) is Status.NOT_RUN and not Status.NOT_RUN.failed
