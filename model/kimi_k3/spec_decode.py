"""Acceptance of speculative drafts (SPEC.md §8): which of K drafted tokens the target keeps, and its own token.

The target has scored 1 + K positions per sequence: position i holds its distribution for the token
that follows draft i (position 0 follows the last sampled token). Both rules return `tokens` [B, 1 + K]
int64: row b holds the accepted drafts, then the target's own token (the correction at the first
rejection, or a bonus token when all K are accepted), then -1. The number of tokens a row emits is
1 + its accepted drafts, which is also how many verified tokens the caches keep (ModelCache.commit).
"""

from __future__ import annotations

import torch

from .sampling import categorical

REJECTED = -1


def greedy_accept(target_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Temperature 0: keep the longest prefix of drafts [B, K] equal to the target's argmax over
    target_logits [B, 1 + K, V], then emit the target's argmax at the first mismatch."""
    best = target_logits.argmax(-1)
    accepted = (drafts == best[:, :-1]).long().cumprod(-1).sum(-1)
    return _emitted(best, accepted)


def rejection_sample(target_probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     generators: list[torch.Generator]) -> torch.Tensor:
    """Temperature > 0: speculative rejection sampling, so every emitted token is distributed exactly as
    the target's sampling distribution given the tokens before it.

    target_probs [B, 1 + K, V] (temperature and top-p applied); drafts [B, K]; draft_probs [B, K, V] the
    drafter's distribution q, or None for a deterministic drafter (q one-hot on its draft). Draft i is
    accepted with probability min(1, p(x)/q(x)) -- p(x) for a one-hot q --; at the first rejection the
    target's token is drawn from norm(max(p - q, 0)), after K acceptances from p of the last position.
    Row b draws K uniforms and one categorical from generators[b] (CPU generators, as `sample` uses).
    """
    b, k = drafts.shape
    p = target_probs[:, :k]
    p_draft = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p.scatter(-1, drafts.unsqueeze(-1), 0.0)  # max(p - onehot(x), 0)
    else:
        q_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        residual = (p - draft_probs).clamp_min(0.0)
    uniforms = torch.stack([torch.rand(k, generator=g) for g in generators]).to(p.device)
    accept = uniforms * q_draft < p_draft  # u < p/q without dividing by q
    accepted = accept.long().cumprod(-1).sum(-1)
    rows = torch.arange(b, device=p.device)
    final = torch.cat([residual, target_probs[:, k:]], dim=1)[rows, accepted]  # [B, V], unnormalized
    # p <= q everywhere means p == q, where nothing is rejected; rounding can still leave a zero residual
    final = torch.where(final.sum(-1, keepdim=True) > 0, final, target_probs[rows, accepted])
    own = categorical(final, generators)
    tokens = torch.cat([drafts, own.unsqueeze(-1)], dim=-1)
    tokens[rows, accepted] = own
    return _emitted(tokens, accepted)


def _emitted(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """tokens [B, 1 + K] with every position after the row's own token (index `accepted`) set to -1."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(positions > accepted.unsqueeze(-1), REJECTED)
