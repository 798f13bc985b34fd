"""Generation: prefill the prompts in one step, then batched steps over sequences of different lengths --
decode steps of one token each, or speculative steps that verify K drafted tokens per sequence at once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .batch import StepBatch
from .cache import ModelCache
from .dispatch import Dispatcher
from .drafters import Drafter
from .model import KimiK3Model
from .sampling import sample, top_p_probs
from .spec_decode import greedy_accept, rejection_sample


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
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verification step


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

    def step(self, token_ids: list[int] | torch.Tensor, batch: StepBatch, every_token: bool = False) -> torch.Tensor:
        """One forward step; fp32 logits of each sequence's last token [B, V], or of every token [T, V]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, batch, self.cache)
        if every_token:
            return self.model.logits(hidden)
        last = torch.tensor([s + n - 1 for s, n in zip(batch.starts, batch.query_lens)], device=self.device)
        return self.model.logits(hidden[last])

    def generate(self, prompts: list[list[int]], params: SamplingParams, spec_tokens: int = 0,
                 drafter: Drafter | None = None) -> list[Generation]:
        """Generate for every prompt. With spec_tokens = K > 0, every step after the prefill verifies K tokens
        per sequence from `drafter` and emits the accepted ones plus one of the target's own: greedy at
        temperature 0, rejection sampling otherwise, so the output follows the target's distribution."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        vocab = self.model.cfg.vocab_size
        bad = [t for p in prompts for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"generate: prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if spec_tokens < 0 or (spec_tokens > 0) != (drafter is not None):
            raise ValueError(f"generate: speculative decoding needs spec_tokens > 0 and a drafter "
                             f"(got spec_tokens={spec_tokens}, drafter={drafter!r})")
        longest = max(map(len, prompts)) + params.max_new_tokens - 1 + spec_tokens
        if longest > self.cache.max_len:
            raise ValueError(f"generate: up to {longest} cached tokens per sequence exceed the engine's "
                             f"max_len {self.cache.max_len}")
        self.cache.reserve_spec(spec_tokens)
        gens = [Generation(list(p)) for p in prompts]
        slots = [self.cache.allocate() for _ in prompts]
        generators = [torch.Generator().manual_seed(params.seed + i) for i in range(len(prompts))]
        try:
            active = list(range(len(prompts)))
            batch = StepBatch(tuple(slots), tuple(len(p) for p in prompts), (0,) * len(prompts))
            logits = self.step([t for p in prompts for t in p], batch)
            active = self._record(gens, active, self._sample(logits, params, generators), logits, params)
            while active:
                if spec_tokens:
                    emitted, logits = self._verify(gens, [slots[i] for i in active], active, params, spec_tokens,
                                                   drafter, [generators[i] for i in active])
                else:
                    batch = StepBatch(tuple(slots[i] for i in active), (1,) * len(active),
                                      tuple(self.cache.lengths[slots[i]] for i in active))
                    logits = self.step([gens[i].tokens[-1] for i in active], batch)
                    emitted = self._sample(logits, params, [generators[i] for i in active])
                active = self._record(gens, active, emitted, logits, params)
            return gens
        finally:
            for s in slots:
                self.cache.release(s)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
        """One token per sequence from logits [B, V] -> [B, 1]; rank 0's choice on every TP rank."""
        tokens, _ = sample(logits, params.temperature, params.top_p, generators)
        return self.model.tp.broadcast(tokens).unsqueeze(-1)

    def _verify(self, gens: list[Generation], slots: list[int], active: list[int], params: SamplingParams, k: int,
                drafter: Drafter, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step: score each sequence's last token and k drafts, accept a prefix of the drafts
        and roll the caches back to it. Returns (emitted tokens [B, 1 + k], -1 padded; logits [B, 1 + k, V])."""
        b, vocab = len(active), self.model.cfg.vocab_size
        draft = drafter.propose([gens[i] for i in active], k)
        if draft.tokens.shape != (b, k) or not ((draft.tokens >= 0) & (draft.tokens < vocab)).all():
            raise ValueError(f"generate: the drafter proposed {tuple(draft.tokens.shape)} tokens, expected ({b}, {k}) "
                             f"ids in [0, {vocab})")
        drafts = draft.tokens.to(self.device)
        last = torch.tensor([[gens[i].tokens[-1]] for i in active], dtype=torch.long, device=self.device)
        batch = StepBatch(tuple(slots), (1 + k,) * b, tuple(self.cache.lengths[s] for s in slots), spec_tokens=k)
        logits = self.step(torch.cat([last, drafts], dim=1).flatten(), batch, every_token=True).view(b, 1 + k, -1)
        if params.temperature == 0:
            emitted = greedy_accept(logits, drafts)
        else:
            probs = top_p_probs(logits.flatten(0, 1), params.temperature, params.top_p).view_as(logits)
            q = None if draft.probs is None else draft.probs.to(self.device)
            emitted = rejection_sample(probs, drafts, q, generators)
        emitted = self.model.tp.broadcast(emitted)
        kept = (emitted >= 0).sum(-1).tolist()  # the last token and the accepted drafts
        self.cache.commit(slots, kept)
        for i, n in zip(active, kept):
            gens[i].accepted.append(n - 1)
        return emitted, logits

    def _record(self, gens: list[Generation], active: list[int], emitted: torch.Tensor, logits: torch.Tensor,
                params: SamplingParams) -> list[int]:
        """Append each active sequence's emitted tokens [B, n] (-1 padded), with their log-probabilities under
        the model's own distribution (logits [B, n, V] or [B, V]), until it is done; the unfinished ones."""
        logits = logits.view(emitted.shape[0], emitted.shape[1], -1)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, emitted.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        for i, tokens, lps in zip(active, emitted.tolist(), logprobs.tolist()):
            for tok, lp in zip(tokens, lps):
                if tok < 0 or self._done(gens[i], params):
                    break
                gens[i].tokens.append(tok)
                gens[i].logprobs.append(lp)
        return [i for i in active if not self._done(gens[i], params)]

    def _done(self, gen: Generation, params: SamplingParams) -> bool:
        if len(gen.tokens) >= params.max_new_tokens:
            return True
        return params.stop_at_eos and bool(gen.tokens) and gen.tokens[-1] == self.model.cfg.eos_token_id

