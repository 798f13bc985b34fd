"""Generation: prefill the prompts in one step, then batched decode steps over sequences of different lengths."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batch import StepBatch
from .cache import ModelCache
from .dispatch import Dispatcher
from .model import KimiK3Model
from .sampling import sample


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = False


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Engine:
    """Owns a model, its cache slots and a sampler; generates for a batch of prompts.

    decode_backend: "auto" (the standard path) or "latency_specialized" (contracted kernels inside their
    envelopes); it installs a fresh dispatcher on the model, whose `report()` counts this engine's calls.
    """

    def __init__(self, model: KimiK3Model, max_len: int, num_slots: int = 8, decode_backend: str = "auto"):
        self.model = model
        model.ops = Dispatcher.for_model(model, decode_backend)
        device = next(model.parameters()).device
        self.device = device
        self.cache = ModelCache(model.cfg, model.tp, num_slots, max_len, model.act_dtype, device)

    def step(self, token_ids: list[int], batch: StepBatch) -> torch.Tensor:
        """One forward step; fp32 logits of each sequence's last token [B, V]."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, batch, self.cache)
        last = torch.tensor([s + n - 1 for s, n in zip(batch.starts, batch.query_lens)], device=self.device)
        return self.model.logits(hidden[last])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts or any(not p for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        vocab = self.model.cfg.vocab_size
        bad = [t for p in prompts for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"generate: prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        gens = [Generation(list(p)) for p in prompts]
        slots = [self.cache.allocate() for _ in prompts]
        generators = [torch.Generator().manual_seed(params.seed + i) for i in range(len(prompts))]
        try:
            batch = StepBatch(tuple(slots), tuple(len(p) for p in prompts), (0,) * len(prompts))
            logits = self.step([t for p in prompts for t in p], batch)
            active = list(range(len(prompts)))
            while True:
                tokens, logprobs = sample(logits, params.temperature, params.top_p, [generators[i] for i in active])
                for i, tok, lp in zip(active, tokens.tolist(), logprobs.tolist()):
                    gens[i].tokens.append(tok)
                    gens[i].logprobs.append(lp)
                active = [i for i in active if not self._done(gens[i], params)]
                if not active:
                    return gens
                batch = StepBatch(tuple(slots[i] for i in active), (1,) * len(active),
                                  tuple(self.cache.lengths[slots[i]] for i in active))
                logits = self.step([gens[i].tokens[-1] for i in active], batch)
        finally:
            for s in slots:
                self.cache.release(s)

    def _done(self, gen: Generation, params: SamplingParams) -> bool:
        if len(gen.tokens) >= params.max_new_tokens:
            return True
        return params.stop_at_eos and gen.tokens[-1] == self.model.cfg.eos_token_id
