"""Benchmark verdicts from raw samples (computed in the gate, not the candidate's process); the GPU run."""

import random
from dataclasses import replace

import pytest
import torch

from gates.checks import benchmarks
from gates.checks.benchmarks import judge_point, time_point, timing
from gates.checks.numerics import reference_run
from gates.core.estimate import Estimate, enough, paired_speedup
from gates.core.registry import GateOptions, arg_names
from gates.core.sources import REPO_ROOT
from gates.core.status import GateResult, Status
from gates.problems import Point, bench_point, load_problem
from kernels.arch import detect, known
from kernels.contract import load_contract
from kernels.roofline import floor
from tests.gates.fixtures.helpers import CPU_EXAMPLE, LAUNCH_US, kda_contract, paired_block, run_gate, timed

POINT = Point(1, 0, (("heads", 12), ("head_dim", 128)), "bf16")
JITTER = (0.98, 1.0, 1.0, 1.02, 1.1)


def jittered(base: float) -> list[float]:
    return [base * f for f in JITTER]


def test_timing_quartiles():
    t = timing([5.0, 1.0, 2.0, 3.0, 4.0])
    assert (t["median_us"], t["q1_us"], t["q3_us"], t["iqr_us"], t["n"]) == (3.0, 2.0, 4.0, 2.0, 5)


def test_faster_than_required():
    row, flags, slower = judge_point(POINT, *timed(jittered(10.0), jittered(20.0)), floor_us=5.0, required=1.5,
                                     min_fraction=0.4)
    assert row["speedup"] == pytest.approx(2.0) and row["roofline_fraction"] == pytest.approx(0.5)
    assert row["blocks"] == 3 and row["speedup_ci"] == pytest.approx([2.0, 2.0])
    assert flags == [] and slower == []


def test_the_headline_is_in_pipeline_and_one_call_per_graph_stands_beside_it():
    """The graph's launch, paid by every one-call replay, lowers that column's speedup; the verdict uses the
    in-pipeline times."""
    row, _, slower = judge_point(POINT, *timed(jittered(10.0), jittered(20.0)), floor_us=5.0, required=1.9,
                                 min_fraction=None)
    assert row["speedup"] == pytest.approx(2.0) and slower == []
    one = row["one_per_graph"]
    assert one["speedup"] == pytest.approx((20.0 + LAUNCH_US) / (10.0 + LAUNCH_US))
    assert one["candidate"]["median_us"] == pytest.approx(10.0 + LAUNCH_US)
    assert one["roofline_fraction"] == pytest.approx(5.0 / (10.0 + LAUNCH_US))


@pytest.mark.parametrize("alone, slower_text", [(20.0, None), (19.0, None), (17.0, "1.70× over the standard as timed "
                                                "alone (2.00× over it in the candidate's process, where it ran 1.18× "
                                                "slower), contract requires 1.8×"), (None, None)])
def test_a_yardstick_slowed_beside_the_candidate_buys_nothing_past_the_flag(alone, slower_text):
    """The standard takes 20 µs beside a 10 µs candidate: 2.0× paired. Alone it took 20 or 19 µs (drift under
    YARDSTICK_FLAG): judged 2.0×. Alone 17 µs (1.18×: flagged, not yet an ERROR): judged over 17 µs, 1.7×, under
    the required 1.8×; the audit holds a PASSED bundle to the same."""
    row, _, slower = judge_point(POINT, *timed(jittered(10.0), jittered(20.0)), floor_us=None, required=1.8,
                                 min_fraction=None, alone_us=alone)
    assert slower == ([f"{POINT.label}: {slower_text}"] if slower_text else [])
    row["standard_alone_us"] = alone
    passed = GateResult(gate="benchmarks", title="t", status=Status.PASSED, details={"rows": [row]})
    problems = benchmarks.audit(passed)
    assert problems == ([f"{POINT.label}: 1.70× over the standard as timed alone is under the required 1.8×, yet the "
                         "gate PASSED"] if slower_text else [])


@pytest.mark.parametrize("impossible_under_us, problem", [
    (9.0, None),  # 10 µs is 120 % of the 12 µs copy-rate floor, yet over the 9 µs at the peak: a fast reader
    (11.0, "10.00 µs is under the 11.00 µs its bytes take at the device's peak bandwidth, yet the gate reported "
           "PASSED"),
    (None, "120% of the roofline, yet the gate reported PASSED"),  # a bundle from before the peak was recorded
])
def test_only_a_time_under_the_peak_floor_is_impossible(impossible_under_us, problem):
    """The floor is at the measured copy rate, which a stream that mostly reads can pass; the bound no call can beat
    is the device's peak bandwidth, and a row under it must be the gate's ERROR (the audit of a recorded result)."""
    row, _, _ = judge_point(POINT, *timed(jittered(10.0), jittered(20.0)), floor_us=12.0, required=1.0,
                            min_fraction=None)
    if impossible_under_us is not None:
        row["impossible_under_us"] = impossible_under_us
    passed = GateResult(gate="benchmarks", title="t", status=Status.PASSED, details={"rows": [row]})
    assert benchmarks.audit(passed) == ([f"{POINT.label}: {problem}"] if problem else [])
    errored = GateResult(gate="benchmarks", title="t", status=Status.ERROR, reason="x", details={"rows": [row]})
    assert benchmarks.audit(errored) == []


def test_the_peak_bandwidth_is_the_vendors_or_a_margin_over_the_copy_rate():
    h100 = replace(known("sm_90"), device_name="NVIDIA H100 80GB HBM3", mem_bw_Bps=2.98e12)
    assert benchmarks.peak_bandwidth(h100) == 3.35e12
    other = replace(h100, device_name="NVIDIA H100 PCIe", mem_bw_Bps=1.8e12)
    assert benchmarks.peak_bandwidth(other) == pytest.approx(1.8e12 * benchmarks.PEAK_OVER_COPY)
    assert benchmarks.peak_bandwidth(replace(h100, mem_bw_Bps=3.5e12)) == 3.5e12  # never under what it measured


@pytest.mark.parametrize("required, min_fraction, expected", [(2.5, None, "contract requires 2.5×"),
                                                              (1.0, 0.9, "50.0% of the roofline")])
def test_slower_than_the_contract(required, min_fraction, expected):
    _, _, slower = judge_point(POINT, *timed(jittered(10.0), jittered(20.0)), floor_us=5.0, required=required,
                               min_fraction=min_fraction)
    assert len(slower) == 1 and expected in slower[0]


def test_implausible_speedup_is_flagged():
    _, flags, _ = judge_point(POINT, *timed(jittered(1.0), jittered(20.0)), floor_us=None, required=1.0,
                              min_fraction=None)
    assert "more than 10×" in flags[0]


def test_host_time_far_above_gpu_time_is_flagged():
    _, flags, _ = judge_point(POINT, *timed(jittered(10.0), jittered(20.0), host_extra=60.0), floor_us=None,
                              required=1.0, min_fraction=None)
    assert "work outside the timed stream" in flags[0]


def test_speedup_pairs_replays_timed_side_by_side():
    """A slow phase of the machine that doubles both replays of a pair leaves their ratio alone."""
    phase = [1.0, 1.0, 2.0, 2.0, 2.0]
    assert paired_speedup([10.0 * p for p in phase], [30.0 * p for p in phase]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="paired samples"):
        paired_speedup([1.0], [1.0, 2.0])


def test_interval_narrows_with_blocks_and_decides_against_a_bound():
    rng = random.Random(1)
    few, many = (Estimate(tuple(3.0 + rng.gauss(0, 0.1) for _ in range(n))) for n in (3, 30))
    assert few.half_width > many.half_width > 0
    assert many.decided(2.8) and many.decided(3.2) and not many.decided(many.mean)
    assert Estimate((3.0,)).half_width == float("inf")


def test_stopping_rule():
    tight = Estimate((3.0, 3.01, 2.99))
    assert not enough([(Estimate((3.0, 3.0)), None)], precision=0.02, min_blocks=3, max_blocks=12)
    assert enough([(tight, 2.0)], precision=0.02, min_blocks=3, max_blocks=12)
    noisy = Estimate((2.0, 4.0, 3.0))  # interval [0.5, 5.5] straddles 2.8 and is wide: keep timing
    assert not enough([(noisy, 2.8)], precision=0.02, min_blocks=3, max_blocks=12)
    assert enough([(noisy, 2.8)], precision=0.02, min_blocks=3, max_blocks=3)
    assert enough([(tight, 2.0), (noisy, 0.4)], precision=0.02, min_blocks=3, max_blocks=12)  # far from 0.4
    assert not enough([(tight, 2.0), (noisy, 2.8)], precision=0.02, min_blocks=3, max_blocks=12)  # every one


class ScriptedBox:
    """Stands in for the sandbox: serves pre-recorded blocks, one per request."""

    def __init__(self, blocks: list[dict]):
        self.blocks, self.served = list(blocks), 0

    def request(self, kind: str, **payload) -> dict:
        assert kind == "bench_block" and set(payload) == {"pairs", "check_set", "timeout_s"}
        assert 25 <= payload["pairs"] <= 75 and 0 <= payload["check_set"] < 8
        self.served += 1
        return self.blocks.pop(0)


def plan():
    return benchmarks.block_plan(seed=1, pairs=50, sets=8)


def block(candidate: float, standard: float) -> dict:
    return paired_block(jittered(candidate), jittered(standard))


def test_timing_stops_once_the_speedup_is_settled():
    options = GateOptions(seed=0)
    steady = ScriptedBox([block(10.0, 30.0)] * 12)
    assert len(time_point(steady, options, None, 2.8, None, lambda _: None, plan())) == options.min_blocks
    # one block from a slow phase of the candidate alone: more blocks, and the outlier does not decide
    noisy = ScriptedBox([block(10.0, 30.0), block(30.0, 30.0)] + [block(10.0, 30.0)] * 10)
    blocks = time_point(noisy, options, None, 2.8, None, lambda _: None, plan())
    assert options.min_blocks < len(blocks) <= options.max_blocks
    row, flags, slower = judge_point(POINT, blocks, timed([10.0], [30.0])[1], None, 2.8, None)
    assert slower == [] and row["speedup"] > 2.8 and row["blocks"] == len(blocks)


def test_a_speedup_undecided_at_the_last_block_is_flagged():
    blocks = [block(10.0, 30.0), block(10.0, 25.0), block(10.0, 32.0)]
    _, flags, slower = judge_point(POINT, blocks, timed([10.0], [30.0])[1], None, 2.8, None)
    assert slower == [] and "contains the bound 2.80×" in flags[0]


def test_not_run_without_a_gpu():
    result = run_gate(benchmarks.GATE, kda_contract())
    assert result.status is Status.NOT_RUN and result.reason == "needs a CUDA GPU; this machine has none"


@pytest.mark.gpu
def test_the_plain_pytorch_reference_against_the_fla_standard_on_gpu():
    contract = kda_contract(shapes={"heads": [12], "head_dim": [128]}, batch={"min": 1, "max": 64},
                            benchmark={"points": [{"batch": 1}, {"batch": 64}], "required_speedup": 0.01})
    result = run_gate(benchmarks.GATE, contract, bench_pairs=10, host_iters=5)
    assert result.status is Status.PASSED, result.reason
    for row in result.details["rows"]:
        assert 0 < row["speedup"] < 2 and 0 < row["roofline_fraction"] < 1
        assert row["speedup_ci"][0] <= row["speedup"] <= row["speedup_ci"][1]
        assert row["kernels"]["candidate"] > row["kernels"]["standard"] >= 1  # many small ops vs FLA's fused ones
    clock = result.details["sm_clock_mhz"]
    assert 300 < clock["alone"] < 4000 and 300 < clock["beside"] < 4000, clock  # measured in both processes
    assert clock["max"] is None or clock["max"] > 300
    declared, peaks = detect(), result.details["peaks"]  # the floors at this device's copy bandwidth, measured here
    assert 1e12 < peaks["mem_bw_Bps"] < 2e13 and peaks["declared_mem_bw_Bps"] == declared.mem_bw_Bps
    assert peaks["source"].startswith(f"copy bandwidth measured in this process on {declared.device_name};")
    assert peaks["peak_mem_bw_Bps"] >= peaks["mem_bw_Bps"]
    assert all(row["impossible_under_us"] <= row["floor_us"] for row in result.details["rows"])


def test_summary_names_a_points_shape_only_where_it_differs():
    rows = [{"batch": 1, "series": "heads 12", "speedup": 2.791}, {"batch": 4, "series": "heads 12", "speedup": 3.69},
            {"batch": 1, "series": "heads 6", "speedup": 2.73}]
    assert benchmarks.speedup_summary(rows) == "batch 1: 2.79×, batch 4: 3.69×, batch 1 (heads 6): 2.73×"


def scaled(x, scale):
    """y = x · scale: an op with a non-tensor argument that differs between input sets."""
    return x * scale


@pytest.mark.gpu
def test_each_input_set_reaches_the_op_with_its_own_scalars():
    """A CUDA graph bakes in its call's non-tensor arguments: timing every set through one graph captured on the
    first set's scalars re-checked set 2 (scaling 2.5) against an output scaled by 1.0 (the router's first bench)."""
    import torch

    from gates.core.worker import BenchSession

    entry = f"{__name__}:scaled"
    sets = [(torch.full((64,), float(k + 1)), scale) for k, scale in enumerate((1.0, 2.5, 1.0, 2.5))]
    session = BenchSession({"candidate": entry, "standard": entry}, ["x", "scale"], (), sets)
    session.block(2)
    recheck = session.finish(host_iters=1)["recheck"]
    for impl in ("candidate", "standard"):
        for (x, scale), got in zip(sets, recheck[impl]):
            (_, out), = got["outputs"]
            assert torch.equal(out.cpu(), x * scale), (impl, scale)


def test_redraw_gives_new_contents_of_the_same_magnitudes_and_keeps_integers():
    import torch

    from gates.core.worker import redraw_

    x, ids = torch.randn(64, 32).to(torch.bfloat16), torch.arange(64)
    first, second = (torch.empty_like(x), torch.empty_like(ids)), (torch.empty_like(x), torch.empty_like(ids))
    redraw_(first, (x, ids), seed=1)
    redraw_(second, (x, ids), seed=2)
    assert torch.equal(first[1], ids) and torch.equal(second[1], ids)
    ratio = (first[0].float() / x.float())[x != 0]
    assert set(ratio.unique().tolist()) == {-1.0, -0.5, 0.5, 1.0}  # exact: powers of two
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[0].abs(), x.abs())
    again = (torch.empty_like(x), torch.empty_like(ids))
    redraw_(again, (x, ids), seed=1)
    assert torch.equal(again[0], first[0])  # both implementations of a pair see the same inputs


def test_block_sizes_and_checked_sets_are_secret_draws():
    """A call counter on the device cannot know which replay is checked: the pairs before each block's check and the
    in-pipeline set checked vary from block to block, reproducibly from the seed, within their bounds."""
    import itertools

    draws = list(itertools.islice(benchmarks.block_plan(seed=7, pairs=50, sets=8), 200))
    assert draws == list(itertools.islice(benchmarks.block_plan(seed=7, pairs=50, sets=8), 200))
    assert draws != list(itertools.islice(benchmarks.block_plan(seed=8, pairs=50, sets=8), 200))
    pairs, sets = zip(*draws)
    assert min(pairs) >= 25 and max(pairs) <= 75 and len(set(pairs)) > 30
    assert set(sets) == set(range(8))
    positions = set(itertools.accumulate(pairs))  # the global index of each block's checked pair
    assert len({p % 50 for p in positions}) > 30 and len({p % 2 for p in positions}) == 2


def spot_block(candidate, standard, problems=(), where="last timed pair"):
    return {"spots": [{"where": where, "candidate": {"outputs": [("out", candidate)], "problems": list(problems)},
                      "standard": {"outputs": [("out", standard)], "problems": []}}]}


def test_outputs_that_do_not_follow_their_inputs_while_timed_are_found():
    import torch

    std = torch.randn(4, 256)
    near = std + 1e-3 * torch.randn(4, 256)
    stale = torch.randn(4, 256)  # another input's output: what a cache or skipped work returns
    assert benchmarks.spot_problems([spot_block(near, std)], "p") == []
    found = benchmarks.spot_problems([spot_block(near, std), spot_block(stale, std)], "p")
    assert len(found) == 1 and "p, block 2, last timed pair: out is" in found[0] and "do not follow" in found[0]
    nan = near.clone()
    nan[0, 0] = float("nan")
    assert benchmarks.spot_problems([spot_block(nan, std)], "p")
    assert "no out of the standard's shape" in benchmarks.spot_problems([spot_block(near[:2], std)], "p")[0]
    assert benchmarks.spot_problems([spot_block(near, std, ["out is a subclass"])], "p") == [
        "p, block 1, last timed pair: out is a subclass"]
    piped = spot_block(near, std)
    piped["spots"] += spot_block(stale, std, where="last in-pipeline pair, input set 3")["spots"]
    found = benchmarks.spot_problems([piped], "p")
    assert len(found) == 1 and found[0].startswith("p, block 1, last in-pipeline pair, input set 3: out is")


def test_integer_outputs_may_break_a_near_tie_but_not_follow_other_inputs():
    """A router's ids: two right answers may swap a pair of near-tied experts; another input's ids differ almost
    everywhere."""
    import torch

    ids = torch.stack([torch.randperm(896)[:16] for _ in range(4)])
    swapped = ids.clone()
    swapped[0, [14, 15]] = swapped[0, [15, 14]]
    assert benchmarks.spot_problems([spot_block(swapped, ids)], "p") == []
    other = torch.stack([torch.randperm(896)[:16] for _ in range(4)])
    assert "differ from the standard's" in benchmarks.spot_problems([spot_block(other, ids)], "p")[0]


_first_outputs: dict = {}


def scaled_once(x, scale):
    """x · scale on the contents its buffer held at its first call (the capture), returned from then on: a cache
    by pointer that the old benchmark (the same contents in every replay) could not see."""
    if x.data_ptr() not in _first_outputs:
        _first_outputs[x.data_ptr()] = x * scale
    return _first_outputs[x.data_ptr()] + 0  # a fresh tensor, written by the replay


@pytest.mark.gpu
def test_a_candidate_whose_timed_outputs_ignore_their_inputs_fails_the_spot_check():
    import torch

    from gates.core.worker import BenchSession

    sets = [(torch.randn(4096), 2.0) for _ in range(4)]
    for candidate, caught in ((f"{__name__}:scaled", 0), (f"{__name__}:scaled_once", 2)):
        session = BenchSession({"candidate": candidate, "standard": f"{__name__}:scaled"}, ["x", "scale"], (), sets)
        found = benchmarks.spot_problems([session.block(3, check_set=2)], "p")
        assert len(found) == caught, (candidate, found)  # the one-call pair's and the in-pipeline set's
        assert not caught or "last in-pipeline pair, input set 3" in found[1]



def _standard_off_by(rel: float) -> tuple:
    """The CPU example attn_res's first benchmark point on one input set, and the reply of a standard whose output
    is the reference's off by `rel` (relative, every element, up or down at random as rounding goes: a uniform
    scale would be a systematic error, compare.systematic_fit)."""
    contract = load_contract(CPU_EXAMPLE)
    problem = load_problem("attn_res")
    point = bench_point(contract, problem, contract.benchmark.points[0])
    expected = [reference_run(problem, problem.generate_input(point, 0, "normal"), arg_names(problem.reference),
                              "cpu")]
    gen = torch.Generator().manual_seed(0)
    replies = [{"problems": [], "states": [], "outputs": [
        (n, t * (1 + rel * (torch.randint(0, 2, t.shape, generator=gen) * 2 - 1))) for n, t in expected[0].outputs]}]
    return problem, contract, point, replies, expected


@pytest.mark.parametrize("rel, within", [(0.0, 1.0), (2.5e-5, benchmarks.STANDARD_SLACK), (1e-3, None)])
def test_a_standard_that_rounds_differently_is_told_from_one_that_disagrees(rel, within):
    """The contract's max_rel_l2 is 1e-5: 2.5 times it is a standard that rounds differently, 100 times one that
    computes something else."""
    problem, contract, point, replies, expected = _standard_off_by(rel)
    at = {slack: not benchmarks.recheck_outputs(problem, contract, point, "standard", replies, expected, slack=slack)
          for slack in (1.0, benchmarks.STANDARD_SLACK)}
    assert [slack for slack, passed in at.items() if passed][:1] == ([within] if within else [])


@pytest.mark.parametrize("beside, alone, error, flag", [(10.3, 10.0, False, False), (11.0, 10.0, False, True),
                                                         (13.0, 10.0, True, False), (10.0, None, False, False)])
def test_a_standard_slower_beside_the_candidate_than_alone(beside, alone, error, flag):
    """Machine drift between the phases stays under YARDSTICK_FLAG; a patched library or a hog does not."""
    got_error, got_flag = benchmarks.yardstick("batch 1", beside, alone)
    assert (got_error is not None, got_flag is not None) == (error, flag)
    assert got_error is None or "slows the yardstick" in got_error


class _FakeClean:
    """A stand-in for the clean process: records requests, answers bench_block with `pipeline` µs per pair."""

    def __init__(self, pipeline: list[float] | None, requests: list):
        self.pipeline, self.requests = pipeline, requests

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def request(self, kind: str, **kw):
        self.requests.append((kind, kw))
        if self.pipeline is None:
            raise benchmarks.SandboxError("the candidate's process died (exit code 1)")
        return ({"pipeline_us": {"standard": list(self.pipeline)}} if kind == "bench_block" else
                {"sm_clock_mhz": 1980.0} if kind == "bench_start" else
                {"kernels": {"standard": 3}} if kind == "bench_finish" else {})


@pytest.mark.parametrize("pipeline", [[10.0, 11.0, 12.0], None])
def test_the_standard_alone_is_timed_without_the_candidate(monkeypatch, pipeline):
    """Only the standard is started in the clean process, on the point's own sets; a failure there is a flag."""
    from gates.core.registry import GateContext

    requests: list = []
    monkeypatch.setattr(benchmarks, "Sandbox", lambda **_: _FakeClean(pipeline, requests))
    contract = kda_contract()
    ctx = GateContext(contract=contract, contract_path=REPO_ROOT / "contracts" / "kda_decode.yaml", machine=detect(),
                      options=GateOptions(seed=0))
    problem = load_problem("kda_decode")
    points = [bench_point(contract, problem, bp) for bp in contract.benchmark.points[:2]]
    drawn = []

    def draw(point):
        drawn.append(point.label)
        return [problem.generate_input(point, k, "normal") for k in range(2)]

    clocks: list[float] = []
    alone, kernels, flags = benchmarks.standard_alone(ctx, points, draw, arg_names(problem.reference), clocks)
    starts = [kw for kind, kw in requests if kind == "bench_start"]
    assert starts and all(list(kw["impls"]) == ["standard"] for kw in starts)  # never the candidate
    if pipeline:
        assert alone == {p.label: 11.0 for p in points} and flags == [] and drawn == [p.label for p in points]
        assert kernels == {p.label: 3 for p in points}
        finishes = [kw for kind, kw in requests if kind == "bench_finish"]
        assert len(finishes) == len(points) and all(kw["host_iters"] == 0 for kw in finishes)
        assert clocks == [1980.0] * len(points)  # each session's SM clock, for clock_flags
        assert sum(kind == "bench_block" for kind, _ in requests) == 2 * benchmarks.YARDSTICK_BLOCKS
    else:
        assert alone == kernels == {} and len(flags) == 1 and "could not be timed alone" in flags[0]


@pytest.mark.parametrize("beside, alone, flagged", [(3, 3, False), (2, 3, False), (4, 3, True), (4, None, False)])
def test_a_standard_that_launches_more_kernels_beside_the_candidate_than_alone_is_flagged(beside, alone, flagged):
    flag = benchmarks.extra_kernels("batch 1", beside, alone)
    assert (flag is not None) == flagged
    assert flag is None or "launched 4 kernels a call in the candidate's process and 3 alone" in flag


def test_clocks_that_moved_between_the_standard_alone_and_the_candidate_or_sit_low_are_flagged():
    assert benchmarks.clock_flags([1980.0, 1965.0], [1970.0], 1980.0) == []
    assert benchmarks.clock_flags([], [], 1980.0) == benchmarks.clock_flags([1980.0], [1500.0], None)[1:] == []
    moved = benchmarks.clock_flags([1980.0], [1500.0], None)
    assert len(moved) == 1 and "1500 MHz while the candidate's process was timed and 1980 MHz" in moved[0]
    low = benchmarks.clock_flags([1200.0], [1210.0], 1980.0)
    assert len(low) == 1 and "1200 MHz while timed, 61% of its 1980 MHz maximum" in low[0]
    assert len(benchmarks.clock_flags([1980.0], [1200.0], 1980.0)) == 2


def test_l2_set_aside_by_the_candidate_is_an_error():
    assert benchmarks.l2_set_aside("batch 1", 0) is None
    error = benchmarks.l2_set_aside("batch 1", 12 << 20)
    assert error.startswith("batch 1: ") and "12.0 MiB" in error and "persisting accesses" in error


# ------------------------------------------- points between the contract's: drawn from the seed, timed too


def _timed(contract, seed: int = 7, drawn: int = 2):
    return benchmarks.points_to_time(contract, load_problem("kda_decode"), GateOptions(seed=seed, drawn_points=drawn))


def test_the_contracts_points_come_first_then_points_drawn_between_them():
    """Batch 1-8 with points at 1 and 8: whatever the seed, the drawn points are others the contract admits."""
    contract = kda_contract()
    for seed in range(20):
        timed = _timed(contract, seed)
        assert [(p.batch, drawn) for p, _, _, drawn in timed[:2]] == [(1, False), (8, False)]
        drawn = [p for p, required, fraction, is_drawn in timed[2:] if is_drawn and (required, fraction) == (1.0, None)]
        assert len(drawn) == 2 and len(set(drawn)) == 2 and all(2 <= p.batch <= 7 for p in drawn), drawn
    assert len({tuple(p for p, *_ in _timed(contract, seed)[2:]) for seed in range(20)}) > 3  # the seed decides
    assert _timed(contract, 3) == _timed(contract, 3)  # and reproduces a run


def test_no_drawn_points_when_asked_for_none_or_the_envelope_holds_no_other():
    assert len(_timed(kda_contract(), drawn=0)) == 2
    only_its_points = kda_contract(batch={"min": 1, "max": 2}, benchmark={"points": [{"batch": 1}, {"batch": 2}],
                                                                          "required_speedup": 1.0})
    assert [p.batch for p, *_ in _timed(only_its_points, drawn=5)] == [1, 2]


@pytest.mark.parametrize("default, point_bars, bound", [(1.5, [2.5, None], 1.0), (0.1, [None, None], 0.1),
                                                        (1.2, [0.8, None], 0.8)])
def test_a_drawn_point_asks_parity_with_the_standard_or_the_contracts_lowest_bar(default, point_bars, bound):
    points = [{"batch": 1, **({"required_speedup": b} if b else {})} | ({"batch": 8} if i else {})
              for i, b in enumerate(point_bars)]
    contract = kda_contract(benchmark={"points": points, "required_speedup": default})
    assert benchmarks.between_points_bound(contract) == bound
    assert {required for _, required, _, drawn in _timed(contract) if drawn} == {bound}


def test_slower_at_a_drawn_point_says_where_and_what_to_do():
    message = benchmarks.slower_between("batch 3 · heads 2 · head_dim 16 · bf16", 0.25, 1.0)
    assert message.startswith("batch 3 · heads 2 · head_dim 16 · bf16, drawn between the contract's points: 0.25×")
    assert "narrow the envelope" in message


def test_the_summary_marks_a_drawn_point():
    rows = [{"batch": 1, "series": "heads 12", "speedup": 2.0}, {"batch": 3, "series": "heads 12", "speedup": 1.5,
                                                                 "drawn": True},
            {"batch": 5, "series": "heads 6", "speedup": 1.2, "drawn": True}]
    assert benchmarks.speedup_summary(rows) == "batch 1: 2.00×, batch 3 (drawn): 1.50×, batch 5 (heads 6, drawn): 1.20×"


# ------------------------------------------- floors at the bandwidth of the device the gate runs on

H100_COPY_BPS = 3.35e12


def test_floors_follow_the_bandwidth_measured_on_the_device_not_the_one_its_arch_declares(monkeypatch):
    """An H100 is an sm_90 like the H200 whose 4.3 TB/s the arch declares: its floors are at the bandwidth measured
    where the gate runs, the bf16 rate as declared (one compute die)."""
    measured_on = []

    def measure(info, device=None):
        measured_on.append(info.device_name)
        return replace(info, mem_bw_Bps=H100_COPY_BPS, measured=True, source="copy bandwidth measured in this process")

    monkeypatch.setattr(benchmarks, "with_measured_bandwidth", measure)
    declared = replace(known("sm_90"), device_name="NVIDIA H100 80GB HBM3")
    peaks = benchmarks.device_peaks(declared)
    assert measured_on == ["NVIDIA H100 80GB HBM3"]
    assert peaks.mem_bw_Bps == H100_COPY_BPS and peaks.measured and peaks.bf16_flops == declared.bf16_flops
    assert peaks.source == ("copy bandwidth measured in this process on NVIDIA H100 80GB HBM3; the bf16 rate as "
                            f"declared for sm_90: {declared.source}")
    assert floor(H100_COPY_BPS * 1e-6, 0.0, peaks).floor_us == pytest.approx(1.0)  # 3.35 MB at 3.35 TB/s
    assert floor(H100_COPY_BPS * 1e-6, 0.0, declared).floor_us == pytest.approx(3.35 / 4.3)  # a fifth low


@pytest.mark.parametrize("machine", [known("cpu"), replace(known("sm_90"), arch="sm_120", mem_bw_Bps=0.0,
                                                           bf16_flops=0.0)])
def test_nothing_is_measured_without_a_gpu_or_an_arch_with_declared_peaks(monkeypatch, machine):
    monkeypatch.setattr(benchmarks, "with_measured_bandwidth", lambda *_: pytest.fail("measured"))
    assert benchmarks.device_peaks(machine) is machine
