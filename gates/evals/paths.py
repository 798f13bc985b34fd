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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch
from tokenizers import Tokenizer

from model.kimi_k3.batch import StepBatch
from model.kimi_k3.config import KimiK3Config
from model.kimi_k3.dispatch import Dispatcher
from model.kimi_k3.engine import Engine
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.ops.registry import OPS
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

    def __init__(self, model: KimiK3Model, max_len: int, ops: Dispatcher):
        shared = model.ops
        super().__init__(model, max_len, num_slots=1)  # installs a dispatcher on the shared model: undo that
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
    make_engine: Callable[[int], Engine]  # max_len -> an engine with one cache slot
    logit_transforms: tuple[LogitTransform, ...] = ()
    sampler: Sampler = sample

    def session(self, max_len: int) -> "Session":
        return Session(self, max_len)


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


def backend_path(model: KimiK3Model, backend: str) -> DecodePath:
    """A path's engines share one dispatcher, so its `report()` counts what the path ran."""
    if backend == "reference":
        ops = ReferenceDispatcher.for_model(model)
    elif backend in BACKENDS:
        ops = Dispatcher.for_model(model, backend)
    else:
        raise ValueError(f"unknown decode backend {backend!r}; choose from {BACKENDS}")
    return DecodePath(backend, partial(DispatchedEngine, model, ops=ops))


def perturbed(path: DecodePath, scale: float = PERTURB_SCALE) -> DecodePath:
    """The known-bad twin of a path: its logits scaled by `scale` (sampling at temperature T / scale)."""
    return replace(path, name=f"{path.name}*{scale:g}", logit_transforms=(*path.logit_transforms, lambda x: x * scale))


class Session:
    """One sequence on one path: feed tokens, read the logits after the last one and the KDA states."""

    def __init__(self, path: DecodePath, max_len: int):
        self.path = path
        self.engine = path.make_engine(max_len)
        self.slot = self.engine.cache.allocate()

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
