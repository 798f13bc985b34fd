"""Distances between token distributions, and how far sampling noise alone can push them.

Each bound holds with probability at least 1 - delta for n independent draws from the distribution, so an
eval that compares empirical samples with such a bound fails a correct sampler with probability <= delta.
Computed in float64: KL and TV of close distributions are differences of nearly equal numbers.
"""

from __future__ import annotations

import math

import torch


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total-variation distance 0.5 * sum |p - q| over the last dim."""
    return 0.5 * (p.double() - q.double()).abs().sum(-1)


def kl_divergence(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(cand)) over the last dim: the candidate's log-loss excess on the
    reference's own distribution."""
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(cand_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The empirical distribution [vocab] of sampled token ids."""
    return torch.bincount(tokens.flatten().cpu(), minlength=vocab).double() / tokens.numel()


def tv_noise_bound(p: torch.Tensor, n: int, delta: float) -> float:
    """A bound on TV(empirical of n draws from p, p) that holds with probability >= 1 - delta.

    E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / n) (Jensen, token by token); one draw moves the empirical TV by at
    most 1/n, so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2).
    """
    p = p.double().cpu()
    expected = 0.5 * torch.sqrt(p * (1 - p) / n).sum().item()
    return expected + math.sqrt(math.log(1 / delta) / (2 * n))


def rank_cdf_distance(q: torch.Tensor, p_ref: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between q and p_ref over tokens ranked by p_ref (most likely first, ties
    by id): the largest gap in the mass the two give the k most likely tokens. It is at most TV(q, p_ref),
    and it concentrates far faster than the empirical TV over a large vocabulary, so it sees a changed
    temperature (mass moved between head and tail) that the TV noise floor would hide."""
    order = torch.sort(p_ref.double().cpu(), descending=True, stable=True).indices
    gap = q.double().cpu()[order].cumsum(0) - p_ref.double().cpu()[order].cumsum(0)
    return gap.abs().max().item()


def dkw_bound(n: int, delta: float) -> float:
    """A bound on the KS distance between the empirical CDF of n draws and the true CDF, in any fixed order,
    that holds with probability >= 1 - delta (Dvoretzky-Kiefer-Wolfowitz with Massart's constant)."""
    return math.sqrt(math.log(2 / delta) / (2 * n))
