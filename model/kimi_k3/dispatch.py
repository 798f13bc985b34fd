"""Per-call choice between an op's standard implementation and its specialized kernel.

`decode_backend="auto"` runs every op's standard implementation. `"latency_specialized"` runs an op's
specialized kernel only inside its contract's envelope, checked at three levels:
- where the model runs, once: arch validated here, TP size, activation dtype;
- the step (StepBatch), once per step: pure decode or speculative verification, batch size, draft tokens;
- the call (the op's own arguments), every call: rank-local shapes and operand dtypes.
Outside it the standard op runs and the reason is counted; each (op, reason) is logged once. A kernel
that raises falls back to the standard op for that call, and the error is counted, logged and reported.
Kernels raise before they write (argument, compile and launch errors; a CUDA fault surfaces later and
is not recoverable anyway), so the standard op sees its inputs untouched.

Counts are per op call: an op runs once per layer (twice for AttnRes) in every step.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from kernels import arch
from kernels.contract import Contract, HardwareSupport, ValidatedHardware

from .batch import StepBatch, StepKind
from .ops.registry import CONTRACTS_DIR, OPS, Signature, Specialized, dtype_name, entry_point, load_specialized

log = logging.getLogger(__name__)

DECODE_BACKENDS = ("auto", "latency_specialized")


class Reason(str, Enum):
    """Why a call ran the standard op instead of the specialized kernel."""

    ARCH = "arch"  # this machine's arch is not validated in the contract
    TP_SIZE = "tp_size"
    DTYPE = "dtype"
    PREFILL = "prefill"
    MIXED = "mixed"  # prefill and decode sequences in one step
    BATCH = "batch"
    SPEC_TOKENS = "spec_tokens"
    SHAPE = "shape"
    ERROR = "error"  # the kernel raised


@dataclass(frozen=True)
class Fallback:
    reason: Reason
    detail: str


def detect(device: torch.device) -> tuple[str, str]:
    """(arch, device name) of a device: ('sm_90', 'NVIDIA H200') on a GPU, ('cpu', 'cpu') elsewhere."""
    info = arch.detect(device) if device.type == "cuda" else arch.known("cpu")
    return info.arch, info.device_name


@dataclass(frozen=True)
class Target:
    """Where the model runs: what a contract's hardware, TP sizes and activation dtype are checked against."""

    arch: str
    device_name: str
    tp_size: int
    act_dtype: torch.dtype

    @property
    def gpu(self) -> bool:
        return self.arch != "cpu"

    @classmethod
    def of(cls, model) -> "Target":
        """A KimiK3Model's: the device of its parameters, its TP group's size, its activation dtype."""
        arch, name = detect(next(model.parameters()).device)
        return cls(arch, name, model.tp.size, model.act_dtype)


def _range(r) -> str:
    return f"{r.min}..{r.max}"


def target_fallback(c: Contract, t: Target) -> Fallback | None:
    if t.arch not in c.archs_validated:
        return Fallback(Reason.ARCH, f"arch {t.arch} ({t.device_name}) not validated; validated: "
                                     f"{', '.join(c.archs_validated) or 'none'}")
    if t.tp_size not in c.tp_sizes:
        return Fallback(Reason.TP_SIZE, f"TP size {t.tp_size} not in {c.tp_sizes}")
    act = dtype_name(t.act_dtype)
    if act != c.dtypes.activations:
        return Fallback(Reason.DTYPE, f"activations {act}, contract {c.dtypes.activations}")
    return None


def judged_here(contract: Contract, target: Target) -> Contract:
    """The contract as the candidate path's dispatcher sees it while the gate judges it on this arch (its evals,
    its production replay): the arch counted as validated, since the gate is what would validate it (a declared
    arch would always fall back, and a kernel's first gate would never run its evals). Every other envelope
    check stands."""
    if target.arch in contract.archs_validated:
        return contract
    hw = contract.hardware
    judged = ValidatedHardware(arch=target.arch, devices=[target.device_name])
    return contract.model_copy(update={"hardware": HardwareSupport(
        validated=[*hw.validated, judged], declared=[h for h in hw.declared if h.arch != target.arch])})


def step_fallback(c: Contract, batch: StepBatch) -> Fallback | None:
    kind = batch.kind
    if kind is StepKind.PREFILL:
        return Fallback(Reason.PREFILL, "prefill step")
    if kind is StepKind.MIXED:
        return Fallback(Reason.MIXED, "prefill and decode sequences in one step")
    if batch.spec_tokens not in c.spec_tokens:
        return Fallback(Reason.SPEC_TOKENS, f"{batch.spec_tokens} draft tokens outside {_range(c.spec_tokens)}")
    if batch.batch_size not in c.batch:
        return Fallback(Reason.BATCH, f"batch {batch.batch_size} outside {_range(c.batch)}")
    return None


def call_fallback(c: Contract, sig: Signature) -> Fallback | None:
    for key, allowed in c.shapes.items():
        if sig.shapes[key] not in allowed:
            return Fallback(Reason.SHAPE, f"{key} {sig.shapes[key]} not in {allowed}")
    for key, have in sig.dtypes.items():
        want = getattr(c.dtypes, key)
        if want is not None and have != want:
            return Fallback(Reason.DTYPE, f"{key} {have}, contract {want}")
    return None


@dataclass
class OpStats:
    standard_impl: str
    specialized: int = 0
    standard: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # reason -> calls
    last_error: str | None = None

    def as_dict(self) -> dict:
        return {"specialized": self.specialized, "standard": self.standard, "fallbacks": dict(self.fallbacks),
                "standard_impl": self.standard_impl, "last_error": self.last_error}


# One call's outcome: (op, ran the specialized kernel, why not); replayed graphs count these again.
Decision = tuple[str, bool, Fallback | None]


class Dispatcher:
    """Runs each op call through the implementation its envelope allows, and counts why.

    Layers call `call(name, *args)`; the model calls `begin_step(batch)` first in every step.
    """

    def __init__(self, target: Target, backend: str = "auto", specialized: Mapping[str, Specialized] | None = None):
        if backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend: {backend!r} is not one of {', '.join(DECODE_BACKENDS)}")
        self.target, self.backend = target, backend
        self.specialized = dict(specialized or {}) if backend == "latency_specialized" else {}
        self._fixed = {name: target_fallback(s.contract, target) for name, s in self.specialized.items()}
        self._step: dict[str, Fallback | None] | None = None
        self._standard: dict[str, Callable] = {}
        self._stats: dict[str, OpStats] = {}
        self._logged: set[tuple[str, Reason]] = set()
        self._recording: list[Decision] | None = None

    @classmethod
    def for_model(cls, model, backend: str = "auto", contracts_dir: str | Path = CONTRACTS_DIR) -> "Dispatcher":
        """The dispatcher of a KimiK3Model; `latency_specialized` loads every contract in `contracts_dir`."""
        target = Target.of(model)
        specialized = load_specialized(contracts_dir, arch=target.arch) if backend == "latency_specialized" else {}
        return cls(target, backend, specialized)

    def begin_step(self, batch: StepBatch) -> None:
        self._step = {name: fixed or step_fallback(self.specialized[name].contract, batch)
                      for name, fixed in self._fixed.items()}

    def call(self, name: str, *args, **kwargs):
        spec = self.specialized.get(name)
        if spec is None:
            return self._run_standard(name, None, args, kwargs)
        if self._step is None:
            raise RuntimeError("Dispatcher.call before begin_step: the step's envelope is unknown")
        fallback = self._step[name] or call_fallback(spec.contract, OPS[name].signature(*args, **kwargs))
        if fallback is not None:
            return self._run_standard(name, fallback, args, kwargs)
        try:
            out = spec.fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any kernel failure falls back; it is counted and logged
            fallback = Fallback(Reason.ERROR, f"{type(e).__name__}: {e}")
            self._log_once(name, fallback, exc=e)
            self._op_stats(name).last_error = fallback.detail
            return self._run_standard(name, fallback, args, kwargs)
        self._count((name, True, None))
        return out

    def _run_standard(self, name: str, fallback: Fallback | None, args, kwargs):
        if fallback is not None:
            self._log_once(name, fallback)
        self._count((name, False, fallback))
        return self._standard_fn(name)(*args, **kwargs)

    def _standard_fn(self, name: str) -> Callable:
        if name not in self._standard:
            self._standard[name] = OPS[name].standard(self.target.gpu)
        return self._standard[name]

    def _op_stats(self, name: str) -> OpStats:
        if name not in self._stats:
            self._stats[name] = OpStats(entry_point(self._standard_fn(name)))
        return self._stats[name]

    def _count(self, decision: Decision) -> None:
        if self._recording is not None:
            self._recording.append(decision)
            return
        name, specialized, fallback = decision
        stats = self._op_stats(name)
        if specialized:
            stats.specialized += 1
        else:
            stats.standard += 1
            if fallback is not None:
                stats.fallbacks[fallback.reason.value] += 1

    def _log_once(self, name: str, fallback: Fallback, exc: Exception | None = None) -> None:
        key = (name, fallback.reason)
        if key in self._logged:
            return
        self._logged.add(key)
        level = logging.WARNING if exc is not None else logging.INFO
        log.log(level, "%s: the standard op runs instead of the specialized kernel (%s: %s); counted in the "
                "dispatch report, logged once", name, fallback.reason.value, fallback.detail, exc_info=exc)

    @contextmanager
    def recording(self) -> Iterator[list[Decision]]:
        """Collect the decisions made inside instead of counting them (CUDA-graph warm-up and capture);
        `replayed(decisions)` counts them once per replay."""
        outer, self._recording = self._recording, []
        try:
            yield self._recording
        finally:
            self._recording = outer

    def replayed(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            self._count(decision)

    def report(self) -> dict:
        """Per-op counts of specialized and standard calls and the fallback reasons (JSON-ready)."""
        t = self.target
        return {
            "backend": self.backend,
            "target": {"arch": t.arch, "device": t.device_name, "tp_size": t.tp_size,
                       "act_dtype": dtype_name(t.act_dtype)},
            "contracts": sorted(self.specialized),
            "ops": {name: s.as_dict() for name, s in sorted(self._stats.items())},
        }
