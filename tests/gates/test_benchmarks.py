"""Benchmark verdicts from raw samples (computed in the gate, not the candidate's process); the GPU run."""

import pytest

from gates.problems import Point
from gates.status import Status
from gates.suite import benchmarks
from gates.suite.benchmarks import judge_point, timing
from tests.gates.fixtures.helpers import kda_contract, run_gate

POINT = Point(1, 0, (("heads", 12), ("head_dim", 128)), "bf16")


def raw(candidate: float, standard: float, host_extra: float = 5.0) -> dict:
    return {"device_us": {"candidate": [candidate * f for f in (0.98, 1.0, 1.0, 1.02, 1.1)],
                          "standard": [standard * f for f in (0.98, 1.0, 1.0, 1.02, 1.1)]},
            "host_us": {"candidate": [candidate + host_extra] * 5, "standard": [standard + 5.0] * 5},
            "kernels": {"candidate": 1, "standard": 5}}


def test_timing_quartiles():
    t = timing([5.0, 1.0, 2.0, 3.0, 4.0])
    assert (t["median_us"], t["q1_us"], t["q3_us"], t["iqr_us"], t["n"]) == (3.0, 2.0, 4.0, 2.0, 5)


def test_faster_than_required():
    row, flags, slower = judge_point(POINT, raw(10.0, 20.0), floor_us=5.0, required=1.5, min_fraction=0.4)
    assert row["speedup"] == pytest.approx(2.0) and row["roofline_fraction"] == pytest.approx(0.5)
    assert flags == [] and slower == []


@pytest.mark.parametrize("required, min_fraction, expected", [(2.5, None, "contract requires 2.5×"),
                                                              (1.0, 0.9, "50.0% of the roofline")])
def test_slower_than_the_contract(required, min_fraction, expected):
    _, _, slower = judge_point(POINT, raw(10.0, 20.0), floor_us=5.0, required=required, min_fraction=min_fraction)
    assert len(slower) == 1 and expected in slower[0]


def test_implausible_speedup_is_flagged():
    _, flags, _ = judge_point(POINT, raw(1.0, 20.0), floor_us=None, required=1.0, min_fraction=None)
    assert "more than 10×" in flags[0]


def test_host_time_far_above_gpu_time_is_flagged():
    _, flags, _ = judge_point(POINT, raw(10.0, 20.0, host_extra=60.0), floor_us=None, required=1.0, min_fraction=None)
    assert "work outside the timed stream" in flags[0]


def test_not_run_without_a_gpu():
    result = run_gate(benchmarks.GATE, kda_contract())
    assert result.status is Status.NOT_RUN and result.reason == "needs a CUDA GPU; this machine has none"


@pytest.mark.gpu
def test_the_plain_pytorch_reference_against_the_fla_standard_on_gpu():
    contract = kda_contract(shapes={"heads": [12], "head_dim": [128]}, batch={"min": 1, "max": 64},
                            benchmark={"points": [{"batch": 1}, {"batch": 64}], "required_speedup": 0.01})
    result = run_gate(benchmarks.GATE, contract, bench_iters=20, host_iters=5)
    assert result.status is Status.PASSED, result.reason
    for row in result.details["rows"]:
        assert 0 < row["speedup"] < 2 and 0 < row["roofline_fraction"] < 1
        assert row["kernels"]["candidate"] > row["kernels"]["standard"] >= 1  # many small ops vs FLA's fused ones
