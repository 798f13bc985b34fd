"""Benchmark gate (GPU only): the candidate against the standard implementation at each contract benchmark point.

Both are timed side by side in the candidate's process (gates.core.worker.BenchSession), two ways:
- in-pipeline, the headline: the N input sets in one CUDA graph, an L2 flush before each call, the flushes' own
  identical graph replayed beside it and subtracted, per-call time = difference / N: the graph's launch latency is
  paid once for N calls, as a decode step pays it once for its ~100 layers;
- one call per graph replay (the gate's earlier method, kept as a second column): fresh inputs copied in and the
  L2 flushed before every replay, so each replay also pays the graph's launch (~4 µs on the H200).
Both in interleaved pairs, a spin kernel so the events time the GPU and not the host's enqueueing, plus host wall
time with a device-wide synchronize. The gate asks for blocks of pairs until the in-pipeline speedup and the
fraction of the roofline are settled (gates.core.estimate: each block one observation, a 95 % interval over blocks);
only raw samples come back, and medians, speedups, intervals and verdicts are computed here. The step's
activation (every op's first argument) is redrawn for every timed replay, so no cached output is ever right;
each block's last pair of outputs, candidate against standard on the same redrawn inputs, must agree
(`spot_problems`), of the one-call replays and of one in-pipeline input set; how many pairs a block has and which
set is checked are drawn from the gate's secret seed (`block_plan`), so code counting its calls on the device
cannot know which replay is looked at. After timing every input set's outputs are checked against the reference.
Besides the contract's points, `drawn_points` points the contract admits are drawn from the secret seed and timed
the same way; there the candidate must be at least as fast as the standard (`between_points_bound`): a kernel
tuned only at the listed points is slow in the gate, not first in serving.
The floor is at the copy bandwidth measured in the gate's process on the device it runs on, before anything is
timed (`device_peaks`: an arch's declared figure is one device's, sm_90's the H200's 4.3 TB/s where an H100 copies
~2.98 TB/s), and at the arch's declared bf16 rate. A copy's rate is not memory's peak (a stream that mostly reads can
pass it), so a fraction of the floor may exceed 100 %; a time under the floor at the device's peak bandwidth
(`peak_bandwidth`) is an error (nothing runs faster than memory and math allow). A speedup over 10× is
flagged for the reviewer, not celebrated.
L2 that the candidate's process set aside for persisting accesses is an error too: the gate releases it before
anything is timed, but in serving every other kernel would have that much less L2, and lines kept there would
outlive the flush.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace
from typing import Iterator, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from gates.checks.numerics import Findings, compare_named, reference_run
from gates.core.estimate import Estimate, enough, paired_speedup
from gates.core.machine import max_sm_clock_mhz
from gates.core.registry import Gate, GateContext, GateOptions, arg_names
from gates.core.sandbox import Sandbox, SandboxError
from gates.core.status import GateResult, Status
from gates.problems import Point, ProblemError, bench_point, drawn_points, seed_for
from kernels.arch import ArchInfo, with_measured_bandwidth
from kernels.contract import Contract
from kernels.roofline import floor
from kernels.validation import problem_lines

NAME, TITLE = "benchmarks", "Benchmarks"
BLOCK_TIMEOUT_S = 120.0  # one block of replays takes well under a second on a working GPU
START_TIMEOUT_S = 300.0  # compiling, autotuning and capturing both implementations: a minute at most so far
SUSPICIOUS_SPEEDUP = 10.0
# The standard is also timed alone, in a process that never imports the candidate (standard_alone), for this many
# blocks a point. Beside the candidate it may be this much slower (a ratio of in-pipeline medians) before the gate
# says so, and this much before the measurement is an ERROR: the same graphs on the same inputs in two processes
# differ by the machine's drift between the phases (a few %), not by 25 %.
YARDSTICK_BLOCKS = 2
YARDSTICK_FLAG = 1.08
YARDSTICK_ERROR = 1.25
# The SM clock at each timed session's start (clock_flags): flagged where the candidate's sessions and the standard's
# alone differ by more than CLOCK_DRIFT, or where any is under CLOCK_LOW of the GPU's maximum. Flags, not errors,
# until H200 runs show how far the measured clock moves on its own.
CLOCK_DRIFT, CLOCK_LOW = 0.05, 0.85
HIDDEN_WORK_US = 10.0  # host-over-device excess beyond the standard's that suggests work off the timed stream
IMPLS = ("candidate", "standard")
# A standard farther from the reference than the candidate's tolerance may still compute the op: a library that
# rounds an intermediate to bf16 (FLA's short-conv output, where the reference keeps fp32) is ~1-2 bf16 ulps off.
# Past this many times the tolerance it is no yardstick (skipped work, another op): the speedup then means little.
STANDARD_SLACK = 4.0
# A statistic of paired replays may sit this far (as a ratio) from the same statistic of the pooled medians;
# the H200 runs recorded so far sit within 1 %, so a larger gap means the numbers were not measured together.
POOLED_SLACK = 1.25
# Each block's last pair ran candidate and standard on the same redrawn inputs (BenchSession): two right answers
# lie within the op's tolerance of each other (a relative L2 of 2e-2 at most in every contract); an output that
# does not follow its inputs (cached, or work skipped) is about sqrt(2) from the standard's.
SPOT_REL_L2 = 0.25
# Integer outputs (the router's expert ids) differ only where two right answers break a near-tie differently (a
# pair of swapped ids among a token's 16); another input's ids differ almost everywhere.
SPOT_MISMATCH = 0.5


def timing(samples: list[float]) -> dict:
    """Median, quartiles (inclusive method), IQR, min, mean and n of per-call times in µs."""
    xs = sorted(samples)
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median_us": med, "q1_us": q1, "q3_us": q3, "iqr_us": q3 - q1, "min_us": xs[0],
            "mean_us": statistics.fmean(xs), "n": len(xs)}


def speedup_summary(rows: list[dict]) -> str:
    """`batch 1: 2.79×, batch 4: 3.69×, batch 1 (heads 6 · ...): 2.73×, batch 3 (drawn): 2.9×`: the first point's
    shape goes unsaid."""
    parts = []
    for r in rows:
        tags = ([] if r["series"] == rows[0]["series"] else [r["series"]]) + (["drawn"] if r.get("drawn") else [])
        said = f" ({', '.join(tags)})" if tags else ""
        parts.append(f"batch {r['batch']}{said}: {r['speedup']:.2f}×")
    return ", ".join(parts)


def between_points_bound(contract: Contract) -> float:
    """The speedup a candidate owes at a drawn point (drawn_points): none slower than the standard where the contract
    admits it (narrow the envelope instead), or the contract's lowest bar at its own points where that is lower
    (a contract asking 0.5× at its points is not judged harder between them)."""
    return min(1.0, *(contract.benchmark.requirement(bp)[0] for bp in contract.benchmark.points))


def points_to_time(contract: Contract, problem, opts: GateOptions) -> list[tuple[Point, float, float | None, bool]]:
    """(point, required speedup, required fraction of the roofline, drawn) for each point the gate times: the
    contract's benchmark points with their bars, then `opts.drawn_points` drawn from the secret seed, each held to
    between_points_bound."""
    listed = [(bench_point(contract, problem, bp), *contract.benchmark.requirement(bp), False)
              for bp in contract.benchmark.points]
    drawn = drawn_points(contract, problem, seed_for(opts.seed, NAME, "drawn"), opts.drawn_points)
    return listed + [(point, between_points_bound(contract), None, True) for point in drawn]


def slower_between(label: str, speedup: float, bound: float) -> str:
    return (f"{label}, drawn between the contract's points: {speedup:.2f}× over the standard, the gate asks at least "
            f"{bound:g}× wherever the contract admits (make the kernel fast there or narrow the envelope)")


def block_estimates(blocks: list[dict], floor_us: float | None,
                    timing_key: str = "pipeline_us") -> tuple[Estimate, Estimate | None]:
    """The speedup and the fraction of the roofline, one observation per block of paired replays (in-pipeline
    times by default; `device_us` for one call per graph)."""
    speedups = tuple(paired_speedup(b[timing_key]["candidate"], b[timing_key]["standard"]) for b in blocks)
    fractions = (tuple(floor_us / statistics.median(b[timing_key]["candidate"]) for b in blocks)
                 if floor_us else None)
    return Estimate(speedups), Estimate(fractions) if fractions else None


def block_plan(seed: int, pairs: int, sets: int) -> Iterator[tuple[int, int]]:
    """Each block's (pairs, in-pipeline input set whose outputs are checked), drawn from a secret seed: between half
    and one and a half times `pairs`, so the checked replays fall at positions a call counter cannot predict."""
    rng = random.Random(seed)
    while True:
        yield rng.randint(max(1, pairs // 2), pairs + pairs // 2), rng.randrange(sets)


def time_point(box: Sandbox, opts: GateOptions, floor_us: float | None, required: float,
               min_fraction: float | None, progress, plan: Iterator[tuple[int, int]]) -> list[dict]:
    """Blocks of paired device times from the open bench session (sized and checked as `plan` says), until the
    bounded statistics are settled."""
    blocks: list[dict] = []
    while True:
        pairs, check_set = next(plan)
        blocks.append(box.request("bench_block", pairs=pairs, check_set=check_set, timeout_s=BLOCK_TIMEOUT_S))
        speedup, fraction = block_estimates(blocks, floor_us)
        bounded = [(speedup, required)] + ([(fraction, min_fraction)] if fraction is not None else [])
        progress(f"block {len(blocks)}: {speedup.mean:.2f}× ± {speedup.half_width:.2f}")
        if enough(bounded, opts.precision, opts.min_blocks, opts.max_blocks):
            return blocks


def spot_problems(blocks: list[dict], where: str) -> list[str]:
    """Per block and checked replay (the last one-call pair, one in-pipeline set of the last pipeline pair), where
    the candidate's outputs are not the standard's on the same inputs (SPOT_REL_L2): a candidate fast because its
    timed replays skipped work."""
    problems = []
    for b, block in enumerate(blocks, 1):
        for spot in block["spots"]:
            problems += _spot_problems(spot, f"{where}, block {b}, {spot['where']}")
    return problems


def _spot_problems(spot: dict, at: str) -> list[str]:
    problems = [f"{at}: {m}" for m in spot["candidate"]["problems"]]
    got = dict(spot["candidate"]["outputs"])
    for name, want in spot["standard"]["outputs"]:
        mine = got.get(name)
        if mine is None or mine.shape != want.shape:
            problems.append(f"{at}: no {name} of the standard's shape {tuple(want.shape)}")
            continue
        if not want.is_floating_point():
            mismatch = (mine != want).double().mean().item() if want.numel() else 0.0
            if mismatch > SPOT_MISMATCH:
                problems.append(f"{at}: {mismatch:.0%} of {name} differ from the standard's on the same redrawn "
                                f"inputs (bound {SPOT_MISMATCH:.0%}): outputs that do not follow their inputs")
            continue
        want64 = want.double()
        if not torch.isfinite(want64).all():
            continue  # the standard's own fault: the recheck against the reference reports the candidate's
        rel = ((mine.double() - want64).norm() / want64.norm().clamp_min(1e-30)).item()
        if not rel <= SPOT_REL_L2:  # NaN included
            problems.append(f"{at}: {name} is {rel:.3g} (relative L2) from the standard's on the same redrawn "
                            f"inputs (bound {SPOT_REL_L2:g}): outputs that do not follow their inputs")
    return problems


def judge_point(point: Point, blocks: list[dict], finish: dict, floor_us: float | None, required: float,
                min_fraction: float | None, alone_us: float | None = None) -> tuple[dict, list[str], list[str]]:
    """The row for one point from raw samples, its flags, and the reasons it is slower than the contract asks
    (the speedup judged over the standard alone, `alone_us`, where the candidate's process slowed it:
    yardstick_scale)."""
    def samples(key: str) -> dict[str, dict]:
        return {k: timing([t for b in blocks for t in b[key][k]]) for k in IMPLS}

    piped, single = samples("pipeline_us"), samples("device_us")
    cand, std = piped["candidate"], piped["standard"]
    host = {k: statistics.median(finish["host_us"][k]) for k in IMPLS}
    speedup, fraction = block_estimates(blocks, floor_us)
    single_speedup, single_fraction = block_estimates(blocks, floor_us, "device_us")
    row = {"point": point.label, "series": point.series, "batch": point.batch, "candidate": cand, "standard": std,
           "host_median_us": host, "speedup": speedup.mean, "speedup_ci": [speedup.low, speedup.high],
           "block_speedups": list(speedup.values), "blocks": len(blocks), "floor_us": floor_us,
           "roofline_fraction": fraction.mean if fraction else None, "kernels": finish["kernels"],
           "required_speedup": required, "min_roofline_fraction": min_fraction,
           "one_per_graph": {**single, "speedup": single_speedup.mean,
                             "speedup_ci": [single_speedup.low, single_speedup.high],
                             "roofline_fraction": single_fraction.mean if single_fraction else None}}
    flags, slower = [], []
    if speedup.mean > SUSPICIOUS_SPEEDUP:
        flags.append(f"{point.label}: {speedup.mean:.1f}× over the standard (more than {SUSPICIOUS_SPEEDUP:g}×): "
                     "check the standard and the measurement before believing it")
    gap = {k: host[k] - single[k]["median_us"] for k in host}  # host times one call per replay
    if gap["candidate"] > 2 * max(gap["standard"], 0.0) + HIDDEN_WORK_US:
        flags.append(f"{point.label}: host wall time exceeds GPU time by {gap['candidate']:.1f} µs (standard: "
                     f"{gap['standard']:.1f} µs): work outside the timed stream?")
    for name, est, bound, shown in (("speedup", speedup, required, "{:.2f}×"),
                                    ("fraction of the roofline", fraction, min_fraction, "{:.1%}")):
        if est is None or bound is None:
            continue
        if est.n > 1 and not est.decided(bound):
            flags.append(f"{point.label}: {name} {shown.format(est.mean)}, 95 % interval [{shown.format(est.low)}, "
                         f"{shown.format(est.high)}] over {est.n} blocks contains the bound {shown.format(bound)}: "
                         "judged by the mean")
    if speedup.mean < required:
        slower.append(f"{point.label}: {speedup.mean:.2f}× over the standard, contract requires {required:g}×")
    elif (judged := speedup.mean * yardstick_scale(std["median_us"], alone_us)) < required:
        slower.append(f"{point.label}: {judged:.2f}× over the standard as timed alone ({speedup.mean:.2f}× over it in "
                      f"the candidate's process, where it ran {std['median_us'] / alone_us:.2f}× slower), contract "
                      f"requires {required:g}×")
    if fraction is not None and min_fraction is not None and fraction.mean < min_fraction:
        slower.append(f"{point.label}: {fraction.mean:.1%} of the roofline, contract requires {min_fraction:.0%}")
    return row, flags, slower


def inapplicable(contract: Contract, arch: str) -> str | None:
    """Timing needs a GPU: a CPU arch is validated without benchmarks."""
    return "needs a CUDA GPU; this machine has none" if arch == "cpu" else None


def never_timed(contract: Contract) -> str | None:
    """Why the contract's speed is judged on no arch it validates (this gate applies on none of them), or None.
    Only a torch-backend contract validated on CPUs alone can be so (a GPU backend's CPU bundle is never PASSED):
    the contracts gate flags it and `contract check` prints it. It is not a contract problem, so such a contract
    (the tests' CPU example, a stand-in for the dispatch path) keeps validating; a reviewer reads its speed as
    unproven."""
    validated = contract.archs_validated
    if not validated or any(inapplicable(contract, arch) is None for arch in validated):
        return None
    return (f"speed never judged: {contract.op} validates only {', '.join(validated)}, where the benchmarks gate "
            f"does not run ({inapplicable(contract, validated[0])}); its required speedups are unproven")


class RecordedTiming(BaseModel):
    """timing() as a bundle records it."""

    model_config = ConfigDict(extra="forbid")

    median_us: PositiveFloat
    q1_us: NonNegativeFloat
    q3_us: NonNegativeFloat
    iqr_us: NonNegativeFloat
    min_us: NonNegativeFloat
    mean_us: PositiveFloat
    n: PositiveInt

    @model_validator(mode="after")
    def _ordered(self) -> "RecordedTiming":
        if not self.min_us <= self.q1_us <= self.median_us <= self.q3_us:
            raise ValueError("min, first quartile, median and third quartile are out of order")
        return self


class RecordedOnePerGraph(BaseModel):
    """The one-call-per-graph column of a row: its timings, paired speedup and fraction of the roofline."""

    model_config = ConfigDict(extra="forbid")

    candidate: RecordedTiming
    standard: RecordedTiming
    speedup: PositiveFloat
    speedup_ci: tuple[float | None, float | None]
    roofline_fraction: NonNegativeFloat | None

    @model_validator(mode="after")
    def _follows_from_its_medians(self) -> "RecordedOnePerGraph":
        from_medians = self.standard.median_us / self.candidate.median_us
        if not 1 / POOLED_SLACK <= self.speedup / from_medians <= POOLED_SLACK:
            raise ValueError(f"one call per graph: speedup {self.speedup:.4g} is far from the {from_medians:.4g} the "
                             "recorded medians give")
        return self


class RecordedRow(BaseModel):
    """A judge_point() row as a bundle records it, with what follows from its own samples."""

    model_config = ConfigDict(extra="forbid")

    point: str
    series: str
    batch: PositiveInt
    candidate: RecordedTiming
    standard: RecordedTiming
    host_median_us: dict[str, PositiveFloat]
    speedup: PositiveFloat
    speedup_ci: tuple[float | None, float | None]
    block_speedups: list[PositiveFloat] = Field(min_length=1)
    blocks: PositiveInt
    floor_us: PositiveFloat | None
    roofline_fraction: NonNegativeFloat | None
    kernels: dict[str, NonNegativeInt]
    required_speedup: PositiveFloat
    min_roofline_fraction: float | None = Field(ge=0, le=1)
    one_per_graph: RecordedOnePerGraph | None = None  # absent in bundles made before in-pipeline timing
    # how the in-pipeline calls start cold (BenchSession); absent in bundles made before the choice existed
    pipeline: Literal["flushed", "cold_sets"] | None = None
    # the standard's in-pipeline median timed alone (standard_alone); absent before that check, None where it failed
    standard_alone_us: PositiveFloat | None = None
    # the kernels a call of the standard launched there; absent before they were counted, None where that failed
    standard_alone_kernels: NonNegativeInt | None = None
    drawn: bool = False  # a point drawn between the contract's (drawn_points); absent before they were
    # the floor at the device's peak bandwidth (peak_bandwidth): a median under it is the gate's ERROR; absent before
    # floors were at a measured copy rate, when the floor itself was that bound
    impossible_under_us: PositiveFloat | None = None

    @model_validator(mode="after")
    def _follows_from_its_samples(self) -> "RecordedRow":
        if self.blocks != len(self.block_speedups):
            raise ValueError(f"{self.blocks} blocks, but {len(self.block_speedups)} block speedups")
        if not math.isclose(self.speedup, statistics.fmean(self.block_speedups), rel_tol=1e-9):
            raise ValueError(f"speedup {self.speedup:.4g} is not the mean of its blocks' speedups")
        low, high = self.speedup_ci
        if low is not None and high is not None and not low <= self.speedup <= high:
            raise ValueError(f"the 95 % interval [{low:.4g}, {high:.4g}] does not contain the speedup "
                             f"{self.speedup:.4g}")
        pooled = {"speedup": (self.speedup, self.standard.median_us / self.candidate.median_us)}
        if self.floor_us is not None and self.roofline_fraction is not None:
            pooled["fraction of the roofline"] = (self.roofline_fraction, self.floor_us / self.candidate.median_us)
        for name, (recorded, from_medians) in pooled.items():
            if not 1 / POOLED_SLACK <= recorded / from_medians <= POOLED_SLACK:
                raise ValueError(f"{name} {recorded:.4g} is far from the {from_medians:.4g} the recorded medians give")
        return self


def audit(result: GateResult) -> list[str]:
    """What in a recorded benchmarks result its own rows contradict (GATE.audit)."""
    rows = []
    for i, row in enumerate(result.details.get("rows", [])):
        try:
            rows.append(RecordedRow.model_validate(row))
        except ValidationError as e:
            return problem_lines(f"rows.{i}", e)
    problems = []
    if result.status is not Status.ERROR:  # a time under the impossible floor is the gate's ERROR, nothing else
        problems += [f"{r.point}: {r.candidate.median_us:.2f} µs is under the {r.impossible_under_us:.2f} µs its bytes "
                     f"take at the device's peak bandwidth, yet the gate reported {result.status.value}"
                     for r in rows if r.impossible_under_us and r.candidate.median_us < r.impossible_under_us]
        problems += [f"{r.point}: {r.roofline_fraction:.0%} of the roofline, yet the gate reported "
                     f"{result.status.value}" for r in rows
                     if r.impossible_under_us is None and (r.roofline_fraction or 0.0) > 1]
    if result.status is Status.PASSED:
        if not rows:
            problems.append("PASSED with no point measured")
        problems += [f"{r.point}: {r.speedup:.2f}× is under the required {r.required_speedup:g}×, yet the gate PASSED"
                     for r in rows if r.speedup < r.required_speedup]
        for r in rows:
            judged = r.speedup * yardstick_scale(r.standard.median_us, r.standard_alone_us)
            if r.speedup >= r.required_speedup > judged:
                problems.append(f"{r.point}: {judged:.2f}× over the standard as timed alone is under the required "
                                f"{r.required_speedup:g}×, yet the gate PASSED")
        problems += [f"{r.point}: {r.roofline_fraction:.1%} of the roofline is under the required "
                     f"{r.min_roofline_fraction:.0%}, yet the gate PASSED" for r in rows
                     if r.min_roofline_fraction and (r.roofline_fraction or 0.0) < r.min_roofline_fraction]
        problems += [f"{r.point}: the standard took {r.standard.median_us / r.standard_alone_us:.2f}× its time alone "
                     f"beside the candidate (the gate's bound {YARDSTICK_ERROR:g}×), yet the gate PASSED"
                     for r in rows if r.standard_alone_us and
                     r.standard.median_us / r.standard_alone_us > YARDSTICK_ERROR]
    return problems


def recheck_outputs(problem, c: Contract, point: Point, impl: str, replies: list, expected: list,
                    found: Findings | None = None, slack: float = 1.0) -> Findings:
    """One implementation's outputs and state after timing, per input set, against the reference's at the
    contract's tolerances (the state's for the state) widened `slack` times; into `found` (a new one if None)."""
    found = Findings() if found is None else found
    tolerances = [tol.model_copy(update={"atol": tol.atol * slack, "rtol": tol.rtol * slack,
                                         "max_rel_l2": tol.max_rel_l2 * slack})
                  for tol in (c.tolerance, c.tolerance_for_states)]
    for k, (got, exp) in enumerate(zip(replies, expected)):
        where = f"{point.label}, {impl} output after timing, input set {k + 1}"
        for message in got["problems"]:
            found.add("plain", f"{where}: {message}")
        compare_named(problem, got["outputs"], exp.outputs, tolerances[0], "tolerance", where, found)
        compare_named(problem, got["states"], exp.states, tolerances[1], "state", where, found)
    return found


def first(found: Findings) -> str:
    return next(iter(found.examples.values()))[0]


def clock_flags(alone: list[float], beside: list[float], max_mhz: float | None) -> list[str]:
    """Flags from the SM clock measured at the start of each timed session (worker.sm_clock_mhz), the standard's
    alone and the candidate's: clocks that differ between them (something changed the GPU's clocks in between: a
    kernel bound by memory bandwidth loses less to a lower SM clock than a latency-bound standard does, so locked
    clocks can buy a speedup), or any far under the GPU's maximum (locked or throttled: the figures hold at that
    clock only)."""
    flags = []
    if alone and beside and abs(min(beside) / min(alone) - 1) > CLOCK_DRIFT:
        flags.append(f"the GPU's SM clock was {min(beside):.0f} MHz while the candidate's process was timed and "
                     f"{min(alone):.0f} MHz while the standard was timed alone: the speedups compare timings taken "
                     "at different clocks (something changed the GPU's clocks between them)")
    if max_mhz and (alone or beside) and (lowest := min(alone + beside)) < CLOCK_LOW * max_mhz:
        flags.append(f"the GPU's SM clock was {lowest:.0f} MHz while timed, {lowest / max_mhz:.0%} of its "
                     f"{max_mhz:.0f} MHz maximum: clocks locked or throttled, so every figure holds at that clock only")
    return flags


def standard_alone(ctx: GateContext, points: list[Point], draw, names: list[str],
                   clocks: list[float]) -> tuple[dict[str, float], dict[str, int], list]:
    """Per point (label) the standard's in-pipeline median over YARDSTICK_BLOCKS blocks and the kernels one of its
    calls launches (`kernels.timing.count_kernels`, on every stream), timed and counted in a process that
    never imports the candidate, before the candidate's process starts (so that nothing of the candidate runs
    meanwhile, on the host or on the GPU), on the inputs the point is timed on; and flags where that could not be
    done. The yardstick as it runs without the candidate: a candidate whose process slows the standard (a patched
    library function, a hog on another stream) shows as the standard beside it being slower (`yardstick`), or, if
    it adds work, launching more kernels (`extra_kernels`). `draw`
    draws a point's sets, here and again for the candidate's process: holding every point's sets between the two
    phases would hold gigabytes (a 32K MLA cache, a 96-head KDA state) for the whole gate. Each session's SM clock
    goes to `clocks`."""
    c, opts = ctx.contract, ctx.options
    alone: dict[str, float] = {}
    kernels: dict[str, int] = {}
    try:
        with Sandbox(runs_candidate=False) as clean:
            for point in points:
                ctx.progress(f"benchmarks: {point.label}, the standard alone")
                sets = draw(point)
                started = clean.request("bench_start", impls={"standard": c.standard}, names=names,
                                        state=sets[0].state, sets=[s.args for s in sets], timeout_s=START_TIMEOUT_S)
                clocks += [started["sm_clock_mhz"]] if started.get("sm_clock_mhz") else []
                samples = []
                for _ in range(YARDSTICK_BLOCKS):
                    samples += clean.request("bench_block", pairs=opts.bench_pairs, check_set=0,
                                             timeout_s=BLOCK_TIMEOUT_S)["pipeline_us"]["standard"]
                alone[point.label] = statistics.median(samples)
                kernels[point.label] = clean.request("bench_finish", host_iters=0,
                                                     timeout_s=BLOCK_TIMEOUT_S)["kernels"]["standard"]
    except Exception as e:  # the check's own failure must not decide the gate: said, and the speed judged without it
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return alone, kernels, [f"the standard could not be timed alone ({reason}): nothing shows whether the "
                                "candidate's process slows it"]
    return alone, kernels, []


def extra_kernels(label: str, beside: int, alone: int | None) -> str | None:
    """The flag for a standard that launches more kernels a call in the candidate's process than alone (work added
    to the yardstick: a patched library function), or None."""
    if alone is None or beside <= alone:
        return None
    return (f"{label}: the standard launched {beside} kernels a call in the candidate's process and {alone} alone: "
            "something in the candidate's process adds work to the yardstick")


def yardstick_scale(beside_us: float, alone_us: float | None) -> float:
    """What a point's paired speedup is multiplied by to be judged: alone / beside where the standard took more
    than YARDSTICK_FLAG times its time alone in the candidate's process (the speedup is then judged over the
    standard as it runs without the candidate, so slowing it buys nothing past the flag), else 1."""
    return alone_us / beside_us if alone_us and beside_us > YARDSTICK_FLAG * alone_us else 1.0


def yardstick(label: str, beside_us: float, alone_us: float | None) -> tuple[str | None, str | None]:
    """(error, flag) from the standard's in-pipeline median beside the candidate and alone (standard_alone)."""
    if not alone_us:
        return None, None
    ratio = beside_us / alone_us
    text = (f"{label}: the standard took {beside_us:.2f} µs in the candidate's process and {alone_us:.2f} µs alone "
            f"({ratio:.2f}x)")
    if ratio > YARDSTICK_ERROR:
        return f"{text}: the candidate's process slows the yardstick, so the speedup is not over the standard", None
    if ratio > YARDSTICK_FLAG:
        return None, f"{text}: slower beside the candidate than alone, so its speedup is judged over the time alone"
    return None, None


def l2_set_aside(label: str, nbytes: int) -> str | None:
    """The error for a candidate whose process set aside `nbytes` of the L2 for persisting accesses, or None."""
    if not nbytes:
        return None
    return (f"{label}: the candidate's process set aside {nbytes / 2**20:.1f} MiB of the L2 for persisting accesses "
            "(cudaLimitPersistingL2CacheSize), a device-wide setting that no kernel owns: lines it keeps there "
            "outlive the gate's flush and a decode step's other layers, and every other kernel has that much less L2 "
            "(the gate released it before timing)")


# The vendors' peak memory bandwidth of the devices gated here, by the name torch gives them (bytes/s): no call can
# move its bytes faster. Another device: its measured copy rate times PEAK_OVER_COPY (the two above copy at ~89 % of
# their peaks: 2.98 of 3.35 TB/s, 4.3 of 4.8), so a time under that floor is still the error it should be.
PEAK_BANDWIDTH_Bps = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}
PEAK_OVER_COPY = 1.25


def peak_bandwidth(m: ArchInfo) -> float:
    """The bandwidth no call can beat on `m`'s device (PEAK_BANDWIDTH_Bps), never below its copy rate."""
    return max(PEAK_BANDWIDTH_Bps.get(m.device_name, m.mem_bw_Bps * PEAK_OVER_COPY), m.mem_bw_Bps)


def device_peaks(m: ArchInfo) -> ArchInfo:
    """The figures every floor is computed at: on a GPU whose arch has declared peaks (kernels.arch), `m` with the
    copy bandwidth measured in this process, since an arch's declared bandwidth is one device's (sm_90's is the
    H200's 4.3 TB/s; an H100's HBM3 copies ~2.98 TB/s, so at the declared figure its floors would sit ~30 % low);
    the bf16 rate stays declared (the H100 SXM and the H200 share the compute die). Elsewhere `m` as it is."""
    if not (m.is_gpu and m.mem_bw_Bps > 0 and m.bf16_flops > 0):
        return m
    measured = with_measured_bandwidth(m)
    torch.cuda.empty_cache()  # else the measurement's 2 GiB stay cached here, out of the timed processes' reach
    return replace(measured, source=f"copy bandwidth measured in this process on {m.device_name}; the bf16 rate as "
                                    f"declared for {m.arch}: {m.source}")


def run(ctx: GateContext) -> GateResult:
    c, opts, declared = ctx.contract, ctx.options, ctx.machine
    if reason := inapplicable(c, declared.arch):
        return GateResult.not_run(NAME, TITLE, reason)
    if reason := ctx.cannot_run_here():
        return GateResult.not_run(NAME, TITLE, reason)
    m = device_peaks(declared)  # once, before anything is timed: every point's floor at the same measured bandwidth
    peaks = m.mem_bw_Bps > 0 and m.bf16_flops > 0
    at_peak = replace(m, mem_bw_Bps=peak_bandwidth(m))  # the floor no call can beat: at the peak, not the copy rate
    findings = Findings()
    rows, flags, slower, impossible = [], [], [], []
    try:
        problem = ctx.problem()
        names = arg_names(problem.reference)
        timed = points_to_time(c, problem, opts)
        points, between = [point for point, *_ in timed], between_points_bound(c)

        def draw(point: Point) -> list:
            return [problem.generate_input(point, seed_for(opts.seed, NAME, point.label, k), "normal")
                    for k in range(opts.input_sets)]

        clocks: dict[str, list[float]] = {"alone": [], "beside": []}  # SM MHz at each session's start
        alone, alone_kernels, alone_flags = standard_alone(ctx, points, draw, names, clocks["alone"])
        flags += alone_flags
        with Sandbox() as box:
            for point, required, min_fraction, drawn in timed:
                ctx.progress(f"benchmarks: {point.label}{' (drawn)' if drawn else ''}")
                sets = draw(point)
                expected = [reference_run(problem, s, names, ctx.device) for s in sets]
                cost = problem.cost(point)
                floor_us = floor(cost.bytes, cost.flops, m).floor_us if peaks else None
                impossible_us = floor(cost.bytes, cost.flops, at_peak).floor_us if peaks else None
                started = box.request("bench_start", impls={"candidate": c.implementation, "standard": c.standard},
                                      names=names, state=sets[0].state, sets=[s.args for s in sets],
                                      timeout_s=START_TIMEOUT_S)
                clocks["beside"] += [started["sm_clock_mhz"]] if started.get("sm_clock_mhz") else []
                plan = block_plan(seed_for(opts.seed, NAME, point.label, "blocks"), opts.bench_pairs, len(sets))
                blocks = time_point(box, opts, floor_us, required, min_fraction,
                                    lambda text, label=point.label: ctx.progress(f"benchmarks: {label}, {text}"), plan)
                for message in spot_problems(blocks, f"{point.label}, candidate while timed"):
                    findings.add("timed", message)
                finish = box.request("bench_finish", host_iters=opts.host_iters)
                replies = finish["recheck"]
                recheck_outputs(problem, c, point, "candidate", replies["candidate"], expected, findings)
                if found := recheck_outputs(problem, c, point, "standard", replies["standard"], expected):
                    if recheck_outputs(problem, c, point, "standard", replies["standard"], expected,
                                       slack=STANDARD_SLACK):
                        flags.append(f"{point.label}: the standard disagrees with the reference, so the speedup "
                                     f"means little ({first(found)})")
                    else:
                        flags.append(f"{point.label}: the standard rounds differently from the reference, outside "
                                     f"the candidate's tolerance and within {STANDARD_SLACK:g}x it ({first(found)})")
                alone_us, kernels_alone = alone.get(point.label), alone_kernels.get(point.label)
                row, point_flags, point_slower = judge_point(point, blocks, finish, floor_us, required, min_fraction,
                                                             alone_us)
                if drawn:
                    row["drawn"] = True
                    judged = row["speedup"] * yardstick_scale(row["standard"]["median_us"], alone_us)
                    point_slower = [slower_between(point.label, judged, required)] if point_slower else []
                row["pipeline"] = started["pipeline"]
                impossible += [error] if (error := l2_set_aside(point.label, started["l2_set_aside"])) else []
                row["standard_alone_us"], row["standard_alone_kernels"] = alone_us, kernels_alone
                if flag := extra_kernels(point.label, row["kernels"]["standard"], kernels_alone):
                    flags.append(flag)
                error, flag = yardstick(point.label, row["standard"]["median_us"], alone_us)
                impossible += [error] if error else []
                rows.append(row), flags.extend(point_flags + ([flag] if flag else [])), slower.extend(point_slower)
                row["impossible_under_us"] = impossible_us
                if impossible_us and row["candidate"]["median_us"] < impossible_us:
                    impossible.append(f"{point.label}: {row['candidate']['median_us']:.2f} µs is under the "
                                      f"{impossible_us:.2f} µs its bytes take at the device's peak bandwidth")
    except ProblemError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e), summary="no problem to benchmark")
    except SandboxError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e),
                          summary="the candidate's process failed while timing")
    max_mhz = max_sm_clock_mhz()
    flags += clock_flags(clocks["alone"], clocks["beside"], max_mhz)
    details = {"rows": rows, "required_speedup": c.benchmark.required_speedup,
               "sm_clock_mhz": {"alone": min(clocks["alone"], default=None),
                                "beside": min(clocks["beside"], default=None), "max": max_mhz},
               "min_roofline_fraction": c.benchmark.min_roofline_fraction,
               "peaks": {"mem_bw_Bps": m.mem_bw_Bps, "peak_mem_bw_Bps": at_peak.mem_bw_Bps,
                         "declared_mem_bw_Bps": declared.mem_bw_Bps, "flops": m.bf16_flops,
                         "source": m.source} if peaks else None,
               "method": f"in-pipeline (the headline): {opts.input_sets} distinct input sets in one CUDA graph, "
                         f"per-call time = replay / {opts.input_sets}; where the other sets together are under twice "
                         f"the L2 (a row's `pipeline`: flushed), the L2 flushed (2× L2 written) before each call and "
                         f"an identical graph of the flushes alone replayed beside it and subtracted; one call "
                         f"per graph replay beside it (input sets rotated, L2 flushed before each replay); both in "
                         f"interleaved (candidate, standard) pairs with the stream held by a spin kernel before each "
                         f"timed replay; blocks of {opts.bench_pairs // 2}-{opts.bench_pairs * 3 // 2} pairs (a "
                         f"secret draw) until the in-pipeline speedup (median of "
                         f"paired ratios) and the fraction of the roofline have a 95 % interval over blocks clear of "
                         f"their bound or within ±{opts.precision:.0%} ({opts.min_blocks}-{opts.max_blocks} blocks); "
                         f"host wall time over {opts.host_iters} one-call replays with a device-wide synchronize; "
                         f"the standard also timed alone first ({YARDSTICK_BLOCKS} blocks in a process that never "
                         f"imports the candidate): more than {YARDSTICK_FLAG:g}× slower beside the candidate is "
                         f"flagged and the speedup judged over its time alone, {YARDSTICK_ERROR:g}× an ERROR; "
                         f"besides the contract's points, "
                         f"{opts.drawn_points} points it admits drawn from the secret seed and timed the same way, "
                         f"where the candidate must be at least {between:g}× the standard"
                         + ("; every floor at the copy bandwidth measured in this process before timing and the "
                            "arch's declared bf16 rate" if peaks else ""),
               "recheck_failures": [m for ms in findings.examples.values() for m in ms], "loaded": sorted(box.loaded)}
    speedups = speedup_summary(rows)
    if impossible:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason="; ".join(impossible), flags=flags,
                          summary="faster than the roofline allows, a yardstick slowed beside the candidate, or the "
                                  "L2 reconfigured by it: the measurement cannot be trusted", details=details)
    if findings:
        return GateResult(gate=NAME, title=TITLE, status=Status.FAILED_NUMERICS, flags=flags, details=details,
                          reason="; ".join(details["recheck_failures"]),
                          summary="outputs produced while timing do not match the reference")
    if slower:
        return GateResult(gate=NAME, title=TITLE, status=Status.SLOWER, reason="; ".join(slower), flags=flags,
                          summary=f"speedup {speedups}", details=details)
    return GateResult(gate=NAME, title=TITLE, status=Status.PASSED, flags=flags, details=details,
                      summary=f"speedup {speedups} (each at or above its point's requirement)")


GATE = Gate(NAME, TITLE, "faster than the standard implementation by the contract's margin at every benchmark point",
            run, needs=("contracts", "compile", "numerics"), inapplicable=inapplicable, audit=audit)
