"""mla_decode, STANDARD implementation on the GPU: absorbed attention as a PyTorch composition on cuBLAS.

What was tried and why this is the standard today: FlashMLA has no wheel (it builds from source with a CUDA
toolchain the runner lacks the time for); FlashInfer's MLA decode (`BatchMLAPagedAttentionWrapper`) ships as a
101 MB JIT package plus a 458 MB cubin package, over what one device call carries, and compiles its kernels on
first use. Until one of them travels in the wheelhouse, the standard is the strongest composition of library
GEMMs: bf16 batched GEMMs with fp32 accumulation (cuBLAS), fp32 scores and softmax, no fp32 copy of the cache.
Every report labels it so (Op.standard_label).

Every row the block table addresses is gathered once through the pages ([B, max_blocks x P, C + R], index ops on
the device: no host synchronisation, no loop over the batch, CUDA-graph safe), which the paged kernel does not
need: the composition reads the selected rows twice and writes them once.
"""

from __future__ import annotations

import torch

from .mla_decode import check_paged, table_rows


def mla_decode_standard(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Same signature and semantics as `mla_decode.mla_decode`; returns [B, H, V] fp32."""
    check_paged(kv_cache, block_table, lengths)
    entries, _ = table_rows(kv_cache, block_table)  # [B, max_blocks x P, C + R]
    return attention_over_rows(q_nope, q_pe, entries.to(w_uk.dtype), lengths, w_uk, w_uv, scale)


def attention_over_rows(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, lengths: torch.Tensor,
                        w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """The composition over rows already gathered per sequence, entries [B, L, C + R] in the weights' dtype (the
    FP8 cache's standard converts its rows and comes here too)."""
    c = w_uk.shape[-1]
    dtype = w_uk.dtype
    q_lat = torch.bmm(q_nope.transpose(0, 1).to(dtype), w_uk).transpose(0, 1)  # [B, H, C]
    query = torch.cat([q_lat, q_pe.to(dtype)], dim=-1)  # [B, H, C + R]
    scores = torch.bmm(query, entries.transpose(1, 2), out_dtype=torch.float32) * scale  # [B, H, L]
    valid = torch.arange(entries.shape[1], device=entries.device) < lengths.unsqueeze(-1)  # [B, L]
    probs = torch.softmax(scores.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    latent = torch.bmm(probs.to(dtype), entries[..., :c])  # [B, H, C]
    return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2), out_dtype=torch.float32).transpose(0, 1)
