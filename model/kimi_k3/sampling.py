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


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of logits [B, V]; returns (tokens [B], their log-probabilities under the
    model's own distribution softmax(logits) [B])."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"sampling: temperature {temperature} must be >= 0 and top_p {top_p} in (0, 1]")
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        probs = top_p_probs(logits, temperature, top_p).cpu()  # CPU generators: same seed, same token anywhere
        tokens = torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)]).to(logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
