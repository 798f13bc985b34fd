"""MLA decode attention over an FP8 (e4m3) latent cache with one scale (SPEC.md §4; issue 21).

    out = mla_decode_fp8(q_nope, q_pe, kv_cache, kv_scale, block_table, lengths, w_uk, w_uv, scale)  # [B, H, 128] fp32

The inputs are `mla_decode`'s (gates/problems/mla_decode.py: the same shapes, page sizes, distributions, contexts,
ragged lengths, permuted pages and poisoned block-table entries) with the cache quantized as a calibrated cache is:
kv_scale is the largest magnitude among the sequences' valid entries over 448, so the entries use e4m3's whole
range. Every other row (the rest of a sequence's last page, the spare pages) holds 448 (an entry of that
magnitude), large enough that a kernel reading it into the softmax is visibly wrong.
The reference is `mla_decode`'s float64 one over the dequantized entries: the quantization is the input, not an
error, so the tolerance is the bf16 cache's.
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point
from gates.problems import mla_decode as bf16_problem
from model.kimi_k3.ops.mla_decode import page_index
from model.kimi_k3.ops.mla_decode_fp8 import E4M3_MAX, OP, quantize_kv

SHAPE_KEYS = bf16_problem.SHAPE_KEYS

check = check_tensor


def reference(q_nope, q_pe, kv_cache, kv_scale, block_table, lengths, w_uk, w_uv, scale) -> torch.Tensor:
    """The op in float64 over each sequence's valid rows, dequantized; [B, H, V] fp32."""
    return bf16_problem.reference(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale, kv_scale)


def generate_input(point: Point, seed: int, dist: str) -> Case:
    return fp8_case(bf16_problem.generate_input(point, seed, dist))


def fp8_case(case: Case) -> Case:
    """An mla_decode call's inputs over an FP8 cache: the valid rows quantized with the scale that maps their
    largest magnitude to e4m3's, every other row E4M3_MAX (the poison)."""
    q_nope, q_pe, kv, block_table, lengths, w_uk, w_uv, scale = case.args
    pages, page_size = kv.shape[:2]
    index = [page_index(block_table[i], torch.arange(int(n), device=kv.device), page_size, pages)
             for i, n in enumerate(lengths.tolist())]  # each sequence's valid rows
    amax = max(float(kv[rows].abs().max()) for rows in index)
    kv_scale = amax / E4M3_MAX if amax > 0 else 1.0
    cache = torch.full(kv.shape, E4M3_MAX, dtype=torch.float8_e4m3fn, device=kv.device)
    for rows in index:  # a sequence at a time: a 32K-token batch of 64 is 1.2 G entries
        cache[rows] = quantize_kv(kv[rows], kv_scale)
    return Case(args=(q_nope, q_pe, cache, kv_scale, block_table, lengths, w_uk, w_uv, scale))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
