"""A sublayer's input in one CuTe DSL launch (sm_90): the Block AttnRes mix, then the sublayer's RMSNorm, with the
partial sum's add where the layer has one. Entry point: `attn_res_norm_cute`, the signature of the reference
(model/kimi_k3/ops/attn_res_norm.py).

    >>> y = attn_res_norm_cute(sources, norm_w, proj_w, eps, out_w, out_eps)   # sources: m bf16 tensors [T, D];
    ...                                                                         # out_w [D] bf16 -> y [T, D] bf16
    >>> y, summed = attn_res_norm_cute(sources, norm_w, proj_w, eps, out_w, out_eps, addend)   # the last source
    ...                                                     # is sources[-1] + addend, returned as `summed`

The kernel is attn_res's (`AttnResNormKernel` in model/kimi_k3/specialized/attn_res/kernel.py: the same mix, then
the norm in the same CTA); this package is its entry point, envelope and compile protocol. Envelope: attn_res's
(model/kimi_k3/specialized/attn_res/__init__.py, `check_args`), out_w a contiguous bf16 [D] and the addend (if any)
a contiguous bf16 [T, D], on the sources' device, 16-byte aligned. Anything else raises ValueError before anything
is launched. T = 0 returns empty outputs without a launch.
"""

from __future__ import annotations

import torch

from kernels.cute import require_dsl

from ..attn_res import available, check_args, config_for, launch
from ..attn_res.kernel import DSL, AttnResConfig, compile_report

__all__ = ["attn_res_norm_cute", "available", "check_args", "compile", "compile_keys"]


def attn_res_norm_cute(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                       out_w: torch.Tensor, out_eps: float, addend: torch.Tensor | None = None, *,
                       config: AttnResConfig | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(attn_res(sources, norm_w, proj_w, eps), out_w, out_eps) in one launch: [T, D] bf16; with `addend`,
    (that, sources[-1] + addend) with the sum mixed as the last source."""
    require_dsl(DSL.error)
    if not isinstance(out_w, torch.Tensor):
        raise ValueError("out_w must be a tensor")
    check_args(sources, norm_w, proj_w, out_w, addend)  # attn_res's checks, out_w's and the addend's with them
    y, summed = launch(sources, norm_w, proj_w, eps, config, out_norm=(out_w, out_eps), addend=addend)
    return y if addend is None else (y, summed)


def compile_keys(contract) -> list[tuple[AttnResConfig, int, int, bool]]:
    """The gate's compile protocol: (config, m, D, addend) for every source count, hidden size and partial-sum
    form (partial_terms 2: with the addend) the contract admits (T is a runtime argument: one key serves every
    batch)."""
    keys = {(config_for(d), m, d, terms == 2) for m in contract.shapes["sources"] for d in contract.shapes["hidden"]
            for terms in contract.shapes["partial_terms"]}
    return sorted(keys, key=lambda key: (key[2], key[1], key[3]))


def compile(key: tuple[AttnResConfig, int, int, bool], target: str):  # noqa: A001 - the gate protocol's name
    """Compile the normalized mix for one (config, m, D, addend) for a target ('sm_90a', 'sm_100a') without a GPU:
    a kernels.cute.CompileReport."""
    cfg, m, d, addend = key
    return compile_report(cfg, m, d, normed=True, addend=addend, arch=target)
