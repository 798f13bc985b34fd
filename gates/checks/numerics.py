"""Numerics gate: the candidate against the reference at every point of the contract's envelope.

Per point (gates.problems.envelope_points: every value of every listed shape, the corners of the ranges, and batch
and speculative-token counts drawn across their ranges from the secret seed), `trials` seeded
inputs from each distribution (normal, heavy-tailed, large magnitude, mixed rows), drawn in the gate from a
secret seed and sent to the candidate's process as tensors; then one input at every other batch of the range, at
the cheapest shape (gates.problems.batch_sweep). Each input runs `runs` times on the same buffers:
first right after the reference ran in that process (its freed result lying in memory), then after memory the
size of every output was filled with NaN. The first run's outputs and in-place state must pass the graded
tolerance (gates.core.compare); every later run must be bitwise identical to it; no run may change its other
inputs, write outside the tensors it was given (each lies between canary zones: gates.core.worker.Guards), change
the process's global state (default dtype, grad mode, matmul precision, RNG streams: worker.process_state), return
anything but plain tensors, share memory between outputs and inputs, or raise. A stateful op
also runs `steps` consecutive decode steps carrying its state, one of them repeating the previous step's
input (a result cached on the input would be stale).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationError

from gates.core import strays
from gates.core.compare import TensorCheck, digest
from gates.core.registry import Gate, GateContext, arg_names
from gates.core.sandbox import Sandbox, SandboxError, Watch, confined_command
from gates.core.sources import REPO_ROOT
from gates.core.status import GateResult, Status
from gates.evidence.signing import KEY_FILE_VAR, KEY_VAR
from gates.problems import (
    DISTRIBUTIONS,
    Case,
    Point,
    Problem,
    ProblemError,
    batch_sweep,
    coverage,
    envelope_points,
    seed_for,
)
from kernels.contract import Contract, Tolerance
from kernels.trees import clone, leaves, state_leaves
from kernels.validation import problem_lines

NAME, TITLE = "numerics", "Numerics"
CHECKS = {
    "raised": "runs without raising",
    "plain": "returns plain tensors on the device",
    "shape": "output and state shapes and dtypes",
    "finite": "no NaN/inf where the reference is finite",
    "tolerance": "outputs within graded tolerance",
    "state": "state updated in place within tolerance",
    "mutation": "other inputs left untouched",
    "aliasing": "outputs share no memory with inputs",
    "fresh": "outputs in memory of their own each call (not memory an earlier call returned, still held), and the "
             "earlier calls' outputs left as they were",
    "bounds": "no write outside the tensors the call was given (canary zones on both sides of each)",
    "process": "leaves the process as it found it (default dtype and device, grad mode, matmul precision, RNG streams)",
    "determinism": "bitwise identical over runs (after the reference, after poisoned memory, other bytes around "
                   "each tensor)",
    "trajectory": "outputs and final state over consecutive steps",
    "repeat": "a repeated input with an evolved state (no stale cached result)",
    "late": "the same outputs after many calls (no warm-up phase, no call counter)",
    "production": "the same outputs through the production dispatcher, in a process without the gate",
    "concurrent": "the same outputs with two calls at once on two streams, each on the stream it is called on",
    "early": "the same outputs when the kernel before it writes its activations after letting it start (a kernel "
             "launched with programmatic dependent launch reads them only after griddepcontrol.wait)",
    "kept": "no memory kept per input, none that grows with calls (a cache keyed on contents, a leak)",
}
STATEFUL_CHECKS = ("state", "trajectory", "repeat")
GPU_CHECKS = ("concurrent", "early")  # streams and launches: nothing to check on a CPU
# What the kernel before an op writes in a decode step, so what the op may read only after griddepcontrol.wait: its
# activations (weights, caches and states were written steps or layers before). An argument's name takes all its
# leaves, `name[-1]` the last (AttnRes's newest source); an op not listed, its first argument.
WRITTEN_BY_PREDECESSOR = {
    "linear": ("x",), "situ_mlp": ("x",), "moe_route": ("x",), "kda_decode": ("proj",),
    "mla_decode": ("q_nope", "q_pe"), "mla_decode_fp8": ("q_nope", "q_pe"), "moe_experts": ("z", "ids", "weights"),
    "attn_res": ("sources[-1]",), "attn_res_norm": ("sources[-1]", "addend"),
}


@dataclass
class Expected:
    outputs: list[tuple[str, torch.Tensor]]
    states: list[tuple[str, torch.Tensor]]


def reference_run(problem: Problem, case: Case, names: list[str], device: str) -> Expected:
    """The reference on the gate's own copy of the inputs (in this process, on the candidate's device)."""
    args = clone(case.args, device)
    out = problem.reference(*args)
    return Expected(outputs=[(n, t.cpu()) for n, t in leaves(out, "out")],
                    states=[(n, t.cpu()) for n, t in state_leaves(args, case.state, names)])


def finite_reference_run(problem: Problem, case: Case, names: list[str], device: str, where: str) -> Expected:
    """reference_run on an input the gate drew (`where`: its point and distribution), which must give finite
    results: NaN or inf there means the problem drew outside the op's domain, a ProblemError."""
    expected = reference_run(problem, case, names, device)
    for name, t in expected.outputs + expected.states:
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ProblemError(f"the reference returned NaN/inf in {name} at {where}: the problem "
                               f"{problem.source.name} drew inputs outside the op's domain")
    return expected


class Findings:
    """Failures counted by check, with the first few messages of each."""

    LIMIT = 5

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, check: str, message: str) -> None:
        self.counts[check] += 1
        if len(self.examples[check]) < self.LIMIT:
            self.examples[check].append(message)

    def __bool__(self) -> bool:
        return bool(self.counts)


def compare_named(problem: Problem, got: list, expected: list, tol: Tolerance, kind: str, where: str,
                  findings: Findings) -> list[TensorCheck]:
    """Check each expected tensor against the candidate's of the same name; findings under `kind`."""
    by_name = dict(got)
    checks = []
    for name, ref in expected:
        if by_name.get(name) is None:
            findings.add("shape", f"{where}: no {name} returned")
            continue
        got_t = by_name[name]
        check: TensorCheck = problem.check(name, got_t, ref, tol)
        checks.append(check)
        if not check.passed:
            mismatch = (got_t.shape, got_t.dtype) != (ref.shape, ref.dtype)
            category = "shape" if mismatch else "finite" if check.nonfinite else kind
            findings.add(category, f"{where}: {'; '.join(check.problems)}"
                         + (f" (worst: {check.mismatches[0]})" if check.mismatches else ""))
    extra = sorted(set(by_name) - {n for n, _ in expected})
    if extra:
        findings.add("shape", f"{where}: unexpected outputs {', '.join(extra)}")
    return checks


def _overlaps(outputs: list, inputs: list) -> list[str]:
    pairs = []
    for out_name, out_ptr, out_size in outputs:
        for in_name, in_ptr, in_size in inputs:
            if out_size and in_size and out_ptr < in_ptr + in_size and in_ptr < out_ptr + out_size:
                pairs.append(f"{out_name} shares memory with {in_name}")
    return pairs


def call_findings(run: dict, where: str, findings: Findings) -> None:
    """What the worker saw one call do besides its outputs: writes outside its tensors (`bounds`) and changes to the
    process's global state (`process`; not read for calls made at once, worker.run_concurrent)."""
    for message in run["overruns"]:
        findings.add("bounds", f"{where}: {message}")
    for message in run.get("side_effects", ()):
        findings.add("process", f"{where}: {message}")


def judge_case(problem: Problem, case: Case, expected: Expected, runs: list[dict], names: list[str],
               contract: Contract, where: str, findings: Findings) -> list[TensorCheck]:
    """Every check on one input's runs: the first run's tensors against the reference, the later runs' digests
    against the first's, every run's input digests against the inputs sent. Returns the first run's checks."""
    pristine = {n: digest(t) for i, a in enumerate(case.args) if i not in case.state for n, t in leaves(a, names[i])}
    first: list[TensorCheck] = []
    base: dict[str, str] = {}
    held: list[tuple[str, int, int]] = []  # earlier runs' outputs: (name, storage pointer, bytes)
    returned: dict[int, dict[str, str]] = {}  # each run's output and state digests as it returned them
    for r, run in enumerate(runs):
        at = f"{where}, run {r + 1}"
        if "raised" in run:
            findings.add("raised", f"{at}: {run['raised']}")
            continue
        for message in run["problems"]:
            findings.add("plain", f"{at}: {message}")
        call_findings(run, at, findings)
        if r == 0:
            first = compare_named(problem, run["outputs"], expected.outputs, contract.tolerance, "tolerance", at,
                                  findings)
            first += compare_named(problem, run["states"], expected.states, contract.tolerance_for_states, "state",
                                   at, findings)
            base = returned[r] = {n: digest(t) for n, t in run["outputs"] + run["states"]}
        else:
            returned[r] = dict(run["outputs"] + run["states"])  # digests already (full=False)
            for name, d in run["outputs"] + run["states"]:
                if name in base and d != base[name]:
                    findings.add("determinism", f"{at}: {name} differs bitwise from run 1 (run 1 followed the "
                                 "reference's freed result; this run followed poisoned memory, with other bytes "
                                 "around every tensor: a result that reads past its tensors differs too)")
        for name, d in run["inputs"]:
            if d != pristine.get(name):
                findings.add("mutation", f"{at}: input {name} changed")
        for pair in _overlaps(run["output_storage"], run["input_storage"]):
            findings.add("aliasing", f"{at}: {pair}")
        # the worker holds every run's outputs of this input until its last run: memory still referenced is never
        # handed out again by an allocator, so an overlap is memory the candidate keeps and returns again
        for pair in _overlaps(run["output_storage"], held):
            findings.add("fresh", f"{at}: {pair}, which the caller still holds: a later call overwrites an earlier "
                         "result under a caller still reading it")
        for k, name, d in run.get("earlier_outputs", []):
            if d != returned.get(k, {}).get(name, d):
                findings.add("fresh", f"{at}: run {k + 1}'s {name} changed during this call, though the caller still "
                             "holds it: a call that writes into an earlier result (kept as its workspace) corrupts "
                             "what serving keeps for later layers")
        held += [(f"run {r + 1}'s {name}", ptr, size) for name, ptr, size in run["output_storage"]]
    return first


def _errors(checks: list[list[TensorCheck]], state_names: set[str]) -> dict:
    """The worst errors over a distribution's inputs: outputs, and the states updated in place."""
    outs = [c for cs in checks for c in cs if c.name not in state_names and c.numel]
    states = [c for cs in checks for c in cs if c.name in state_names and c.numel]
    return {
        "max_abs": max((c.max_abs for c in outs), default=0.0),
        "mean_abs": max((c.mean_abs for c in outs), default=0.0),
        "max_units": max((c.max_units for c in outs), default=0.0),
        "max_ulps": max((c.max_ulps for c in outs if c.max_ulps is not None), default=None),
        "close_fraction": min((c.close_fraction for c in outs), default=1.0),
        "rel_l2": max((c.rel_l2 for c in outs), default=0.0),
        "state_rel_l2": max((c.rel_l2 for c in states), default=0.0),
        "systematic": max((c.systematic for c in outs + states), default=0.0),
    }


def _row(point: Point, dist: str, checks: list[list[TensorCheck]], failed: bool, state_names: set[str],
         standard: list[list[TensorCheck]] | None) -> dict:
    return {"point": point.label, "series": point.series, "batch": point.batch, "dist": dist, "trials": len(checks),
            "passed": not failed, **_errors(checks, state_names),
            "standard": _errors(standard, state_names) if standard else None}


STANDARD_TIMEOUT_S = 300.0


def standard_checks(ctx: GateContext, problem: Problem, box: Sandbox, cases: list, expected: list, names: list[str],
                    specs: list) -> tuple[list[list[TensorCheck]] | None, str | None]:
    """The standard implementation's errors on the same inputs, for the reviewer's comparison (never judged):
    per case its checks against the reference, or None and why it could not run here. It runs in its own
    process (`box`), so it can neither disturb the candidate's nor, by hanging, sink the gate."""
    c = ctx.contract
    try:
        reply = box.request("cases", candidate=c.standard, reference=c.reference, device=ctx.device, names=names,
                            cases=cases, runs=1, output_specs=specs, timeout_s=STANDARD_TIMEOUT_S)
    except SandboxError as e:
        return None, str(e).splitlines()[0]
    checks = []
    for exp, (run,) in zip(expected, reply["cases"]):
        if "raised" in run:
            return None, run["raised"]
        ignored = Findings()
        checks.append(compare_named(problem, run["outputs"], exp.outputs, c.tolerance, "tolerance", "", ignored)
                      + compare_named(problem, run["states"], exp.states, c.tolerance_for_states, "state", "",
                                      ignored))
    return checks, None


def draw_cases(ctx: GateContext, problem: Problem, point: Point, names: list[str]) -> tuple[list, list, list]:
    """The point's seeded inputs (every distribution x trials), the reference's results on them, their labels
    (distribution, trial, the input's seed: `problem.generate_input(point, seed, dist)` draws it again)."""
    cases, expected, labels = [], [], []
    for dist in DISTRIBUTIONS:
        for t in range(ctx.options.trials):
            seed = seed_for(ctx.options.seed, NAME, point.label, dist, t)
            case = problem.generate_input(point, seed, dist)
            exp = finite_reference_run(problem, case, names, ctx.device, f"{point.label}, {dist}")
            cases.append(case), expected.append(exp), labels.append((dist, t, seed))
    return cases, expected, labels


def check_points(ctx: GateContext, problem: Problem, box: Sandbox, std_box: Sandbox, points: list[Point],
                 names: list[str], findings: Findings) -> tuple[list[dict], str | None]:
    """Every envelope point's rows, and why the standard could not run beside the candidate (then it is not
    tried at later points), or None. The standard runs on the same inputs at the same time as the candidate,
    each in its own process."""
    c = ctx.contract
    rows, standard_failure = [], None
    with ThreadPoolExecutor(max_workers=1) as beside:
        for point in points:
            ctx.progress(f"numerics: {point.label}")
            cases, expected, labels = draw_cases(ctx, problem, point, names)
            specs = [(tuple(t.shape), t.dtype) for _, t in expected[0].outputs]
            std_run = None if standard_failure else beside.submit(
                standard_checks, ctx, problem, std_box, cases, expected, names, specs)
            reply = box.request("cases", candidate=c.implementation, reference=c.reference, device=ctx.device,
                                names=names, cases=cases, runs=ctx.options.runs, output_specs=specs)
            std = None
            if std_run is not None:
                std, why = std_run.result()
                standard_failure = f"{point.label}: {why}" if why else None
            per_dist: dict[str, list[list[TensorCheck]]] = defaultdict(list)
            std_per_dist: dict[str, list[list[TensorCheck]]] = defaultdict(list)
            failed_dists = set()
            for k, (case, exp, (dist, t, seed), runs) in enumerate(zip(cases, expected, labels, reply["cases"])):
                before = sum(findings.counts.values())
                per_dist[dist].append(judge_case(problem, case, exp, runs, names, c,
                                                 f"{point.label}, {dist} #{t + 1} (input seed {seed})", findings))
                if std:
                    std_per_dist[dist].append(std[k])
                if sum(findings.counts.values()) > before:
                    failed_dists.add(dist)
            state_names = {n for n, _ in expected[0].states}
            rows += [_row(point, dist, per_dist[dist], dist in failed_dists, state_names, std_per_dist.get(dist))
                     for dist in DISTRIBUTIONS]
            if early_unavailable(ctx.device) is None:
                check_early(ctx, box, point, names, cases[0], reply["cases"][0], findings)
    return rows, standard_failure


def early_unavailable(device: str) -> str | None:
    """Why the `early` check cannot run here, or None: it needs a GPU and the CuTe DSL for the late writer (a GPU
    gate machine has both, its kernels need them; `gpu_session.sh wall` carries no DSL and runs without it)."""
    if device != "cuda":
        return "no GPU"
    from gates.core.late_writer import DSL

    return f"the late writer needs the CuTe DSL ({DSL.error})" if DSL.error else None


def check_early(ctx: GateContext, box: Sandbox, point: Point, names: list[str], case: Case, runs: list[dict],
                findings: Findings) -> None:
    """The point's first input again, behind the late writer (worker.run_late_inputs): each leaf the op's
    predecessor writes must give run 1's outputs and state bit for bit."""
    if "raised" in runs[0]:
        return  # judged already
    first = {n: digest(t) for n, t in runs[0]["outputs"] + runs[0]["states"]}
    written = WRITTEN_BY_PREDECESSOR.get(ctx.contract.op, (names[0],))
    reply = box.request("late_inputs", candidate=ctx.contract.implementation, names=names, cases=[case],
                        written=written)
    for got in reply["cases"][0]:
        at = f"{point.label}, {got['leaf']} written by the kernel before it after letting it start"
        if "raised" in got:
            findings.add("early", f"{at}: {got['raised']}")
            continue
        differ = [n for n, d in got["outputs"] + got["states"] if first.get(n, d) != d]
        if differ:
            findings.add("early", f"{at}: {', '.join(differ)} differ bitwise from run 1: read before "
                         "griddepcontrol.wait (programmatic dependent launch), it reads the previous step's values")


def check_sweep(ctx: GateContext, problem: Problem, box: Sandbox, sweep: list[Point], names: list[str],
                findings: Findings) -> dict:
    """One input (its rows cycling through the distributions: `mixed`) at each point of the batch sweep
    (gates.problems.batch_sweep), judged as the envelope's points are: a kernel wrong at one batch fails here."""
    failed = []
    for point in sweep:
        ctx.progress(f"numerics: sweep, {point.label}")
        seed = seed_for(ctx.options.seed, NAME, "sweep", point.label)
        case = problem.generate_input(point, seed, "mixed")
        expected = finite_reference_run(problem, case, names, ctx.device, f"{point.label}, mixed")
        specs = [(tuple(t.shape), t.dtype) for _, t in expected.outputs]
        reply = box.request("cases", candidate=ctx.contract.implementation, reference=ctx.contract.reference,
                            device=ctx.device, names=names, cases=[case], runs=ctx.options.runs, output_specs=specs)
        before = sum(findings.counts.values())
        judge_case(problem, case, expected, reply["cases"][0], names, ctx.contract,
                   f"{point.label}, batch sweep (input seed {seed})", findings)
        if sum(findings.counts.values()) > before:
            failed.append(point.label)
    batches = sorted({p.batch for p in sweep})
    return {"points": len(sweep), "batches": batches, "series": sweep[0].series if sweep else None,
            "failed": failed}


def check_trajectory(ctx: GateContext, problem: Problem, box: Sandbox, point: Point, names: list[str],
                     findings: Findings) -> dict:
    """`steps` consecutive steps from one state; step steps//2 repeats the input of the step before it."""
    opts, device, tol = ctx.options, ctx.device, ctx.contract.tolerance
    seed = seed_for(opts.seed, "trajectory", point.label)
    first = problem.generate_input(point, seed, "normal")
    inputs = [first]
    for s in range(1, opts.steps):
        inputs.append(inputs[-1] if s == opts.steps // 2 else problem.next_input(first, seed_for(seed, s), "normal"))
    ref_args = list(clone(first.args, device))  # the state args stay the same objects, carried in place
    expected = []
    for case in inputs:
        for i, a in enumerate(case.args):
            if i not in first.state:
                ref_args[i] = clone(a, device)
        expected.append([(n, t.cpu()) for n, t in leaves(problem.reference(*ref_args), "out")])
    final = [(n, t.cpu()) for n, t in state_leaves(ref_args, first.state, names)]
    steps = [tuple(None if i in first.state else a for i, a in enumerate(case.args)) for case in inputs]
    reply = box.request("trajectory", candidate=ctx.contract.implementation, device=device, names=names,
                        initial=first.args, state=first.state, steps=steps)
    worst = 0.0
    for s, (run, exp) in enumerate(zip(reply["steps"], expected)):
        where = f"{point.label}, step {s + 1} of {opts.steps}"
        if "raised" in run:
            findings.add("raised", f"{where}: {run['raised']}")
            break
        call_findings(run, where, findings)
        kind = "repeat" if s == opts.steps // 2 else "trajectory"
        checks = compare_named(problem, run["outputs"], exp, tol, kind, where, findings)
        worst = max([worst] + [ch.rel_l2 for ch in checks])
    for message in reply["problems"]:
        findings.add("plain", f"{point.label}, final state: {message}")
    state_checks = compare_named(problem, reply["final_state"], final, ctx.contract.tolerance_for_states, "trajectory",
                                 f"{point.label}, state after {opts.steps} steps", findings)
    return {"point": point.label, "steps": opts.steps, "repeated_step": opts.steps // 2 + 1, "out_rel_l2": worst,
            "state_rel_l2": max((ch.rel_l2 for ch in state_checks), default=0.0)}


LATE_CALLS = 1024  # consecutive calls in one process, the late ones checked against the first (a constant, not a
# GateOptions field: bundles made before it keep their recorded options, and `evidence render` can still read them)
LATE_INPUTS = 8  # distinct inputs the late calls cycle through (two of each distribution)
REPLAY_TIMEOUT_S = 600.0  # the production replay's process, import and compile included


def smallest(points: list[Point]) -> Point:
    """The cheapest point to call many times: fewest tokens, then the smallest shapes."""
    return min(points, key=lambda p: (p.batch * (1 + p.spec_tokens), [v for _, v in p.shape]))


def check_late_calls(ctx: GateContext, problem: Problem, box: Sandbox, point: Point, names: list[str],
                     findings: Findings) -> dict:
    """LATE_CALLS consecutive calls in one process over LATE_INPUTS inputs at `point`: the first and the last call
    on each input against the reference, every call bit for bit against the first call on its input; then the
    same calls through the production path (check_production), held to those first calls."""
    calls, device = LATE_CALLS, ctx.device
    cases = [problem.generate_input(point, seed_for(ctx.options.seed, "late", point.label, k),
                                    DISTRIBUTIONS[k % len(DISTRIBUTIONS)]) for k in range(LATE_INPUTS)]
    expected = [reference_run(problem, case, names, device) for case in cases]
    reply = box.request("calls", candidate=ctx.contract.implementation, device=device, names=names, cases=cases,
                        calls=calls)
    first: dict[int, dict[str, str]] = {}
    differs = None
    for k, run in enumerate(reply["calls"]):
        i = k % len(cases)
        where = f"{point.label}, call {k + 1} of {calls} (input {i + 1} of {len(cases)})"
        if "raised" in run:
            findings.add("late", f"{where}: raised {run['raised']}")
            differs = k + 1
            break
        for message in run["problems"]:
            findings.add("plain", f"{where}: {message}")
        call_findings(run, where, findings)
        got = run["outputs"] + run["states"]
        if got and isinstance(got[0][1], torch.Tensor):  # the first and the last call on each input: tensors
            compare_named(problem, run["outputs"], expected[i].outputs, ctx.contract.tolerance, "late", where,
                          findings)
            compare_named(problem, run["states"], expected[i].states, ctx.contract.tolerance_for_states, "late",
                          where, findings)
            got = [(n, digest(t)) for n, t in got]
        if i not in first:
            first[i] = dict(got)
        elif dict(got) != first[i]:
            findings.add("late", f"{where}: differs bitwise from call {i + 1} on the same input")
            differs = differs or k + 1
    kept = check_kept(point, reply["held"], len(cases), calls, findings)
    production = (check_production(ctx, point, names, cases, first, findings) if len(first) == len(cases)
                  else {"run": False, "why": "the candidate raised under the gate"})
    concurrent = (check_concurrent(ctx, box, point, names, cases, first, findings)
                  if device == "cuda" and len(first) == len(cases) else None)
    return {"point": point.label, "calls": len(reply["calls"]), "inputs": len(cases), "first_difference": differs,
            "production": production, "concurrent": concurrent, "kept": kept}


KEPT_BYTES = 4 << 10  # what later calls may leave live beyond the first call's: 8 of the caching allocator's
# 512-byte blocks (a descriptor made lazily); a copy of the weights, or of a batch's results, is more at any point


def nbytes_text(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / (1 << 10):.1f} KiB"


def check_kept(point: Point, held: list[dict], inputs: int, calls: int, findings: Findings) -> dict:
    """What the candidate keeps live between calls (worker.run_calls' `held`), judged where serving would feel it:
    memory that grows with each new input of a shape the candidate has served (a cache keyed on its arguments'
    contents: copies of weights, prepacked or quantized, or of results; in serving one per layer, beside the
    weights), and memory that grows over the later calls on inputs it has seen (never freed: it grows with every
    step). What a first call of a shape keeps (a workspace, a compiled kernel's tables) is reported, not judged."""
    before, rounds = held[0], [h for h in held[1:] if h["call"] < inputs]
    per_input = sum(max(0, b["bytes"] - a["bytes"]) for a, b in zip(rounds, rounds[1:]) if b["layout_served"])
    new_inputs = sum(1 for b in rounds[1:] if b["layout_served"])
    if per_input > KEPT_BYTES:
        findings.add("kept", f"{point.label}: {nbytes_text(per_input)} more held after {new_inputs} new inputs of "
                     "shapes it had served: memory kept per input (a cache keyed on the arguments' contents, of "
                     "weights or results), which serving fills with every layer's")
    later = None
    if len(rounds) == inputs and held[-1]["call"] == calls - 1 > rounds[-1]["call"]:
        later = held[-1]["bytes"] - rounds[-1]["bytes"]
        if later > KEPT_BYTES:
            findings.add("kept", f"{point.label}: {nbytes_text(later)} more held after {calls - inputs} later calls on "
                         "inputs it had seen: memory never freed, which grows with every step in serving")
    return {"first_call_bytes": rounds[0]["bytes"] - before["bytes"] if rounds else None,
            "per_input_bytes": per_input, "new_inputs": new_inputs, "later_calls_bytes": later}


def check_concurrent(ctx: GateContext, box: Sandbox, point: Point, names: list[str], cases: list,
                     first: dict[int, dict], findings: Findings) -> dict:
    """The late calls' inputs in pairs, both calls of a pair at once on two streams (worker.run_concurrent): each
    call bit for bit the same call made alone (its first late call). Serving runs an op's calls side by side (the
    shared experts beside the routed ones, the MLA gate beside the attention)."""
    pairs = [(k, k + 1) for k in range(0, len(cases) - 1, 2)]
    reply = box.request("concurrent", candidate=ctx.contract.implementation, device=ctx.device, names=names,
                        cases=cases, pairs=pairs)
    for call in reply["calls"]:
        if "raised" in call:
            findings.add("concurrent", f"{point.label}, two calls at once on two streams: raised {call['raised']}")
            continue
        i = call["case"]
        where = f"{point.label}, input {i + 1} called beside input {call['beside'] + 1} on another stream"
        for message in call["problems"]:
            findings.add("plain", f"{where}: {message}")
        call_findings(call, where, findings)
        if not call["at_once"]:
            findings.add("concurrent", f"{where}: the two calls never started at once: enqueueing them took the host "
                         "longer than the longest spin (~51 ms), which no serving step allows")
        if wrong := [name for name, d in call["got"] if first[i].get(name) != d]:
            findings.add("concurrent", f"{where}: {', '.join(wrong)} differ bit for bit from the same call alone: "
                         "calls at once interfere (a workspace shared between calls) or the kernel does not run on "
                         "the stream it is called on (its inputs read before they were written)")
    return {"pairs": len(pairs), "calls": len(reply["calls"]),
            "at_once": sum(1 for call in reply["calls"] if call.get("at_once"))}


def _replay(request_path: Path, result_path: Path, env: dict[str, str]) -> dict:
    """Run model.kimi_k3.replay confined like a sandbox's child (gates.core.isolation), in a session of its own
    (registered while it lives: gates.core.strays), and read its result, or say why there is none."""
    argv, plan = confined_command([sys.executable, "-m", "model.kimi_k3.replay", str(request_path),
                                   str(result_path)])
    with strays.starting():  # in a session of its own from its fork: registered before any scan sees it
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env | plan, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        strays.register(proc.pid)
    try:
        try:
            _, stderr = proc.communicate(timeout=REPLAY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"error": f"no result within {REPLAY_TIMEOUT_S:.0f} s"}
    finally:
        if proc.returncode is not None:
            strays.forget(proc.pid)
    try:
        return (json.loads(result_path.read_text()) if result_path.is_file()
                else {"error": f"exit code {proc.returncode}: {stderr.strip()[-500:]}"})
    except (OSError, ValueError) as e:  # an unreadable result file: whatever the process left there
        return {"error": f"its result could not be read ({type(e).__name__}: {e})"}


def check_production(ctx: GateContext, point: Point, names: list[str], cases: list, first: dict[int, dict],
                     findings: Findings) -> dict:
    """The late calls again, through the dispatcher a serving engine builds (CUDA graphs on a GPU), in a fresh
    process that imports the model and the candidate and nothing of the gate (model/kimi_k3/replay.py), without
    the signing key and watched like the sandbox (the tree, the compile caches, processes left behind: Watch):
    every call must give, bit for bit, what the candidate gave under the gate on the same input (which the late
    calls held to the reference)."""
    request = {"contract": ctx.contract.model_dump(mode="json"), "contract_path": str(ctx.contract_path),
               "names": names, "cases": [(clone(c.args, "cpu"), c.state) for c in cases], "calls": LATE_CALLS,
               "device": ctx.device, "batch": point.batch, "spec_tokens": point.spec_tokens}
    env = {k: v for k, v in os.environ.items() if k not in (KEY_VAR, KEY_FILE_VAR)} | {"PYTHONDONTWRITEBYTECODE": "1"}
    where = f"{point.label}, production replay"
    with tempfile.TemporaryDirectory(prefix="k3forge-replay-") as tmp:
        request_path, result_path = Path(tmp, "request.pt"), Path(tmp, "result.json")
        torch.save(request, request_path)
        watch = Watch()
        try:
            result = _replay(request_path, result_path, env)
        finally:
            broken = watch.broken(ended=True)
    for problem in broken:
        findings.add("production", f"{where}: the process {problem}")
    if "error" in result:
        findings.add("production", f"{where}: {result['error'].strip().splitlines()[-1]}")
        return {"run": False, "why": result["error"].strip().splitlines()[-1]}
    if result["gate_modules"]:
        findings.add("production", f"{where}: the candidate imported the gate's "
                                   f"{', '.join(result['gate_modules'][:3])}")
    stats = result["dispatch"]["ops"].get(ctx.contract.op, {})
    if stats.get("standard"):
        findings.add("production", f"{where}: the dispatcher ran the standard for {stats['standard']} of "
                                   f"{len(result['calls'])} calls ({dict(stats.get('fallbacks', {}))}"
                                   f"{'; ' + stats['last_error'] if stats.get('last_error') else ''})")
    differs = None
    for k, got in enumerate(result["calls"]):
        i = k % len(cases)
        if "raised" in got:
            findings.add("production", f"{where}, call {k + 1}: raised {got['raised']}")
            differs = k + 1
            break
        if got != first[i]:
            names_differing = [n for n in sorted(set(got) | set(first[i])) if got.get(n) != first[i].get(n)]
            findings.add("production", f"{where}, call {k + 1} (input {i + 1}): differs bitwise from the candidate's "
                                       f"output under the gate ({', '.join(names_differing)})")
            differs = differs or k + 1
    return {"run": True, "calls": len(result["calls"]), "first_difference": differs,
            "graphs": ctx.device == "cuda", "seconds": round(result["seconds"], 1),
            "dispatch": {"specialized": stats.get("specialized", 0), "standard": stats.get("standard", 0)}}


class RecordedErrors(BaseModel):
    """_errors() as a bundle records it (an infinite error reads back as null)."""

    model_config = ConfigDict(extra="forbid")

    max_abs: NonNegativeFloat | None
    mean_abs: NonNegativeFloat | None
    max_units: NonNegativeFloat | None
    max_ulps: NonNegativeFloat | None = None  # bundles before session 25 lack it
    close_fraction: float = Field(ge=0, le=1)
    rel_l2: NonNegativeFloat | None
    state_rel_l2: NonNegativeFloat | None
    systematic: NonNegativeFloat | None = None  # bundles before session 32 lack it


class RecordedRow(RecordedErrors):
    point: str
    series: str
    batch: PositiveInt
    dist: str
    trials: PositiveInt
    passed: bool
    standard: RecordedErrors | None


class RecordedDimension(BaseModel):
    model_config = ConfigDict(extra="forbid")

    admitted: list[int]
    exercised: list[int]


class RecordedCoverage(BaseModel):
    """coverage() as a bundle records it (absent in bundles made before it was)."""

    model_config = ConfigDict(extra="forbid")

    batch: RecordedDimension
    spec_tokens: RecordedDimension
    shapes: dict[str, RecordedDimension]


class RecordedCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    check: str
    what: str
    passed: bool
    failures: NonNegativeInt
    examples: list[str]


def audit(result: GateResult) -> list[str]:
    """What in a recorded numerics result its own rows and checks contradict (GATE.audit)."""
    try:
        rows = [RecordedRow.model_validate(r) for r in result.details.get("rows", [])]
        checks = [RecordedCheck.model_validate(c) for c in result.details.get("checks", [])]
        covered = result.details.get("coverage")
        covered = RecordedCoverage.model_validate(covered) if covered is not None else None
    except ValidationError as e:
        return problem_lines("details", e)
    problems = [f"check {c.check}: passed with {c.failures} failure(s)" for c in checks if c.passed != (not c.failures)]
    if result.status is Status.PASSED and covered is not None:
        problems += [f"shape {key} {sorted(set(d.admitted) - set(d.exercised))} admitted but never exercised, yet the "
                     "gate PASSED" for key, d in covered.shapes.items() if set(d.admitted) - set(d.exercised)]
    if result.status is Status.PASSED:
        problems += [f"check {c.check} failed, yet the gate PASSED" for c in checks if not c.passed]
        problems += [f"{r.point}, {r.dist}: failed, yet the gate PASSED" for r in rows if not r.passed]
    elif result.status is Status.FAILED_NUMERICS and all(c.passed for c in checks):
        problems.append("FAILED_NUMERICS, yet every check passed")
    return problems


def run(ctx: GateContext) -> GateResult:
    if reason := ctx.cannot_run_here():
        return GateResult.not_run(NAME, TITLE, reason)
    try:
        problem = ctx.problem()
        points = envelope_points(ctx.contract, problem, seed_for(ctx.options.seed, NAME, "points"))
        swept = batch_sweep(ctx.contract, problem, points, seed_for(ctx.options.seed, NAME, "sweep"))
        names = arg_names(problem.reference)
        findings = Findings()
        with Sandbox() as box, Sandbox(runs_candidate=False) as std_box:
            rows, standard_failure = check_points(ctx, problem, box, std_box, points, names, findings)
            sweep = check_sweep(ctx, problem, box, swept, names, findings)
            trajectories = ([check_trajectory(ctx, problem, box, p, names, findings) for p in points]
                            if problem.stateful else [])
            late = check_late_calls(ctx, problem, box, smallest(points), names, findings)
            loaded = sorted(box.loaded | std_box.loaded)
            confined = box.confined
    except ProblemError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e),
                          summary="the op's problem cannot check this contract")
    except SandboxError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e),
                          summary="the candidate's process failed")
    checks = [{"check": key, "what": what, "passed": not findings.counts.get(key),
               "failures": findings.counts.get(key, 0), "examples": findings.examples.get(key, [])}
              for key, what in CHECKS.items()
              if (key not in STATEFUL_CHECKS or problem.stateful) and (key not in GPU_CHECKS or ctx.device == "cuda")
              and (key != "early" or early_unavailable(ctx.device) is None)]
    tol = ctx.contract.tolerance
    details = {
        "device": ctx.device, "points": len(points), "coverage": coverage(ctx.contract, problem, points + swept),
        "sweep": sweep,
        "distributions": list(DISTRIBUTIONS),
        "trials": ctx.options.trials, "runs": ctx.options.runs,
        "tolerance": tol.model_dump(),
        "state_tolerance": ctx.contract.state_tolerance.model_dump() if ctx.contract.state_tolerance else None,
        "problem": problem.source.name, "checks": checks, "rows": rows,
        "trajectories": trajectories, "late_calls": late, "loaded": loaded, "confined": confined,
        "standard": ctx.contract.standard,
        "standard_not_run": [standard_failure] if standard_failure else [],
        "early_not_run": early_unavailable(ctx.device) if ctx.device == "cuda" else None,
    }
    inputs = len(rows) * ctx.options.trials
    if not findings:
        steps = f"; {len(trajectories)} trajectories of {ctx.options.steps} steps" if trajectories else ""
        steps += f"; {late['calls']} consecutive calls"
        return GateResult(gate=NAME, title=TITLE, status=Status.PASSED, details=details,
                          summary=f"{inputs} inputs × {ctx.options.runs} runs at {len(points)} envelope points "
                                  f"passed{steps}")
    failed = [ch for ch in checks if not ch["passed"]]
    status = Status.ERROR if [ch["check"] for ch in failed] == ["raised"] else Status.FAILED_NUMERICS
    return GateResult(gate=NAME, title=TITLE, status=status, details=details,
                      reason="; ".join(f"{ch['what']}: {ch['examples'][0]}" for ch in failed),
                      summary="failed: " + ", ".join(f"{ch['check']} ({ch['failures']})" for ch in failed))


GATE = Gate(NAME, TITLE, "the candidate matches the reference across the envelope, with every anti-cheat check", run,
            needs=("contracts", "compile"), audit=audit)
