"""Decode context parallelism (DCP) of MLA attention (issue 21, item 3): the latent cache split over c ranks by token.

    out = mla_decode_dcp(q_nope, q_pe, local_kv_cache, slots, local_lengths, w_uk, w_uv, scale, dcp)  # [B, H, V]

Partition. Token position p of a sequence lives on rank p % c (c = dcp.size): rank r keeps positions r, r + c,
r + 2c, ... at local indices 0, 1, 2, ... (local index j is global position j c + r). Of a sequence of length n,
rank r holds ceil((n - r) / c) entries (0 when n <= r): lengths differ by at most one across ranks, and a
sequence shorter than c leaves ranks n..c-1 without any entry. `dcp_positions`, `dcp_local_lengths` and
`dcp_local_cache` (a rank's rows of a full cache: tests, and the layout a DCP cache would keep) say this.

Partial attention. Over its own entries E_r a rank computes, per query and head, the scores s_i (the same
absorbed scores as `mla_decode`: q_nope through W_UK against c_kv, plus q_pe against k_pe, times scale), their
log-sum-exp lse_r = log sum_{i in E_r} exp(s_i), and the normalized latent output
o_r = sum_{i in E_r} exp(s_i - lse_r) c_kv_i ([C] = kv_lora_rank), all in fp32 (`partial_attention`).

Merge. With lse = log sum_r exp(lse_r) (the log-sum-exp over every entry of the sequence),
    sum_r exp(lse_r - lse) o_r = sum_r sum_{i in E_r} exp(s_i - lse) c_kv_i = sum_i softmax(s)_i c_kv_i,
the full attention's latent output: the merge is exact in real arithmetic for any partition of the positions
into disjoint sets, round-robin or not; in floating point only the summation order differs from `mla_decode`.
`merge` subtracts the largest lse_r before exponentiating (each weight is then <= 1, at least one is 1). The
merge happens in the latent space (C = 512) before W_UV: out = W_UV o is linear in o, so projecting after the
merge equals merging projected outputs (the merge weights sum to 1). Each rank projects once either way; the
latent form ships C + 1 = 513 floats per head where projecting first would ship V + 1 = 129 (K3), in exchange
for keeping the split where an absorbed decode kernel's output ends (the latent) and W_UV after the merge,
where it can fuse with it. A rank sends its [B, H, C] partial and [B, H] lse in one all-gather of a
[B, H, C + 1] fp32 tensor; every rank merges the same gathered tensor in rank order, so every rank returns the
same bits.

The -inf rule. A rank with no valid entry for a query (a sequence shorter than c) reports lse_r = -inf and
o_r = 0, computed without a 0 / 0 or an exp(-inf - -inf): its merge weight exp(-inf - lse) is exactly 0. A
query whose every lse_r is -inf (an empty sequence, which decode never has: the current token is always
cached) merges to lse = -inf and output 0, not NaN.

Not wired into the model yet: `KimiK3MLA` still replicates the whole latent cache on every TP rank and calls
`mla_decode`; a DCP cache layout, the layer's call (and how the DCP group composes with the head-split TP
group), a GPU decode kernel that returns the LSE and the multi-GPU run are left (NOTES_TP.md).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..parallel import TP


def dcp_positions(length: int, rank: int, size: int) -> torch.Tensor:
    """The global token positions of a sequence of `length` tokens that rank `rank` of `size` holds, in local order
    (local index j is position j * size + rank)."""
    if not 0 <= rank < size:
        raise ValueError(f"dcp rank {rank} outside 0..{size - 1}")
    return torch.arange(rank, max(rank, length), size)


def dcp_local_lengths(lengths: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """How many of each sequence's first `lengths` positions rank `rank` of `size` holds: ceil((n - rank) / size),
    0 when n <= rank."""
    if not 0 <= rank < size:
        raise ValueError(f"dcp rank {rank} outside 0..{size - 1}")
    return (lengths - rank + size - 1).div(size, rounding_mode="floor").clamp_min(0)


def dcp_local_cache(kv_cache: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a full cache [slots, L, W]: [slots, ceil(L / size), W], local row j = global row
    j * size + rank (zeros past the last row the rank holds: every rank's local cache has the same shape)."""
    if not 0 <= rank < size:
        raise ValueError(f"dcp rank {rank} outside 0..{size - 1}")
    held = kv_cache[:, rank::size]
    local = kv_cache.new_zeros(kv_cache.shape[0], -(-kv_cache.shape[1] // size), *kv_cache.shape[2:])
    local[:, :held.shape[1]] = held
    return local


def _compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """fp64 when any input is fp64 (exactness tests), else fp32."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def partial_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, local_entries: torch.Tensor,
                      local_valid: torch.Tensor, w_uk: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q_nope [T, H, N] (through W_UK [H, N, C]) and q_pe [T, H, R] over this rank's entries
    [T, L, C + R] (or [L, C + R] shared by every query), query t seeing those where local_valid [T, L].

    Returns (latent [T, H, C], lse [T, H]) in fp32 (fp64 for fp64 inputs): the softmax-normalized latent output
    over the valid entries and the log-sum-exp of their scores; lse = -inf and latent = 0 where a query has no
    valid entry (never NaN)."""
    dtype = _compute_dtype(q_nope, q_pe, local_entries, w_uk)
    c = w_uk.shape[-1]
    entries = local_entries.to(dtype)
    q_lat = torch.einsum("thn,hnc->thc", q_nope.to(dtype), w_uk.to(dtype))
    query = torch.cat([q_lat, q_pe.to(dtype)], dim=-1)  # [T, H, C + R]
    t, h = query.shape[:2]
    if entries.shape[-2] == 0:  # no local rows at all (a cache shorter than the rank count)
        return query.new_zeros(t, h, c), query.new_full((t, h), float("-inf"))
    scores = (query @ entries.transpose(-1, -2) * scale).masked_fill(~local_valid.unsqueeze(1), float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # [T, H, 1], -inf where no entry is valid
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)  # exactly 0 at the masked entries
    total = weights.sum(dim=-1, keepdim=True)  # 0 where no entry is valid, >= 1 elsewhere
    latent = (weights @ entries[..., :c]) / torch.where(total > 0, total, torch.ones_like(total))
    return latent, (top + torch.log(total)).squeeze(-1)


def merge(outs: torch.Tensor | Sequence[torch.Tensor],
          lses: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of normalized partials outs [P, T, H, C] (or a list of P [T, H, C]) with their lses
    [P, T, H] (or a list): (sum_p exp(lse_p - lse) out_p, lse = logsumexp_p lse_p), in the partials' dtype (at
    least fp32). A partial with lse -inf weighs exactly 0; a query whose every lse is -inf merges to 0, -inf."""
    outs = torch.stack(list(outs)) if not isinstance(outs, torch.Tensor) else outs
    lses = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    dtype = _compute_dtype(outs, lses)
    outs, lses = outs.to(dtype), lses.to(dtype)
    top = lses.amax(dim=0)  # [T, H]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - top)  # [P, T, H], each <= 1, the largest == 1
    total = weights.sum(dim=0)  # >= 1 unless every partial is empty
    divisor = torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    merged = (weights.unsqueeze(-1) * outs).sum(dim=0) / divisor
    return merged, top + torch.log(total)


def mla_decode_dcp(q_nope: torch.Tensor, q_pe: torch.Tensor, local_kv_cache: torch.Tensor, slots: torch.Tensor,
                   local_lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                   dcp: TP) -> torch.Tensor:
    """`mla_decode` over a cache split by token across the ranks of `dcp` (position p on rank p % dcp.size).

    local_kv_cache [slots, L_local, C + R] holds this rank's entries (`dcp_local_cache`), local_lengths [B] how
    many are valid for each query (`dcp_local_lengths` of the global lengths). Partial attention, one all-gather
    of (latent partial, lse), the exact merge, then W_UV: [B, H, V] fp32 (fp64 for fp64 inputs), the same on every
    rank."""
    entries = local_kv_cache[slots]  # [B, L_local, C + R]
    valid = torch.arange(entries.shape[1], device=entries.device) < local_lengths.unsqueeze(-1)  # [B, L_local]
    latent, lse = partial_attention(q_nope, q_pe, entries, valid, w_uk, scale)
    mine = torch.cat([latent, lse.unsqueeze(-1)], dim=-1).contiguous()  # [B, H, C + 1]
    if dcp.size > 1:
        parts = [torch.empty_like(mine) for _ in range(dcp.size)]
        dist.all_gather(parts, mine, group=dcp.group)
        gathered = torch.stack(parts)  # [P, B, H, C + 1], rank order
    else:
        gathered = mine.unsqueeze(0)
    merged, _ = merge(gathered[..., :-1], gathered[..., -1])
    return torch.einsum("thc,hvc->thv", merged, w_uv.to(merged.dtype))
