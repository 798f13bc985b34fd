"""Decode context parallelism of MLA (model/kimi_k3/ops/mla_dcp.py): the round-robin partition, the partial attention
with its LSE, the exact merge (single process, any partition, fp32 and fp64), and `mla_decode_dcp` over real gloo
groups at DCP2 and DCP4 against the single-rank `mla_decode` (over the same slots: a block table of one page per
sequence, slots[:, None]), uneven lengths and sequences shorter than the rank count included."""

from __future__ import annotations

import pytest
import torch

from model.kimi_k3.distributed import run_tp
from model.kimi_k3.ops.mla_dcp import (
    dcp_local_cache,
    dcp_local_lengths,
    dcp_positions,
    merge,
    mla_decode_dcp,
    partial_attention,
)
from model.kimi_k3.ops.mla_decode import absorbed_attention, mla_decode
from model.kimi_k3.parallel import TP

HEADS, NOPE, LORA, ROPE, V_DIM = 4, 64, 512, 64, 64  # K3's latent widths (C = 512, R = 64), few small heads
SCALE = (128 + 64) ** -0.5  # K3's qk_nope + qk_rope head dim
NUM_SLOTS, MAX_LEN = 6, 15  # 15: the last rank's local cache ends in a padding row at DCP2 and DCP4
# A decode batch of uneven lengths (1, 2 and 3 are shorter than DCP4, 1 shorter than DCP2) and a verify-style
# block of three rows on one slot (lengths 11, 12, 13: token t sees its context and the block up to itself).
SLOTS = [4, 0, 5, 2, 1, 1, 1]
LENGTHS = [1, 2, 3, 7, 11, 12, 13]
TIMEOUT_S = 120  # a broken collective fails the test instead of hanging it
# fp32 against fp32: the split form sums the same terms in another order (per-rank softmax sums, the merge's
# rescaling by exp(lse_r - lse), one division more), so each latent element differs from the reference by a few
# fp32 ulps (~1e-7 relative) and W_UV's 512-term contraction carries that to the output: measured max |diff|
# 1.1e-6 to 1.9e-6 on outputs up to ~3 (~6e-7 of the largest), at most 17% of the bound below over 30 seeds at
# DCP2/3/4. The absolute part covers outputs near 0, where the W_UV contraction cancels and a relative bound
# alone means nothing. A wrong partition (a token lost or counted twice) moves the output by O(1 / length),
# > 1e3 x ATOL (test_a_lost_partial_is_caught).
RTOL, ATOL = 1e-5, 1e-5


def inputs(seed: int, tokens: int, dtype: torch.dtype = torch.float32):
    """q_nope [T, H, N], q_pe [T, H, R], kv_cache [slots, L, C + R], w_uk [H, N, C], w_uv [H, V, C]: scores of
    O(1) spread, so the softmax is neither flat nor one-hot."""
    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=gen, dtype=dtype)
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=gen, dtype=dtype)
    kv = torch.randn(NUM_SLOTS, MAX_LEN, LORA + ROPE, generator=gen, dtype=dtype)
    w_uk = torch.randn(HEADS, NOPE, LORA, generator=gen, dtype=dtype) * NOPE**-0.5
    w_uv = torch.randn(HEADS, V_DIM, LORA, generator=gen, dtype=dtype) * LORA**-0.5
    return q_nope, q_pe, kv, w_uk, w_uv


def reference_fp64(q_nope, q_pe, entries, valid, w_uk, w_uv, scale):
    """absorbed_attention's math in fp64 (absorbed_attention itself computes in fp32)."""
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    scores = torch.cat([q_lat, q_pe], dim=-1) @ entries.transpose(-1, -2) * scale
    probs = torch.softmax(scores.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    return torch.einsum("thc,hvc->thv", probs @ entries[..., :LORA], w_uv)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_partition_covers_each_position_once(size):
    kv = torch.arange(NUM_SLOTS * MAX_LEN * 2, dtype=torch.float32).view(NUM_SLOTS, MAX_LEN, 2)
    lengths = torch.arange(MAX_LEN + 1)
    for length in range(MAX_LEN + 1):
        held = [dcp_positions(length, r, size) for r in range(size)]
        assert sorted(torch.cat(held).tolist()) == list(range(length))  # each position once, none missing
        for r, positions in enumerate(held):
            assert (positions % size == r).all()
            assert positions.tolist() == [j * size + r for j in range(len(positions))]  # local j = j * size + r
            assert int(dcp_local_lengths(lengths, r, size)[length]) == len(positions)
    for r in range(size):
        local = dcp_local_cache(kv, r, size)
        assert local.shape == (NUM_SLOTS, -(-MAX_LEN // size), 2)
        positions = dcp_positions(MAX_LEN, r, size)
        assert torch.equal(local[:, :len(positions)], kv[:, positions])
        assert not local[:, len(positions):].any()  # padding rows


def _split(entries, valid, parts):
    """Each part's compact entries [T, n_p, W] and valid [T, n_p] for position lists `parts`."""
    return [(entries[:, idx], valid[:, idx]) for idx in parts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("how", ["round_robin", "random", "contiguous"])
def test_merge_of_any_partition_equals_full_attention(dtype, how):
    """Partials over any disjoint cover of the positions (one part empty, and parts with no valid entry for the
    short sequences) merge to attention over all of them."""
    tokens = len(LENGTHS)
    q_nope, q_pe, kv, w_uk, w_uv = inputs(7, tokens, dtype)
    entries = kv[SLOTS]
    valid = torch.arange(MAX_LEN) < torch.tensor(LENGTHS).unsqueeze(-1)
    gen = torch.Generator().manual_seed(3)
    if how == "round_robin":
        parts = [dcp_positions(MAX_LEN, r, 4) for r in range(4)] + [torch.arange(0)]
    elif how == "random":
        owner = torch.randint(0, 4, (MAX_LEN,), generator=gen)  # part 4 stays empty
        parts = [(owner == p).nonzero().flatten() for p in range(5)]
    else:
        parts = [torch.arange(0, 2), torch.arange(0), torch.arange(2, 9), torch.arange(9, MAX_LEN)]
    assert sorted(torch.cat(parts).tolist()) == list(range(MAX_LEN))
    partials = [partial_attention(q_nope, q_pe, e, v, w_uk, SCALE) for e, v in _split(entries, valid, parts)]
    assert any(int(v.sum()) == 0 for _, v in _split(entries, valid, parts))  # some part sees nothing
    latent, lse = merge([o for o, _ in partials], [s for _, s in partials])
    assert latent.dtype == dtype and torch.isfinite(latent).all() and torch.isfinite(lse).all()
    got = torch.einsum("thc,hvc->thv", latent, w_uv)
    if dtype == torch.float64:
        torch.testing.assert_close(got, reference_fp64(q_nope, q_pe, entries, valid, w_uk, w_uv, SCALE),
                                   rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(got, absorbed_attention(q_nope, q_pe, entries, valid, w_uk, w_uv, SCALE),
                                   rtol=RTOL, atol=ATOL)
    # The merged lse is the log-sum-exp of every valid score.
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    scores = (torch.cat([q_lat, q_pe], dim=-1) @ entries.transpose(-1, -2) * SCALE)
    full_lse = scores.masked_fill(~valid.unsqueeze(1), float("-inf")).logsumexp(dim=-1)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(lse, full_lse, rtol=tol, atol=tol)


def test_a_rank_with_nothing_contributes_minus_inf_and_no_nan():
    q_nope, q_pe, kv, w_uk, _ = inputs(1, 3)
    entries = kv[:3, :4]
    nothing = torch.zeros(3, 4, dtype=torch.bool)
    latent, lse = partial_attention(q_nope, q_pe, entries, nothing, w_uk, SCALE)
    assert torch.equal(lse, torch.full((3, HEADS), float("-inf"))) and not latent.any()
    latent0, lse0 = partial_attention(q_nope, q_pe, entries[:, :0], nothing[:, :0], w_uk, SCALE)  # no rows at all
    assert torch.equal(lse0, lse) and not latent0.any()
    some = torch.arange(4) < torch.tensor([1, 2, 4]).unsqueeze(-1)
    own = partial_attention(q_nope, q_pe, entries, some, w_uk, SCALE)
    merged = merge([own[0], latent, latent0], [own[1], lse, lse0])
    assert torch.equal(merged[0], own[0]) and torch.equal(merged[1], own[1])  # weight exactly 0: the same bits
    empty = merge([latent, latent0], [lse, lse0])  # an empty sequence (never in decode): 0 and -inf, not NaN
    assert not empty[0].any() and torch.equal(empty[1], lse)


def test_a_lost_partial_is_caught():
    """The tolerance tells a wrong partition from rounding: dropping one rank's partial misses by far more."""
    q_nope, q_pe, kv, w_uk, w_uv = inputs(5, len(LENGTHS))
    entries = kv[SLOTS]
    valid = torch.arange(MAX_LEN) < torch.tensor(LENGTHS).unsqueeze(-1)
    parts = [dcp_positions(MAX_LEN, r, 2) for r in range(2)]
    partials = [partial_attention(q_nope, q_pe, e, v, w_uk, SCALE) for e, v in _split(entries, valid, parts)]
    latent, _ = merge([partials[0][0]], [partials[0][1]])
    got = torch.einsum("thc,hvc->thv", latent, w_uv)
    ref = absorbed_attention(q_nope, q_pe, entries, valid, w_uk, w_uv, SCALE)
    long_rows = torch.tensor(LENGTHS) > 1
    assert (got - ref)[long_rows].abs().amax() > 1e3 * ATOL


def test_single_rank_equals_mla_decode():
    q_nope, q_pe, kv, w_uk, w_uv = inputs(2, len(LENGTHS))
    slots, lengths = torch.tensor(SLOTS), torch.tensor(LENGTHS)
    got = mla_decode_dcp(q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, SCALE, TP())
    torch.testing.assert_close(got, mla_decode(q_nope, q_pe, kv, slots[:, None], lengths, w_uk, w_uv, SCALE),
                               rtol=RTOL, atol=ATOL)


def _rank(tp: TP, device, q_nope, q_pe, kv, slots, lengths, w_uk, w_uv):
    local = dcp_local_cache(kv, tp.rank, tp.size)
    out = mla_decode_dcp(q_nope, q_pe, local, slots, dcp_local_lengths(lengths, tp.rank, tp.size), w_uk, w_uv,
                         SCALE, tp)
    everyone = [torch.empty_like(out) for _ in range(tp.size)]
    torch.distributed.all_gather(everyone, out, group=tp.group)
    return out, all(torch.equal(e, out) for e in everyone)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_dcp_matches_single_rank(size, cache_dtype):
    q_nope, q_pe, kv, w_uk, w_uv = inputs(size, len(LENGTHS))
    kv = kv.to(cache_dtype)  # both forms read the cache as fp32
    slots, lengths = torch.tensor(SLOTS), torch.tensor(LENGTHS)
    out, same_on_every_rank = run_tp(_rank, size, q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, timeout=TIMEOUT_S)
    assert same_on_every_rank
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, mla_decode(q_nope, q_pe, kv, slots[:, None], lengths, w_uk, w_uv, SCALE),
                               rtol=RTOL, atol=ATOL)


def test_refusals():
    with pytest.raises(ValueError, match="outside"):
        dcp_positions(5, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        dcp_local_lengths(torch.tensor([3]), -1, 2)
    with pytest.raises(ValueError, match="outside"):
        dcp_local_cache(torch.zeros(1, 4, 2), 4, 4)
