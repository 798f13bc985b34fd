"""mla_decode: weight-absorbed MLA attention over the latent cache, one query token per cache row (SPEC.md §4).

    out = mla_decode(q_nope, q_pe, kv_cache, slots, lengths, w_uk, w_uv, scale)       # [B, H, V] fp32

`absorbed_attention` is the math decode and the layer's prefill share.
"""

from __future__ import annotations

import torch

from .op import Cost, Op, nbytes


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor,
                       w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention in the latent space: q_nope [T, H, N] through W_UK [H, N, C] and q_pe [T, H, R] score the cached
    [c_kv | k_pe] entries, [T, L, C + R] (one sequence per query) or [L, C + R] (one sequence shared by every
    query: a single GEMM); query t sees the entries where valid [T, L]; values are the entries' c_kv through
    W_UV [H, V, C]. Returns [T, H, V] fp32. Equals materialized attention with k_nope = W_UK c_kv and
    v = W_UV c_kv (tests/model/test_layers.py)."""
    c = w_uk.shape[-1]
    q_lat = torch.einsum("thn,hnc->thc", q_nope.float(), w_uk.float())
    query = torch.cat([q_lat, q_pe.float()], dim=-1)  # [T, H, C + R]
    scores = query @ entries.transpose(-1, -2) * scale  # [T, H, L]
    probs = torch.softmax(scores.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    latent = probs @ entries[..., :c]  # [T, H, C]
    return torch.einsum("thc,hvc->thv", latent, w_uv.float())


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
               lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Weight-absorbed decode attention, one query token per sequence.

    q_nope [B, H, N], q_pe [B, H, R]; kv_cache [slots, L, C + R] ([c_kv | k_pe]); lengths [B] valid
    entries (the current token included); w_uk [H, N, C] maps c_kv to k_nope, w_uv [H, V, C] to v.
    Returns [B, H, V] fp32.
    """
    entries = kv_cache[slots].float()  # [B, L, C + R]
    valid = torch.arange(entries.shape[1], device=entries.device) < lengths.unsqueeze(-1)  # [B, L]
    return absorbed_attention(q_nope, q_pe, entries, valid, w_uk, w_uv, scale)


def signature(q_nope, q_pe, kv_cache, slots, lengths, w_uk, w_uv, scale):
    return (q_nope.shape[1], w_uk.shape[-1], q_pe.shape[-1]), (w_uk.dtype, kv_cache.dtype)


def cost(q_nope, q_pe, kv_cache, slots, lengths, w_uk, w_uv, scale):
    """The valid cache rows of every query (read on the host: planning and reporting only), the absorbed weights,
    the queries and the fp32 output."""
    rows = int(lengths.sum())
    t, h, c = q_nope.shape[0], q_nope.shape[1], w_uk.shape[-1]
    width = kv_cache.shape[-1]
    return Cost(bytes=rows * width * kv_cache.element_size() + nbytes(q_nope, q_pe, w_uk, w_uv, slots, lengths)
                + t * h * w_uv.shape[1] * 4,
                flops=2 * h * (t * q_nope.shape[2] * c + rows * (width + c) + t * c * w_uv.shape[1]))


OP = Op("mla_decode", mla_decode, shapes=("heads", "kv_lora_rank", "rope_dim"), dtypes=("weights", "kv_cache"),
        signature_of=signature, cost_of=cost, gpu_standard="model.kimi_k3.ops.mla_decode_standard:mla_decode_standard",
        standard_label="PyTorch composition on cuBLAS (bf16 batched GEMMs, fp32 softmax); no library MLA decode "
                       "installed here (mla_decode_standard.py says what was tried)")
