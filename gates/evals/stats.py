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


def mass_bins(p_ref: torch.Tensor, bins: int) -> torch.Tensor:
    """[vocab] bin of each token, at most `bins` bins fixed by p_ref alone: tokens ranked by p_ref (most likely
    first, ties by id), cut where the mass before a token crosses a multiple of 1/bins. A heavy token is alone
    or shares its bin with lighter ones; the tail's many light tokens share a few bins.

    TV between two distributions summed into these bins (`binned`) is at most their TV, and the noise of n
    draws in it is at most 0.5 * sqrt(bins / n) (+ McDiarmid, tv_noise_bound), whatever the vocabulary: over
    a 160k vocabulary the token-level TV of a few thousand draws from the right distribution is above 0.5."""
    p = p_ref.double().cpu()
    order = torch.sort(p, descending=True, stable=True).indices
    before = p[order].cumsum(0) - p[order]
    out = torch.empty_like(order)
    out[order] = (before * bins).long().clamp(0, bins - 1)
    return out


def binned(p: torch.Tensor, bins: torch.Tensor, count: int) -> torch.Tensor:
    """p summed into the bins (`mass_bins`): a distribution over `count` bins."""
    return torch.zeros(count, dtype=torch.float64).index_add_(0, bins, p.double().cpu())


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
