"""The Block AttnRes mix in one CuTe DSL launch (sm_90). Entry point: `attn_res_cute`, the signature of the reference
(model/kimi_k3/ops/attn_res.py).

    >>> out = attn_res_cute(sources, norm_w, proj_w, eps)   # sources: m bf16 tensors [T, D]; norm_w [D], proj_w
    ...                                                     # [1, D] (or [D]) bf16 -> out [T, D] bf16

Envelope: 1..9 sources of one shape [T, D], each contiguous; D a multiple of 256 (whole warps of 16-byte chunks; K3's
7168); bf16 sources and weights; every tensor 16-byte aligned, on one CUDA device. Anything else raises ValueError
before anything is launched. T = 0 returns an empty output without a launch.
"""

from __future__ import annotations

import functools

import torch

from kernels.cute import CompileCache, current_cute_arch, kernel_available, require_dsl

from .kernel import DSL, MAX_SOURCES, AttnResConfig, compile_kernel, compile_report, launch_args

__all__ = ["AttnResConfig", "attn_res_cute", "available", "check_args", "compile", "compile_keys", "config_for",
           "launch"]

_CACHE = CompileCache("attn_res", module=f"{__name__}.kernel")


def available() -> tuple[bool, str]:
    """(True, 'ok') where the kernel can run: CuTe DSL importable and an sm_90 GPU."""
    return kernel_available(DSL.error)


@functools.cache
def config_for(hidden: int) -> AttnResConfig:
    """The config a call of hidden size D uses (AttnResConfig.for_shape); memoized, since it runs on every call."""
    return AttnResConfig.for_shape(hidden)


def check_args(sources, norm_w: torch.Tensor, proj_w: torch.Tensor, out_w: torch.Tensor | None = None,
               addend: torch.Tensor | None = None) -> tuple[int, int, int]:
    """Validate a call (with `out_w`, the fused norm's weight, and `addend`, the partial sum's: attn_res_norm's);
    return (m, T, D). Raises ValueError, device last, so that every other check runs on CPU tensors."""
    if not isinstance(sources, (list, tuple)) or not all(isinstance(s, torch.Tensor) for s in sources):
        raise ValueError("sources must be a list of tensors")
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"{len(sources)} sources: 1..{MAX_SOURCES}")
    weights = {"norm_w": norm_w, "proj_w": proj_w} | ({} if out_w is None else {"out_w": out_w})
    names = ", ".join(weights)
    if not all(isinstance(w, torch.Tensor) for w in weights.values()):
        raise ValueError(f"{names} must be tensors")
    if addend is not None:
        if not isinstance(addend, torch.Tensor):
            raise ValueError("addend must be a tensor or None")
        names += ", addend"
    tensors = [*sources, *weights.values(), *([] if addend is None else [addend])]
    if any(t.dtype != torch.bfloat16 for t in tensors):
        raise ValueError(f"sources, {names} must be bf16, got {sorted({str(t.dtype) for t in tensors})}")
    shape = sources[0].shape
    if len(shape) != 2 or any(s.shape != shape for s in sources):
        raise ValueError(f"sources must share one shape [T, D], got {[tuple(s.shape) for s in sources]}")
    t, d = shape
    if norm_w.numel() != d or proj_w.numel() != d or norm_w.dim() != 1 or proj_w.shape[-1] != d:
        raise ValueError(f"norm_w [D] and proj_w [1, D] with D = {d}, got {tuple(norm_w.shape)}, "
                         f"{tuple(proj_w.shape)}")
    if out_w is not None and (out_w.dim() != 1 or out_w.numel() != d):
        raise ValueError(f"out_w must be [D] with D = {d}, got {tuple(out_w.shape)}")
    if addend is not None and addend.shape != shape:
        raise ValueError(f"addend must have the sources' shape {tuple(shape)}, got {tuple(addend.shape)}")
    if not all(x.is_contiguous() for x in tensors):
        raise ValueError(f"sources, {names} must be contiguous")
    config_for(d).check(len(sources), d)
    if any(x.data_ptr() % 16 for x in tensors):
        raise ValueError(f"sources, {names} must be 16-byte aligned")
    if t * d >= 2**31:
        raise ValueError(f"T x D = {t * d}: an index would overflow int32")
    if not all(x.is_cuda for x in tensors) or len({x.device for x in tensors}) != 1:
        raise ValueError(f"sources, {names} must be CUDA tensors on one device")
    return len(sources), t, d


def launch(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
           config: AttnResConfig | None, out_norm: tuple[torch.Tensor, float] | None = None,
           addend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The launch both entry points make, for arguments check_args accepted: (out, the rounded partial sum or None).
    `out_norm` = (out_w, out_eps) runs the normalized kernel (attn_res_norm's), `addend` its partial sum's add."""
    out = torch.empty_like(sources[0])
    summed = None if addend is None else torch.empty_like(addend)
    (t, d), m = out.shape, len(sources)
    if t > 0:
        cfg = config or config_for(d)
        cfg.check(m, d)
        normed, added = out_norm is not None, addend is not None
        kernel = _CACHE.get((cfg, m, d, normed, added, current_cute_arch()),
                            lambda: compile_kernel(cfg, m, d, normed, added))
        stream = torch.cuda.current_stream(out.device).cuda_stream
        extra = {} if not normed else {"out_norm": (out_norm[0].data_ptr(), float(out_norm[1]))}
        if added:
            extra["added"] = (addend.data_ptr(), summed.data_ptr())
        kernel(*launch_args(tuple(s.data_ptr() for s in sources), norm_w.data_ptr(), proj_w.data_ptr(),
                            out.data_ptr(), t, float(eps), stream, **extra))
    return out, summed


def attn_res_cute(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                  *, config: AttnResConfig | None = None) -> torch.Tensor:
    """The reference's mix in one launch: [T, D] bf16 (kernel.py's module doc has the method)."""
    require_dsl(DSL.error)
    check_args(sources, norm_w, proj_w)
    return launch(sources, norm_w, proj_w, eps, config)[0]


def compile_keys(contract) -> list[tuple[AttnResConfig, int, int]]:
    """The gate's compile protocol: the (config, m, D) the entry point compiles for every source count and hidden
    size the contract admits (T is a runtime argument: one key serves every batch)."""
    keys = {(config_for(d), m, d) for m in contract.shapes["sources"] for d in contract.shapes["hidden"]}
    return sorted(keys, key=lambda key: (key[2], key[1]))


def compile(key: tuple[AttnResConfig, int, int], target: str):  # noqa: A001 - the name the gate's protocol asks for
    """Compile one (config, m, D) for a target ('sm_90a', 'sm_100a') without a GPU: a kernels.cute.CompileReport."""
    cfg, m, d = key
    return compile_report(cfg, m, d, arch=target)
