"""Token selection: greedy, or temperature with nucleus (top-p) filtering, from per-sequence seeded generators."""

from __future__ import annotations

import torch


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution [B, V]: softmax(logits / T) restricted to the smallest set of tokens whose
    probability reaches top_p (the token that crosses the threshold is kept), renormalized."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def categorical(weights: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One draw per row of non-negative weights [B, V] (any positive total): the row's CDF, in float64 on the
    weights' device, inverted at one uniform from its (CPU) generator -- the same seed picks the same token on
    any device, and a zero-weight token is never picked."""
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(weights.device)
    cdf = weights.double().cumsum(-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return tokens.clamp_max(weights.shape[-1] - 1)


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of logits [B, V]; returns (tokens [B], their log-probabilities under the
    model's own distribution softmax(logits) [B])."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"sampling: temperature {temperature} must be >= 0 and top_p {top_p} in (0, 1]")
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        tokens = categorical(top_p_probs(logits, temperature, top_p), generators)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
