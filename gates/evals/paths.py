"""Decode paths: the ways of running one model that an eval compares, and sessions that step them.

A path is an engine factory (the engine decides which op implementations run) plus what it does to
logits and how it samples. Paths share one model and its weights; each session owns an engine with a
single cache slot, so two paths can be stepped side by side on the same tokens.

- `reference`: every op's reference implementation (plain PyTorch; the numerics ground truth).
- `auto`: the standard path, today's `Engine` (each op's standard implementation, the reference where
  there is none).
- `latency_specialized`: the contracted kernels inside their envelopes, the standard ops elsewhere.
- `perturbed(path)`: a known-bad path, the same engine with logits scaled by 1.05 (temperature / 1.05);
  every eval must be able to tell it apart from its base where the behaviour it checks is affected.

A session of a path run in this process can record its router's choices (`RoutingTap`): the selection keys of
every MoE layer at every sequence position, and, asked to, decode with one near-tie choice swapped -- the branch
a legitimate rounding difference can take (gates/evals/structured.py uses both; the candidate's own process is
never asked, since what it would report is the candidate's to forge).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
from tokenizers import Tokenizer

from model.kimi_k3.batch import StepBatch
from model.kimi_k3.config import KimiK3Config
from model.kimi_k3.dispatch import Dispatcher, Target
from model.kimi_k3.engine import Engine
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.ops.moe_route import moe_route, route_weights, router_scores
from model.kimi_k3.ops.registry import CONTRACTS_DIR, OPS, load_specialized
from model.kimi_k3.sampling import sample

BACKENDS = ("reference", "auto", "latency_specialized")
PERTURB_SCALE = 1.05

LogitTransform = Callable[[torch.Tensor], torch.Tensor]
Sampler = Callable[[torch.Tensor, float, float, list[torch.Generator]], tuple[torch.Tensor, torch.Tensor]]


class ReferenceDispatcher(Dispatcher):
    """Runs every op's reference implementation (build it with `ReferenceDispatcher.for_model(model)`)."""

    def call(self, name: str, *args, **kwargs):
        return OPS[name].reference(*args, **kwargs)


class DispatchedEngine(Engine):
    """An engine whose steps run through its own dispatcher (the model, and its `ops`, are shared by paths)."""

    def __init__(self, model: KimiK3Model, max_len: int, ops: Dispatcher, kv_cache_dtype: str = "auto",
                 num_slots: int = 1):
        shared = model.ops
        # Engine installs a dispatcher on the shared model: undone below
        super().__init__(model, max_len, num_slots=num_slots, kv_cache_dtype=kv_cache_dtype)
        model.ops = shared
        self.ops = ops

    def step(self, token_ids: list[int] | torch.Tensor, batch: StepBatch, every_token: bool = False) -> torch.Tensor:
        shared = self.model.ops
        self.model.ops = self.ops
        try:
            return super().step(token_ids, batch, every_token)
        finally:
            self.model.ops = shared


@dataclass(frozen=True)
class DecodePath:
    name: str
    # (max_len, num_slots=1) -> an engine with that many cache slots (a session's has one; the accuracy eval's many)
    make_engine: Callable[..., Engine]
    logit_transforms: tuple[LogitTransform, ...] = ()
    sampler: Sampler = sample
    # the dispatcher the path's engines run through, in this process (None: a path whose engines live elsewhere,
    # e.g. a sandboxed candidate's, which reports its own counts): its `report()` counts what the path ran
    ops: Dispatcher | None = None

    def dispatch_counts(self) -> dict[str, dict]:
        """{op: {"specialized": calls, "standard": calls, "fallbacks": {reason: calls}}} so far ({} without ops)."""
        return {} if self.ops is None else self.ops.report()["ops"]

    def session(self, max_len: int, routing: "RoutingTap | None" = None) -> "Session":
        return Session(self, max_len, routing)


@dataclass(frozen=True)
class PathPair:
    """The two paths an eval compares, over one model (shared weights) and the checkpoint's tokenizer.

    `standard`, when set, is the yardstick: the standard path run beside them on the same tokens, whose own
    distance from the reference bounds how far the candidate may be (where rounding, not a bug, sets the
    distance: bf16 on random weights, where top-k routing flips amplify any rounding difference)."""

    reference: DecodePath
    candidate: DecodePath
    model: KimiK3Model
    tokenizer: Tokenizer
    notes: tuple[str, ...] = ()
    standard: DecodePath | None = None

    @property
    def cfg(self) -> KimiK3Config:
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def label(self) -> str:
        return f"{self.candidate.name} vs {self.reference.name}"


def backend_path(model: KimiK3Model, backend: str, only: Sequence[str] | None = None,
                 kv_cache_dtype: str = "auto", contracts_dir: Path = CONTRACTS_DIR) -> DecodePath:
    """A path's engines share one dispatcher, so its `report()` counts what the path ran. latency_specialized
    runs the kernels of the contracts in `contracts_dir`; `only`: the kernels of these ops alone, every other op
    standard, as a gate runs one contract. kv_cache_dtype: the engines' MLA cache (ModelCache; "fp8" names the
    path so)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r}; choose from {BACKENDS}")
    if only is not None:
        if backend != "latency_specialized":
            raise ValueError(f"choosing kernels by op needs the latency_specialized backend, not {backend!r}")
        ops, name = _kernels_of(model, only, contracts_dir), f"{backend}[{','.join(only)}]"
    else:
        ops = (ReferenceDispatcher.for_model(model) if backend == "reference"
               else Dispatcher.for_model(model, backend, contracts_dir))
        name = backend
    return dispatched_path(model, ops, name, kv_cache_dtype)


def dispatched_path(model: KimiK3Model, ops: Dispatcher, name: str, kv_cache_dtype: str = "auto") -> DecodePath:
    """A path whose engines run through `ops` over the model's shared weights, with that MLA cache (a quantized one
    names the path so)."""
    if kv_cache_dtype != "auto":
        name = f"{name} ({kv_cache_dtype} MLA cache)"
    return DecodePath(name, partial(DispatchedEngine, model, ops=ops, kv_cache_dtype=kv_cache_dtype), ops=ops)


def _kernels_of(model: KimiK3Model, ops: Sequence[str], contracts_dir: Path) -> Dispatcher:
    """A latency_specialized dispatcher with the contracts of `ops` only."""
    target = Target.of(model)
    kernels = load_specialized(contracts_dir, arch=target.arch)
    unknown = sorted(set(ops) - set(kernels))
    if unknown:
        raise ValueError(f"no contract for op(s) {', '.join(unknown)} in {contracts_dir}; "
                         f"choose from {', '.join(sorted(kernels))}")
    return Dispatcher(target, "latency_specialized", {op: kernels[op] for op in ops})


def perturbed(path: DecodePath, scale: float = PERTURB_SCALE) -> DecodePath:
    """The known-bad twin of a path: its logits scaled by `scale` (sampling at temperature T / scale)."""
    return replace(path, name=f"{path.name}*{scale:g}", logit_transforms=(*path.logit_transforms, lambda x: x * scale))


@dataclass(frozen=True)
class RouteSwap:
    """A near-tie router choice to swap: at sequence `position`, in the `layer`-th MoE layer of the step (counted
    from 0 in call order), the last expert chosen gives way to the best one left out."""

    position: int
    layer: int


class RoutingTap:
    """Stands for a path's dispatcher (forwarding every call) and records every `moe_route` call's selection keys
    -- sigmoid(x W^T) + bias in fp32, the reference's formula on the path's own router input -- by sequence position
    and MoE layer: `keys[position][layer]` is a [E] tensor on the CPU. A position decoded again (a rejected draft's)
    is recorded again. With `swap`, the choice it names is swapped before the experts run."""

    _ARGS = inspect.signature(moe_route)

    def __init__(self, swap: RouteSwap | None = None):
        self.swap = swap
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.swapped = 0  # how often the swap was applied (0: its position was never decoded)
        self._ops: Dispatcher | None = None
        self._start = self._layer = 0

    def wrap(self, ops: Dispatcher) -> "RoutingTap":
        self._ops = ops
        return self

    def begin_step(self, batch: StepBatch) -> None:
        """The step's positions (a session's steps have one sequence), then the dispatcher's own bookkeeping."""
        if batch.batch_size != 1:
            raise ValueError(f"RoutingTap: a step of {batch.batch_size} sequences (it records one session's)")
        self._start, self._layer = batch.context_lens[0], 0
        for position in range(self._start, self._start + batch.query_lens[0]):
            self.keys[position] = []
        self._ops.begin_step(batch)

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def call(self, name: str, *args, **kwargs):
        out = self._ops.call(name, *args, **kwargs)
        if name != "moe_route":
            return out
        a = self._ARGS.bind(*args, **kwargs).arguments
        scores = router_scores(a["x"], a["gate_w"])
        keys = scores + a["bias"].float()
        for row, k in enumerate(keys.cpu()):
            self.keys[self._start + row].append(k)
        swap, layer = self.swap, self._layer
        self._layer += 1
        if swap is None or swap.layer != layer or not 0 <= swap.position - self._start < keys.shape[0]:
            return out
        row, top_k = swap.position - self._start, a["top_k"]
        ids, weights = (t.clone() for t in out)
        order = keys[row].argsort(descending=True, stable=True)
        ids[row] = torch.cat([order[:top_k - 1], order[top_k:top_k + 1]])
        weights[row] = route_weights(scores[row].gather(0, ids[row]), a["renormalize"], a["scaling"])
        self.swapped += 1
        return ids, weights


class Session:
    """One sequence on one path: feed tokens, read the logits after the last one and the KDA states; with a
    `RoutingTap`, its router's choices are recorded (and one swapped, if the tap says so)."""

    def __init__(self, path: DecodePath, max_len: int, routing: RoutingTap | None = None):
        self.path = path
        self.engine = path.make_engine(max_len)
        self.slot = self.engine.cache.allocate()
        self.routing = routing
        if routing is not None:
            if not isinstance(self.engine, DispatchedEngine):
                raise TypeError(f"path {path.name}: recording its routing needs a DispatchedEngine")
            self.engine.ops = routing.wrap(self.engine.ops)

    @property
    def length(self) -> int:
        """Tokens cached so far."""
        return self.engine.cache.lengths[self.slot]

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Run the tokens as one step (prefill for several, decode for one); fp32 logits [V] after the last."""
        return self._transformed(self._run(list(tokens), verify=False))

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """A speculative verification step: the last emitted token then len(tokens) - 1 drafts, scored at once;
        logits [len(tokens), V], row j predicting the token after tokens[:j + 1]. Follow with `keep`."""
        return self._transformed(self._run(list(tokens), verify=True))

    def keep(self, n: int) -> None:
        """After `verify`: keep its first n tokens (the last emitted one and the accepted drafts)."""
        self.engine.cache.commit([self.slot], [n])

    def kda_states(self) -> dict[int, torch.Tensor]:
        """A copy of each KDA layer's recurrent state [H, V, K] (fp32) for this sequence, as it is now."""
        return {layer: ssm[self.slot].clone() for layer, ssm in self.engine.cache.ssm.items()}

    def _run(self, tokens: list[int], verify: bool) -> torch.Tensor:
        """The engine's logits for one step: [V] after the last token, or [T, V] for a verification step."""
        if verify:
            k = len(tokens) - 1
            self.engine.cache.reserve_spec(k)
            batch = StepBatch((self.slot,), (len(tokens),), (self.length,), spec_tokens=k)
            return self.engine.step(tokens, batch, every_token=True)
        return self.engine.step(tokens, StepBatch((self.slot,), (len(tokens),), (self.length,)))[0]

    def _transformed(self, logits: torch.Tensor) -> torch.Tensor:
        for transform in self.path.logit_transforms:
            logits = transform(logits)
        return logits
