"""The gate registry and runner: order, prerequisites, crashes, and a model-level eval plugged in."""

import dataclasses
import threading
import time

import pytest

from gates.checks.benchmarks import never_timed
from gates.core import runner
from gates.core.registry import Gate, registered, unjudged, verdict_of
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


@pytest.mark.parametrize("host_status", [Status.PASSED, Status.FAILED_NUMERICS])
def test_a_gate_beside_another_runs_with_it_and_counts_only_if_it_passes(host_status):
    """The evals start with the numerics (each waits for the other to have started: run one after the other, the
    host would time out) and are waited for before the next gate; reported in their own place, NOT_RUN if the
    numerics failed."""
    started = {name: threading.Event() for name in ("numerics", "evals")}
    order = []

    def together(name, status):
        def run(ctx):
            started[name].set()
            other = next(n for n in started if n != name)
            assert started[other].wait(10), f"{name} ran alone"
            time.sleep(0.2 if name == "evals" else 0)  # the companion outlives its host: waited for all the same
            order.append(name)
            return GateResult(gate=name, title=name.title(), status=status, summary=name)
        return run

    def after(ctx):
        order.append("benchmarks")
        return GateResult(gate="benchmarks", title="Benchmarks", status=Status.PASSED, summary="timed")

    gates = [Gate("numerics", "Numerics", "right", together("numerics", host_status)),
             Gate("benchmarks", "Benchmarks", "fast", after, needs=("numerics",)),
             Gate("evals", "Evals", "evals pass", together("evals", Status.PASSED), needs=("numerics",),
                  beside="numerics")]
    results = run_gates(kda_contract(), KDA_CONTRACT, detect(), quick_options(), gates=gates)
    assert [r.gate for r in results] == ["numerics", "benchmarks", "evals"]
    if host_status is Status.PASSED:
        assert order == ["numerics", "evals", "benchmarks"]
        assert [r.status for r in results] == [Status.PASSED] * 3 and results[2].seconds >= 0.2
    else:
        assert order == ["numerics", "evals"]
        assert [r.status for r in results] == [Status.FAILED_NUMERICS, Status.NOT_RUN, Status.NOT_RUN]
        assert results[2].reason == "the numerics gate FAILED_NUMERICS"


@pytest.mark.parametrize("gib, together", [(80, False), (141, True)])
def test_a_gpu_too_small_for_two_gates_runs_them_one_after_the_other(monkeypatch, gib, together):
    """On an 80 GB H100 the evals beside a KDA numerics run asked for memory the card no longer had; there the
    companion runs in its own place, after the host and the gates before it."""
    monkeypatch.setattr(runner, "gpu_memory_bytes", lambda: gib * 2**30)
    running, overlapped = set(), []

    def run(name):
        def fn(ctx):
            overlapped.append(bool(running))
            running.add(name)
            time.sleep(0.1)
            running.discard(name)
            return GateResult(gate=name, title=name.title(), status=Status.PASSED, summary=name)
        return fn

    gates = [Gate("numerics", "Numerics", "right", run("numerics")),
             Gate("benchmarks", "Benchmarks", "fast", run("benchmarks"), needs=("numerics",)),
             Gate("evals", "Evals", "evals pass", run("evals"), needs=("numerics",), beside="numerics")]
    gpu = dataclasses.replace(detect(), arch="sm_90")  # a GPU as the runner sees it; the gates here never look
    results = run_gates(kda_contract(), KDA_CONTRACT, gpu, quick_options(), gates=gates)
    assert [r.status for r in results] == [Status.PASSED] * 3
    assert any(overlapped) is together


def test_worst_status():
    assert worst([Status.PASSED, Status.NOT_RUN, Status.SLOWER]) is Status.SLOWER
    assert worst([Status.FAILED_EVAL, Status.ERROR]) is Status.ERROR
    assert worst([Status.NOT_RUN]) is Status.NOT_RUN and not Status.NOT_RUN.failed
    # what did not run was not judged: one eval PASSED and two NOT_RUN is not PASSED (issue 23)
    assert worst([Status.PASSED, Status.NOT_RUN, Status.NOT_RUN]) is Status.NOT_RUN
    assert worst([]) is Status.NOT_RUN


def _results(**statuses) -> list[GateResult]:
    return [GateResult(gate=name, title=name, status=Status(status)) for name, status in statuses.items()]


def test_a_verdict_means_judged():
    """PASSED only when every gate that applies on the arch passed; what does not apply there (benchmarks on cpu,
    compile for a torch backend) neither blocks nor makes it."""
    torch_cpu, cute = kda_contract(), kda_contract(backend="cutedsl")
    passed = dict(contracts="PASSED", compile="NOT_RUN", numerics="PASSED", benchmarks="NOT_RUN", evals="PASSED")
    assert verdict_of(torch_cpu, "cpu", _results(**passed)) is Status.PASSED
    assert verdict_of(torch_cpu, "sm_90", _results(**passed)) is Status.NOT_RUN  # benchmarks apply on a GPU
    # a GPU kernel's CPU bundle: compile passed, numerics and evals could not run here: not judged, never PASSED
    cpu_bundle = dict(contracts="PASSED", compile="PASSED", numerics="NOT_RUN", benchmarks="NOT_RUN", evals="NOT_RUN")
    assert verdict_of(cute, "cpu", _results(**cpu_bundle)) is Status.NOT_RUN
    assert unjudged(cute, "cpu", _results(**cpu_bundle)) == ["the numerics gate NOT_RUN: ", "the evals gate NOT_RUN: "]
    assert verdict_of(cute, "cpu", _results(**{**cpu_bundle, "compile": "FAILED_COMPILE"})) is Status.FAILED_COMPILE
    assert verdict_of(torch_cpu, "cpu", _results(contracts="PASSED")) is Status.NOT_RUN  # missing gates count


def test_a_contract_whose_speed_no_validated_arch_judges_is_flagged():
    validated = {"validated": [{"arch": "cpu", "devices": ["cpu"]}]}
    assert "speed never judged: kda_decode validates only cpu" in never_timed(kda_contract(hardware=validated))
    assert never_timed(kda_contract()) is None  # validates nothing yet
    gpu = {"validated": [{"arch": "cpu", "devices": ["cpu"]}, {"arch": "sm_90", "devices": ["NVIDIA H200"]}]}
    assert never_timed(kda_contract(hardware=gpu)) is None
