"""A sublayer's input in one CuTe DSL launch (sm_90): the Block AttnRes mix, then the sublayer's RMSNorm. Entry point:
`attn_res_norm_cute`, the signature of the reference (model/kimi_k3/ops/attn_res_norm.py).

    >>> y = attn_res_norm_cute(sources, norm_w, proj_w, eps, out_w, out_eps)   # sources: m bf16 tensors [T, D];
    ...                                                                         # out_w [D] bf16 -> y [T, D] bf16

The kernel is attn_res's (`AttnResNormKernel` in model/kimi_k3/specialized/attn_res/kernel.py: the same mix, then
the norm in the same CTA); this package is its entry point, envelope and compile protocol. Envelope: attn_res's
(model/kimi_k3/specialized/attn_res/__init__.py, `check_args`), and out_w a contiguous bf16 [D] on the sources'
device, 16-byte aligned. Anything else raises ValueError before anything is launched. T = 0 returns an empty output
without a launch.
"""

from __future__ import annotations

import torch

from kernels.cute import CompileCache, current_cute_arch, require_dsl

from ..attn_res import available, check_args, compile_keys, config_for
from ..attn_res.kernel import DSL, AttnResConfig, compile_kernel, compile_report, launch_args

__all__ = ["attn_res_norm_cute", "available", "check_args", "compile", "compile_keys", "prepare"]

_CACHE = CompileCache("attn_res_norm", module="model.kimi_k3.specialized.attn_res.kernel")


def _compiled(cfg: AttnResConfig, m: int, d: int):
    return _CACHE.get((cfg, m, d, current_cute_arch()), lambda: compile_kernel(cfg, m, d, normed=True))


def prepare(m: int, d: int) -> AttnResConfig:
    """Compile (once per process) the kernel a call of m sources of D runs, without launching it; return its
    config: for warming up outside CUDA-graph capture and timed regions."""
    cfg = config_for(d)
    _compiled(cfg, m, d)
    return cfg


def attn_res_norm_cute(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                       out_w: torch.Tensor, out_eps: float, *, config: AttnResConfig | None = None) -> torch.Tensor:
    """rms_norm(attn_res(sources, norm_w, proj_w, eps), out_w, out_eps) in one launch: [T, D] bf16."""
    require_dsl(DSL.error)
    if not isinstance(out_w, torch.Tensor):
        raise ValueError("out_w must be a tensor")
    m, t, d = check_args(sources, norm_w, proj_w, out_w)  # attn_res's checks, out_w's with them
    out = torch.empty(t, d, dtype=torch.bfloat16, device=sources[0].device)
    if t > 0:
        cfg = config or config_for(d)
        cfg.check(m, d)
        _compiled(cfg, m, d)(*launch_args(tuple(s.data_ptr() for s in sources), norm_w.data_ptr(), proj_w.data_ptr(),
                                          out.data_ptr(), t, float(eps),
                                          torch.cuda.current_stream(out.device).cuda_stream,
                                          out_norm=(out_w.data_ptr(), float(out_eps))))
    return out


# compile_keys (imported): attn_res's, since one (config, m, D) key builds either kernel


def compile(key: tuple[AttnResConfig, int, int], target: str):  # noqa: A001 - the name the gate's protocol asks for
    """Compile the normalized mix for one (config, m, D) for a target ('sm_90a', 'sm_100a') without a GPU: a
    kernels.cute.CompileReport."""
    cfg, m, d = key
    return compile_report(cfg, m, d, normed=True, arch=target)
