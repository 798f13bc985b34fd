"""mla_decode_fp8: `mla_decode` over an FP8 latent cache (SPEC.md §4; issue 21).

    out = mla_decode_fp8(q_nope, q_pe, kv_cache, kv_scale, block_table, lengths, w_uk, w_uv, scale)  # [B, H, V] fp32

The cache holds e4m3 entries (`torch.float8_e4m3fn`, 576 B a token instead of 1152) with one fp32 scale for the
layer's whole cache, vLLM's `kv_cache_dtype="fp8"` (the scale is 1.0 unless a checkpoint or a calibration gives
one), paged as `mla_decode`'s (kv_cache [pages, P, C + R], block_table [B, max_blocks]): row t of sequence b is
`dequantize_kv(kv_cache[block_table[b, t // P], t % P], kv_scale)`; `quantize_kv` writes entries that way.

Because every e4m3 value is exact in bf16 and in f16, an implementation can convert the stored values exactly and
fold the scale in twice: into the score scale (scale * kv_scale) and into the latent (latent * kv_scale), which is
what the reference computes up to the order of fp32 products.
"""

from __future__ import annotations

import torch

from .mla_decode import absorbed_attention, check_paged, table_rows
from .mla_decode import cost as bf16_cost
from .mla_decode_standard import attention_over_rows
from .op import Op

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_kv(entries: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """Cache entries (any float dtype) as e4m3 values of entries / kv_scale, rounded to nearest and saturated at
    +-448 (e4m3fn has no infinity: an overflow would otherwise become NaN)."""
    return (entries.float() / kv_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(stored: torch.Tensor, kv_scale: float) -> torch.Tensor:
    """The fp32 values of stored e4m3 entries: each exact in fp32, times kv_scale."""
    return stored.float() * kv_scale


def mla_decode_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_scale: float,
                   block_table: torch.Tensor, lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Weight-absorbed decode attention over e4m3 entries times kv_scale; otherwise `mla_decode`'s arguments and
    result ([B, H, V] fp32)."""
    check_paged(kv_cache, block_table, lengths)
    rows, positions = table_rows(kv_cache, block_table)  # [B, max_blocks x P, C + R]
    valid = positions < lengths.unsqueeze(-1)
    return absorbed_attention(q_nope, q_pe, dequantize_kv(rows, kv_scale), valid, w_uk, w_uv, scale)


def mla_decode_fp8_standard(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_scale: float,
                            block_table: torch.Tensor, lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The GPU standard: the gathered rows converted to bf16 (exact), then `mla_decode`'s cuBLAS composition with
    kv_scale folded into the score scale and the output (which it may: the output is linear in the latent)."""
    check_paged(kv_cache, block_table, lengths)
    rows, _ = table_rows(kv_cache, block_table)  # [B, max_blocks x P, C + R]
    # every e4m3 value is exact in bf16
    return attention_over_rows(q_nope, q_pe, rows.to(w_uk.dtype), lengths, w_uk, w_uv, scale * kv_scale) * kv_scale


def signature(q_nope, q_pe, kv_cache, kv_scale, block_table, lengths, w_uk, w_uv, scale):
    return (q_nope.shape[1], w_uk.shape[-1], q_pe.shape[-1], kv_cache.shape[1]), (w_uk.dtype, kv_cache.dtype)


def cost(q_nope, q_pe, kv_cache, kv_scale, block_table, lengths, w_uk, w_uv, scale):
    """`mla_decode`'s cost model at the cache's own element size (1 byte)."""
    return bf16_cost(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale)


OP = Op("mla_decode_fp8", mla_decode_fp8, shapes=("heads", "kv_lora_rank", "rope_dim", "page_size"),
        dtypes=("weights", "kv_cache"), signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.mla_decode_fp8:mla_decode_fp8_standard",
        standard_label="the rows converted to bf16 (exact), then mla_decode's cuBLAS composition (bf16 batched "
                       "GEMMs, fp32 softmax); no library FP8 MLA decode installed here")
