"""Model-level eval gates: each compares the candidate decode path with the reference path on one model.

`EVALS` maps a gate name to its runner `run(config, paths, progress) -> EvalResult` and its config (fixed
CPU and GPU budgets); `run_eval` runs one with timing and turns an unavailable path into NOT_RUN and a
crash into ERROR, so a gate runner can record every outcome.
"""

from __future__ import annotations

import logging
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from rich.progress import Progress

from gates.core.machine import one_thread

from . import long_context, sampling, structured
from .config import EvalConfig
from .paths import PathPair
from .result import EvalResult, Status, Table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalGate:
    name: str
    run: Callable[[EvalConfig, PathPair, Progress], EvalResult]
    config: type[EvalConfig]  # its defaults are the gate's fixed budgets
    summary: str


EVALS: dict[str, EvalGate] = {gate.name: gate for gate in (
    EvalGate(sampling.NAME, sampling.run, sampling.SamplingConfig,
             "temperature / top-p sampling distributions: exact TV and KL per position, seeded draws within noise"),
    EvalGate(structured.NAME, structured.run, structured.StructuredConfig,
             "grammar-constrained JSON (llguidance): parses, validates, same greedy tokens"),
    EvalGate(long_context.NAME, long_context.run, long_context.LongContextConfig,
             "prefill + decode per context-length bucket: logit drift, greedy agreement, KDA state, MRCR-style probe"),
)}


@contextmanager
def single_threaded_on_cpu(device: torch.device) -> Iterator[None]:
    """CPU evals run on one intra-op thread (gates.core.machine.one_thread says why); GPU evals as they are."""
    with one_thread() if device.type == "cpu" else nullcontext():
        yield


def run_eval(name: str, paths: PathPair, progress: Progress, config: EvalConfig | None = None,
             gate: EvalGate | None = None) -> EvalResult:
    """`gate` runs an eval that is not one of EVALS (the accuracy eval, which needs a trained checkpoint)."""
    gate = gate or EVALS[name]
    config = config if config is not None else gate.config()
    start = time.perf_counter()
    before = {p.name: p.dispatch_counts() for p in _paths_with_dispatchers(paths)}
    try:
        with single_threaded_on_cpu(paths.device):
            result = gate.run(config, paths, progress)
    except Exception as e:  # a crashing eval is recorded as ERROR, with where it crashed
        log.exception("eval %s crashed", name)
        result = EvalResult(name=name, status=Status.ERROR, reason=f"{type(e).__name__}: {e}",
                            notes=traceback.format_exc().strip().splitlines()[-6:])
    notes = [*paths.notes, f"paths: {paths.label}", *result.notes]
    tables = [*result.tables, *dispatch_table(paths, before)]
    return result.model_copy(update={"seconds": round(time.perf_counter() - start, 2), "notes": notes,
                                     "tables": tables})


def _paths_with_dispatchers(paths: PathPair) -> list:
    return [p for p in (paths.candidate, paths.standard) if p is not None and p.ops is not None]


def dispatch_table(paths: PathPair, before: dict[str, dict]) -> list[Table]:
    """What the candidate and standard paths ran during one eval: per op, the dispatcher's specialized and standard
    calls and each fallback's reason (counts since `before`, each path's counts when the eval started), so a report
    shows which kernels the verdict covers. [] when no path counts in this process or nothing was dispatched."""
    table = Table(title="what ran: the dispatcher's calls per op during this eval",
                  columns=["path", "op", "specialized kernel calls", "standard calls", "fallbacks (reason: calls)"])
    for path in _paths_with_dispatchers(paths):
        start = before.get(path.name, {})
        for op, now in sorted(path.dispatch_counts().items()):
            was = start.get(op, {"specialized": 0, "standard": 0, "fallbacks": {}})
            fallbacks = {r: n - was["fallbacks"].get(r, 0) for r, n in now["fallbacks"].items()}
            fallbacks = {r: n for r, n in fallbacks.items() if n}
            row = (now["specialized"] - was["specialized"], now["standard"] - was["standard"])
            if any(row):
                table.add(path.name, op, *row, ", ".join(f"{r}: {n}" for r, n in sorted(fallbacks.items())) or "-")
    return [table] if table.rows else []
