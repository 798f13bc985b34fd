"""The statistics behind the sampling eval: distances are right, and each noise bound holds for draws from
the distribution itself while a temperature change exceeds it."""

from __future__ import annotations

import math

import pytest
import torch

from gates.evals.stats import (
    binned,
    dkw_bound,
    empirical,
    kl_divergence,
    mass_bins,
    rank_cdf_distance,
    tv_distance,
    tv_noise_bound,
)


def softmax(logits, scale=1.0):
    return torch.softmax(logits.double() * scale, -1)


@pytest.fixture()
def logits():
    return torch.randn(512, generator=torch.Generator().manual_seed(0)) * 2  # the tiny model's logit spread


def test_distances_by_hand():
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.5, 0.25])
    assert tv_distance(p, q).item() == pytest.approx(0.25)
    assert rank_cdf_distance(q, p) == pytest.approx(0.25)  # ranked by p: the first token loses 0.25
    a, b = torch.tensor([0.0, math.log(3.0)]), torch.tensor([0.0, 0.0])  # softmax (1/4, 3/4) vs (1/2, 1/2)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_divergence(a, b).item() == pytest.approx(expected)
    assert kl_divergence(a, a).item() == 0 and tv_distance(p, p).item() == 0


def test_ks_is_at_most_tv_and_equals_it_for_a_temperature_change(logits):
    p = softmax(logits)
    rng = torch.Generator().manual_seed(1)
    for _ in range(20):
        q = softmax(logits + torch.randn(512, generator=rng))
        assert rank_cdf_distance(q, p) <= tv_distance(p, q).item() + 1e-12
    hotter = softmax(logits, 1.05)  # mass moves from every tail token to every head token: one crossing
    assert rank_cdf_distance(hotter, p) == pytest.approx(tv_distance(p, hotter).item())


@pytest.mark.parametrize("n", [1024, 16384])
def test_noise_bounds_hold_for_draws_from_p(logits, n):
    p, delta, trials = softmax(logits, 0.6), 1e-3, 100
    gen = torch.Generator().manual_seed(n)
    tv_bound, ks_bound = tv_noise_bound(p, n, delta), dkw_bound(n, delta)
    worst_tv = worst_ks = 0.0
    for _ in range(trials):
        q = empirical(torch.multinomial(p.float(), n, replacement=True, generator=gen), 512)
        worst_tv, worst_ks = max(worst_tv, tv_distance(q, p).item()), max(worst_ks, rank_cdf_distance(q, p))
    assert worst_tv <= tv_bound and worst_ks <= ks_bound
    assert worst_tv > tv_bound / 4 and worst_ks > ks_bound / 8  # the bounds are not vacuous


def test_ks_bound_sees_a_temperature_change_the_tv_bound_hides(logits):
    """At 16384 draws the 1.05 scale (TV ~0.04) is far inside the token-level TV noise floor of a 512-token
    vocabulary but well outside the rank-CDF (DKW) bound: why the sampling eval checks both."""
    p, n = softmax(logits), 16384
    q = empirical(torch.multinomial(softmax(logits, 1.05).float(), n, replacement=True,
                                    generator=torch.Generator().manual_seed(0)), 512)
    assert tv_distance(q, p).item() < tv_noise_bound(p, n, 1e-6)
    assert rank_cdf_distance(q, p) > dkw_bound(n, 1e-6)


def test_bins_of_the_reference_mass():
    """A fixed partition by the reference's mass: at most `bins` bins, a bin per tenth of the mass here, and a TV
    over them that is at most the token-level TV while the noise of many draws over a large vocabulary stays
    small (the token-level noise bound of the same draws is above 1)."""
    gen = torch.Generator().manual_seed(0)
    p = softmax(torch.randn(160_000, generator=gen))
    bins = mass_bins(p, 10)
    assert bins.unique().tolist() == list(range(10))
    assert torch.allclose(binned(p, bins, 10), torch.full((10,), 0.1, dtype=torch.float64), atol=1e-3)
    q = softmax(torch.randn(160_000, generator=gen))
    assert tv_distance(binned(q, bins, 10), binned(p, bins, 10)) <= tv_distance(q, p)
    n = 4096
    assert tv_noise_bound(p, n, 1e-6) > 1 > 0.2 > tv_noise_bound(binned(p, bins, 10), n, 1e-6)
    heavy = torch.tensor([0.7, 0.1, 0.1, 0.05, 0.05])
    assert mass_bins(heavy, 4).tolist() == [0, 2, 3, 3, 3]  # mass before each: 0, .7, .8, .9, .95
