"""K3's MLA decode attention over an FP8 (e4m3) latent cache, the attention core in CuTe DSL (sm_90). Entry point:
`mla_decode_fp8_cute`, the signature of the reference (model/kimi_k3/ops/mla_decode_fp8.py).

    >>> out = mla_decode_fp8_cute(q_nope, q_pe, kv_cache, kv_scale, block_table, lengths, w_uk, w_uv, scale)
    ... # kv_cache [pages, P, C + R] float8_e4m3fn, kv_scale a positive Python number; the rest (the block table
    ... # and its paging included) as mla_decode_cute

The kernel is mla_decode's (model/kimi_k3/specialized/mla_decode/kernel.py) with MlaConfig(cache="e4m3"): the rows
arrive at one byte an element, are converted exactly to f16 in the shared tile and meet the query and P in f16 MMAs.
kv_scale never touches the tile: it multiplies the score scale (softmax(scale q . kv_scale e) = softmax((scale
kv_scale) q . e)) and the output (linear in the latent). The envelope is mla_decode_cute's with an e4m3 cache.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from kernels.cute import require_dsl

from ..mla_decode import MlaConfig, absorbed_attention, available, check_args, compile
from ..mla_decode import config_for as bf16_config_for
from ..mla_decode.kernel import DSL

__all__ = ["available", "compile", "compile_keys", "config_for", "mla_decode_fp8_cute"]


@functools.cache
def config_for(heads: int) -> MlaConfig:
    """mla_decode's config at this head count, reading an e4m3 cache."""
    return dataclasses.replace(bf16_config_for(heads), cache="e4m3")


def mla_decode_fp8_cute(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_scale: float,
                        block_table: torch.Tensor, lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                        scale: float, *, config: MlaConfig | None = None) -> torch.Tensor:
    """The reference's result, out [B, H, V] fp32 (mla_decode_cute's launches over the e4m3 cache). `config`
    overrides the heuristic (an e4m3 one). Raises ValueError before launching anything on input outside the
    envelope."""
    require_dsl(DSL.error)
    if not isinstance(kv_scale, (int, float)) or not (math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale must be a positive finite Python number, got {kv_scale!r}")
    if config is not None and config.cache != "e4m3":
        raise ValueError(f"config {config}: an e4m3 cache needs cache='e4m3'")
    b, h, _, c, r, v, _ = check_args(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale,
                                     kv_dtype=torch.float8_e4m3fn)
    if b == 0:
        return torch.empty(0, h, v, dtype=torch.float32, device=q_nope.device)
    cfg = config or config_for(h)
    cfg.check(h, c, r)
    return absorbed_attention(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale * kv_scale, cfg,
                              out_scale=kv_scale)


def compile_keys(contract) -> list[tuple[MlaConfig, int, int, int]]:
    """The gate's compile protocol: the (config, H, C, R) the entry point compiles at every head count / latent / rope
    dim the contract admits (`compile` is mla_decode's)."""
    keys = {(config_for(h), h, c, r) for h in contract.shapes["heads"] for c in contract.shapes["kv_lora_rank"]
            for r in contract.shapes["rope_dim"]}
    return sorted(keys, key=lambda key: (key[1], key[2], key[3]))
