"""Generation: prefill the prompts in one step, then batched steps over sequences of different lengths --
decode steps of one token each, or speculative steps that verify K drafted tokens per sequence at once.

On a GPU, decode steps can replay CUDA graphs (`graph_sizes`): the whole step from token ids to the logits,
tensor-parallel collectives included, captured once per batch size when the engine is made; prefill and
verification steps run eagerly.

Generation refuses what it cannot do right: sampling parameters that are not finite, sequences longer than
the model's max_position_embeddings, caches that would not fit in the device's free memory (refused before
they are allocated, with the size needed), and logits that are not finite (generation stops and names the
first module whose output was not finite, rather than sampling from NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from .batch import StepBatch, StepKind
from .cache import ModelCache
from .config import KimiK3Config
from .cuda_graphs import GraphedDecode
from .dispatch import Dispatcher
from .drafters import Drafter
from .model import KimiK3Model
from .ops.registry import CONTRACTS_DIR
from .sampling import sample, top_p_probs
from .spec_decode import greedy_accept, rejection_sample


class NonFiniteError(ValueError):
    """The model produced NaN or inf logits; generation stopped instead of sampling from them."""


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: the GPU's free memory, or the host's MemAvailable (None when the
    host does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_fits(what: str, needed: int, device: torch.device) -> None:
    """ValueError naming `what` and the size it needs when that exceeds the memory free on `device`."""
    free = available_bytes(device)
    if free is not None and needed > free:
        raise ValueError(f"{what} need {needed / 2**30:,.2f} GiB; {free / 2**30:,.2f} GiB is free on {device}")


def positions_needed(cfg: KimiK3Config, prompt_len: int, max_new_tokens: int, spec_tokens: int) -> int:
    """Cache positions one sequence needs (its prompt, its new tokens, the drafts of a last verification);
    ValueError when that is beyond the model's max_position_embeddings."""
    needed = prompt_len + max_new_tokens - 1 + spec_tokens
    if needed > cfg.max_position_embeddings:
        raise ValueError(f"generate: a {prompt_len}-token prompt, {max_new_tokens} new tokens and {spec_tokens} "
                         f"draft tokens need {needed} positions; the model has {cfg.max_position_embeddings} "
                         "(max_position_embeddings)")
    return needed


def _bytes(*buffers: dict[int, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for buffer in buffers for t in buffer.values())


@dataclass(frozen=True)
class IndexedDecode(StepBatch):
    """A decode step whose index tensors are given instead of made from its host-side fields: each sequence's cache
    slot `slot_ids` [B] and its new token's position `positions` [B] (a CUDA graph's static input buffers, so the
    captured step reads whatever a replay copies into them). Its host-side fields say only what the step is (B
    sequences of one token each, with cached context); the layers of a decode step read the tensors alone."""

    slot_ids: torch.Tensor | None = field(default=None, compare=False)
    positions: torch.Tensor | None = field(default=None, compare=False)

    @classmethod
    def of(cls, slots: torch.Tensor, positions: torch.Tensor) -> "IndexedDecode":
        b = slots.shape[0]
        return cls(tuple(range(b)), (1,) * b, (1,) * b, slot_ids=slots, positions=positions)

    def slot_tensor(self, device: torch.device | str) -> torch.Tensor:
        return self.slot_ids

    def token_slots(self, device: torch.device | str) -> torch.Tensor:
        return self.slot_ids

    def token_positions(self, device: torch.device | str) -> torch.Tensor:
        return self.positions


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
    envelopes, from the contracts in `contracts_dir`); it installs a fresh dispatcher on the model, whose
    `report()` counts this engine's calls.
    graph_sizes (CUDA only): batch sizes whose decode step is captured in a CUDA graph when the engine is made; a
    decode step of b sequences then replays the smallest captured size >= b (`graphs.replays` counts them), its
    padded rows writing one cache slot that no sequence owns. Every rank of a TP group must make its engine
    alike, since each capture runs the step's collectives on every rank. kv_cache_dtype "fp8" keeps the MLA cache
    in e4m3 with one scale (ModelCache), decoded by the mla_decode_fp8 op.
    """

    def __init__(self, model: KimiK3Model, max_len: int, num_slots: int = 8, decode_backend: str = "auto",
                 graph_sizes: Sequence[int] = (), kv_cache_dtype: str = "auto", kv_scale: float = 1.0,
                 contracts_dir: str | Path = CONTRACTS_DIR):
        self.model = model
        model.ops = Dispatcher.for_model(model, decode_backend, contracts_dir)
        device = next(model.parameters()).device
        self.device = device
        if graph_sizes and device.type != "cuda":
            raise ValueError(f"Engine: CUDA graphs need a cuda device; the model is on {device}")
        scratch = 1 if graph_sizes else 0
        shape = (model.cfg, model.tp, num_slots + scratch, max_len, model.act_dtype)
        kv = dict(kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale)
        planned = ModelCache(*shape, device="meta", **kv)
        check_fits(f"the caches of {num_slots} sequences of {max_len} positions",
                   _bytes(planned.kv, planned.conv, planned.ssm), device)
        self.cache = ModelCache(*shape, device, **kv)
        self.graphs: GraphedDecode | None = None
        if graph_sizes:
            self._scratch = self.cache.allocate()  # never released: the padded rows' slot
            self.graphs = GraphedDecode(self.decode_logits, self._padding, graph_sizes, model.ops)

    def decode_logits(self, token_ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] of a decode step given as tensors: token ids [B], cache slots [B] and each new token's
        position [B] (its sequence's cached length). The tensor work alone, with no accounting of the cache's
        lengths: the step the CUDA graphs capture."""
        batch = IndexedDecode.of(slots, positions)
        return self.model.logits(self.model.hidden_states(token_ids, batch, self.cache))

    def _padding(self, size: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a graph's padded rows: token 0 at position 0 of the scratch slot."""
        zeros = torch.zeros(size, dtype=torch.long, device=self.device)
        return zeros, torch.full_like(zeros, self._scratch), zeros.clone()

    def _reserve_spec(self, spec_tokens: int) -> None:
        """Room for verification steps of `spec_tokens` drafts, refused before allocation if it would not fit."""
        if spec_tokens > self.cache.spec_tokens:
            c = self.cache
            planned = ModelCache(c.cfg, self.model.tp, c.num_slots, 1, self.model.act_dtype, "meta", spec_tokens)
            check_fits(f"the verification states of {spec_tokens} draft tokens for {c.num_slots} sequences",
                       _bytes(planned.spec_conv, planned.spec_ssm), self.device)
        self.cache.reserve_spec(spec_tokens)

    def step(self, token_ids: list[int] | torch.Tensor, batch: StepBatch, every_token: bool = False) -> torch.Tensor:
        """One forward step; fp32 logits of each sequence's last token [B, V], or of every token [T, V] (from a
        CUDA graph: a view of its output, which the next replay overwrites). NonFiniteError when they are not all
        finite (one check of what is sampled from: a non-finite hidden state always reaches it)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if self.graphs is not None and batch.kind is StepKind.DECODE and batch.batch_size <= self.graphs.sizes[-1]:
            logits = self._replay(ids, batch)
        else:
            hidden = self.model(ids, batch, self.cache)
            if not every_token:
                hidden = hidden[torch.tensor([s + n - 1 for s, n in zip(batch.starts, batch.query_lens)],
                                             device=self.device)]
            logits = self.model.logits(hidden)
        if not torch.isfinite(logits).all():
            raise NonFiniteError(f"generate: the logits are not finite; {self._first_nonfinite(ids, batch)}")
        return logits

    def _replay(self, ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """A decode step from its CUDA graph, the cache's lengths checked and advanced as the model's forward does."""
        for slot in batch.slots:
            self.cache.check_room(slot, 1)
        logits = self.graphs(ids, batch.slot_tensor(self.device), batch.token_positions(self.device))
        self.cache.advance(batch)
        return logits

    def _first_nonfinite(self, ids: torch.Tensor, batch: StepBatch) -> str:
        """Where the step's non-finite values first appear: the embedding, else the first module whose output
        is not finite when the step runs again with a hook on every module. The re-run starts from the states the
        failed step left (generation stops anyway), which reproduces a NaN of the weights or of the state."""
        if not torch.isfinite(self.model.vocab.embed_tokens(ids)).all():
            return "the token embedding (model.embed_tokens) is not finite for these tokens"
        names = {module: name or "the model" for name, module in self.model.named_modules()}
        found: list[str] = []

        def record(module: nn.Module, args, output) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            if not found and any(isinstance(t, torch.Tensor) and not torch.isfinite(t).all() for t in outputs):
                found.append(names[module])

        if batch.spec_tokens:  # a verification step waits for its commit before the slot runs again
            self.cache.commit(list(batch.slots), list(batch.query_lens))
        for slot, n in zip(batch.slots, batch.query_lens):
            self.cache.lengths[slot] -= n
        hooks = [module.register_forward_hook(record) for module in names]
        try:
            self.model.norm(self.model(ids, batch, self.cache), self.model.ops)
        finally:
            for hook in hooks:
                hook.remove()
        if found:
            return f"the first module whose output is not finite is {found[0]}"
        return "every module's output is finite, so the output head (lm_head) is not"

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
        if not (params.max_new_tokens >= 1 and 0 <= params.temperature < math.inf and 0 < params.top_p <= 1):
            raise ValueError(f"generate: max_new_tokens >= 1, a finite temperature >= 0 and top_p in (0, 1] (got "
                             f"{params.max_new_tokens}, {params.temperature}, {params.top_p})")
        longest = positions_needed(self.model.cfg, max(map(len, prompts)), params.max_new_tokens, spec_tokens)
        if longest > self.cache.max_len:
            raise ValueError(f"generate: up to {longest} cached tokens per sequence exceed the engine's "
                             f"max_len {self.cache.max_len}")
        self._reserve_spec(spec_tokens)
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

