"""Benchmark gate (GPU only): the candidate against the standard implementation at each contract benchmark point.

Both are timed side by side in the candidate's process (gates.worker.run_benchmark: CUDA-graph replays,
interleaved, fresh inputs copied in and the L2 flushed before every replay, one event pair per replay, plus
host wall time with a device-wide synchronize). Only raw samples come back; medians, spreads, speedups and
the fraction of the roofline are computed here. Outputs produced while timing are checked against the
reference. A time under the roofline floor is an error (nothing runs faster than memory and math allow); a
speedup over 10× is flagged for the reviewer, not celebrated.
"""

from __future__ import annotations

import statistics

from gates.problems import Point, ProblemError, bench_point, seed_for
from gates.registry import Gate, GateContext, arg_names
from gates.sandbox import Sandbox, SandboxError
from gates.status import GateResult, Status
from gates.suite.numerics import Findings, compare_named, reference_run
from kernels.roofline import floor

NAME, TITLE = "benchmarks", "Benchmarks"
SUSPICIOUS_SPEEDUP = 10.0
HIDDEN_WORK_US = 10.0  # host-over-device excess beyond the standard's that suggests work off the timed stream


def timing(samples: list[float]) -> dict:
    """Median, quartiles (inclusive method), IQR, min, mean and n of per-call times in µs."""
    xs = sorted(samples)
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median_us": med, "q1_us": q1, "q3_us": q3, "iqr_us": q3 - q1, "min_us": xs[0],
            "mean_us": statistics.fmean(xs), "n": len(xs)}


def judge_point(point: Point, raw: dict, floor_us: float | None, required: float,
                min_fraction: float | None) -> tuple[dict, list[str], list[str]]:
    """The row for one point from raw samples, its flags, and the reasons it is slower than the contract asks."""
    cand, std = (timing(raw["device_us"][k]) for k in ("candidate", "standard"))
    host = {k: statistics.median(raw["host_us"][k]) for k in ("candidate", "standard")}
    speedup = std["median_us"] / cand["median_us"]
    fraction = floor_us / cand["median_us"] if floor_us else None
    row = {"point": point.label, "series": point.series, "batch": point.batch, "candidate": cand, "standard": std,
           "host_median_us": host, "speedup": speedup, "floor_us": floor_us, "roofline_fraction": fraction,
           "kernels": raw["kernels"], "required_speedup": required, "min_roofline_fraction": min_fraction}
    flags, slower = [], []
    if speedup > SUSPICIOUS_SPEEDUP:
        flags.append(f"{point.label}: {speedup:.1f}× over the standard (more than {SUSPICIOUS_SPEEDUP:g}×): check "
                     "the standard and the measurement before believing it")
    gap = {k: host[k] - (cand if k == "candidate" else std)["median_us"] for k in host}
    if gap["candidate"] > 2 * max(gap["standard"], 0.0) + HIDDEN_WORK_US:
        flags.append(f"{point.label}: host wall time exceeds GPU time by {gap['candidate']:.1f} µs (standard: "
                     f"{gap['standard']:.1f} µs): work outside the timed stream?")
    if speedup < required:
        slower.append(f"{point.label}: {speedup:.2f}× over the standard, contract requires {required:g}×")
    if fraction is not None and min_fraction is not None and fraction < min_fraction:
        slower.append(f"{point.label}: {fraction:.1%} of the roofline, contract requires {min_fraction:.0%}")
    return row, flags, slower


def run(ctx: GateContext) -> GateResult:
    c, opts, m = ctx.contract, ctx.options, ctx.machine
    if not m.is_gpu:
        return GateResult.not_run(NAME, TITLE, "needs a CUDA GPU; this machine has none")
    if reason := ctx.cannot_run_here():
        return GateResult.not_run(NAME, TITLE, reason)
    peaks = m.mem_bw_Bps > 0 and m.bf16_flops > 0  # declared figures for this arch (kernels.arch)
    findings = Findings()
    rows, flags, slower, impossible = [], [], [], []
    try:
        problem = ctx.problem()
        names = arg_names(problem.reference)
        with Sandbox() as box:
            for bp in c.benchmark.points:
                point = bench_point(c, problem, bp)
                ctx.progress(f"benchmarks: {point.label}")
                sets = [problem.generate_input(point, seed_for(opts.seed, NAME, point.label, k), "normal")
                        for k in range(opts.input_sets)]
                expected = [reference_run(problem, s, names, ctx.device) for s in sets]
                raw = box.request("benchmark", impls={"candidate": c.implementation, "standard": c.standard},
                                  names=names, state=sets[0].state, sets=[s.args for s in sets],
                                  iters=opts.bench_iters, host_iters=opts.host_iters)
                for impl in ("candidate", "standard"):
                    check = Findings() if impl == "standard" else findings
                    for k, (got, exp) in enumerate(zip(raw["recheck"][impl], expected)):
                        where = f"{point.label}, {impl} output after timing, input set {k + 1}"
                        for message in got["problems"]:
                            check.add("plain", f"{where}: {message}")
                        compare_named(problem, got["outputs"], exp.outputs, c.tolerance, "tolerance", where, check)
                        compare_named(problem, got["states"], exp.states, c.tolerance, "state", where, check)
                    if impl == "standard" and check:
                        flags.append(f"{point.label}: the standard disagrees with the reference, so the speedup "
                                     f"means little ({next(iter(check.examples.values()))[0]})")
                cost = problem.cost(point)
                floor_us = floor(cost.bytes, cost.flops, m).floor_us if peaks else None
                row, point_flags, point_slower = judge_point(point, raw, floor_us, *c.benchmark.requirement(bp))
                rows.append(row), flags.extend(point_flags), slower.extend(point_slower)
                if floor_us and row["candidate"]["median_us"] < floor_us:
                    impossible.append(f"{point.label}: {row['candidate']['median_us']:.2f} µs is under the "
                                      f"roofline floor of {floor_us:.2f} µs")
    except ProblemError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e), summary="no problem to benchmark")
    except SandboxError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e),
                          summary="the candidate's process failed while timing")
    details = {"rows": rows, "required_speedup": c.benchmark.required_speedup,
               "min_roofline_fraction": c.benchmark.min_roofline_fraction,
               "peaks": {"mem_bw_Bps": m.mem_bw_Bps, "flops": m.bf16_flops, "source": m.source} if peaks else None,
               "method": f"CUDA-graph replays, candidate and standard interleaved, {opts.input_sets} input sets "
                         f"rotated, L2 flushed (2× L2 written) before each of {opts.bench_iters} timed replays; "
                         f"host wall time over {opts.host_iters} replays with a device-wide synchronize",
               "recheck_failures": [m for ms in findings.examples.values() for m in ms]}
    speedups = ", ".join(f"{r['batch']}: {r['speedup']:.2f}×" for r in rows)
    if impossible:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason="; ".join(impossible), flags=flags,
                          summary="faster than the roofline allows: the measurement cannot be trusted", details=details)
    if findings:
        return GateResult(gate=NAME, title=TITLE, status=Status.FAILED_NUMERICS, flags=flags, details=details,
                          reason="; ".join(details["recheck_failures"]),
                          summary="outputs produced while timing do not match the reference")
    if slower:
        return GateResult(gate=NAME, title=TITLE, status=Status.SLOWER, reason="; ".join(slower), flags=flags,
                          summary=f"speedup by batch {speedups}", details=details)
    return GateResult(gate=NAME, title=TITLE, status=Status.PASSED, flags=flags, details=details,
                      summary=f"speedup by batch {speedups} (each at or above its point's requirement)")


GATE = Gate(NAME, TITLE, "faster than the standard implementation by the contract's margin at every benchmark point",
            run, needs=("contracts", "compile", "numerics"))
