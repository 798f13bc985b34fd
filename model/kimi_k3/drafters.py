"""Drafters: where the K tokens a speculative step verifies come from.

A drafter sees each active sequence (its prompt and the tokens generated so far; the last of those is
the verification step's first input) and proposes K tokens per sequence. Any proposal is correct --
the acceptance rule (spec_decode.py) keeps the target's distribution -- only the acceptance length
depends on it. Every TP rank drafts on its own, so a drafter must be deterministic in the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from .engine import Engine, Generation


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [B, K] int64
    probs: torch.Tensor | None = None  # [B, K, V] the drafter's distribution q; None: one-hot on `tokens`


class Drafter(Protocol):
    def propose(self, seqs: Sequence[Generation], k: int) -> Draft: ...


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (the longest
    n in [n_min, n_max] that occurs) and propose what followed it. Copying runs on into the drafted
    tokens themselves, so a match near the end repeats its period; with no match the last token repeats."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramDrafter: need 1 <= n_min ({n_min}) <= n_max ({n_max})")
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: Sequence[Generation], k: int) -> Draft:
        return Draft(torch.tensor([self._continue(s.prompt + s.tokens, k) for s in seqs], dtype=torch.int64))

    def _continue(self, history: list[int], k: int) -> list[int]:
        start = self._match_end(history)
        out = list(history)
        for i in range(k):
            out.append(out[start + i])
        return out[len(history):]

    def _match_end(self, h: list[int]) -> int:
        """Index just after the latest earlier occurrence of the longest matching suffix."""
        for n in range(min(self.n_max, len(h) - 1), self.n_min - 1, -1):
            suffix = h[-n:]
            for end in range(len(h) - 1, n - 1, -1):  # occurrences ending before the last token
                if h[end - n:end] == suffix:
                    return end
        return len(h) - 1


class SyntheticDrafter:
    """A drafter accepted exactly `accept` tokens per greedy step, for benchmarks that fix the acceptance
    length (as the published K3 numbers do: 7 drafts, acceptance length 6).

    It replays a reference trajectory: the target's own greedy continuation of each prompt, generated
    beforehand without speculation (`from_greedy`). At a sequence's n-th generated token it drafts the
    reference tokens n .. n + accept - 1, then tokens that differ from the reference (reference + 1 mod
    vocab). The target still verifies every draft with the real acceptance rule, so the output is the
    target's own and the acceptance is measured, not forced (vLLM's `synthetic` rejection sampler
    instead accepts by a coin flip and emits tokens the target did not choose): where the run departs
    from the reference (bf16 rounding, sampling at temperature > 0) fewer drafts are accepted.
    """

    def __init__(self, accept: int, references: dict[tuple[int, ...], list[int]], vocab_size: int):
        if accept < 0:
            raise ValueError(f"SyntheticDrafter: accept {accept} must be >= 0")
        self.accept, self.references, self.vocab_size = accept, references, vocab_size

    @classmethod
    def from_greedy(cls, engine: Engine, prompts: list[list[int]], max_new_tokens: int, accept: int,
                    spec_tokens: int) -> "SyntheticDrafter":
        """Record the target's greedy continuation of each prompt, long enough for `max_new_tokens` more."""
        from .engine import SamplingParams

        gens = engine.generate(prompts, SamplingParams(max_new_tokens + spec_tokens))
        return cls(accept, {tuple(g.prompt): g.tokens for g in gens}, engine.model.cfg.vocab_size)

    def propose(self, seqs: Sequence[Generation], k: int) -> Draft:
        if self.accept > k:
            raise ValueError(f"SyntheticDrafter: accept {self.accept} exceeds the {k} drafts per step")
        rows = []
        for s in seqs:
            if tuple(s.prompt) not in self.references:
                raise ValueError(f"SyntheticDrafter: no reference trajectory for prompt {s.prompt[:8]}")
            ref, n = self.references[tuple(s.prompt)], len(s.tokens)
            if n + k > len(ref):
                raise ValueError(f"SyntheticDrafter: the reference trajectory ({len(ref)} tokens) ends before "
                                 f"generated token {n} + {k} drafts")
            rows.append([ref[n + i] if i < self.accept else (ref[n + i] + 1) % self.vocab_size
                         for i in range(k)])
        return Draft(torch.tensor(rows, dtype=torch.int64))
