"""Decode-batch bf16 projection y = x W^T in CuTe DSL (sm_90). Entry point: `linear_cute`.

    >>> y = linear_cute(x, weight)                              # x [M, K] bf16, weight [N, K] bf16 -> y [M, N] bf16
    >>> y = linear_cute(x, weight, out_dtype=torch.float32)     # fp32 out (lm_head, router)
    >>> linear_cute(x, weight, out=y)                           # into a preallocated [M, N] bf16 / fp32 tensor
    >>> linear_cute(x, weight, config=dataclasses.replace(LinearConfig.for_shape(m, n, k), stages=2))

Envelope: M <= 64 tokens; any N (M = 0 or N = 0 return an empty y without a launch); K a positive multiple of 32 (of
128 for the gemv path, which M <= 8 takes when K allows); weight contiguous; x with unit column stride and a row
stride that is a multiple of 8 elements (a column slice of a wider tensor is fine); x and weight 16-byte aligned; y
contiguous and not overlapping x or weight; every index below 2^31. Anything else raises ValueError before anything
is written.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kernels.cute import CompileCache, current_cute_arch, kernel_available, require_dsl

from .kernel import DSL, MAX_TOKENS, LinearConfig, compile_kernel, compile_report, launch_args
from .tuned import tuned_config

__all__ = ["LinearConfig", "available", "check_args", "compile", "compile_keys", "config_for", "linear_cute",
           "prepare"]
# Token counts the compile gate builds for: each path's band edges (the code a config generates changes with M
# only through the tile loops the heuristic sizes for these bands).
COMPILE_TOKENS = (1, 2, 8, 9, 16, 32, 64)

MAX_M = MAX_TOKENS["mma"]
K_MULTIPLE = 32
_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_INT32_LIMIT = 2**31

_CACHE = CompileCache("linear", module=f"{__name__}.kernel")


def available() -> tuple[bool, str]:
    """(True, 'ok') where the kernel can run: CuTe DSL importable and an sm_90 GPU."""
    return kernel_available(DSL.error)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses of the memory a tensor's elements occupy."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_activation_layout(x: torch.Tensor, weight: torch.Tensor, name: str = "weight") -> None:
    """What the GEMV's loads need of x [M, K] and the weight (also the router's, which runs this GEMV): unit
    column stride, a row stride that is a multiple of 8 elements and at least K (M > 1), 16-byte alignment."""
    m, k = x.shape
    if m > 1 and (x.stride(1) != 1 or x.stride(0) % 8 or x.stride(0) < k):
        raise ValueError(f"x needs unit column stride and a row stride that is a multiple of 8 >= K, got strides "
                         f"{x.stride()}")
    if m == 1 and x.stride(1) != 1:
        raise ValueError(f"x needs unit column stride, got strides {x.stride()}")
    if x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError(f"x and {name} must be 16-byte aligned")


def check_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> tuple[int, int, int, torch.dtype]:
    """Validate a call; return (M, N, K, out dtype). Raises ValueError, device last, so that every other check
    can be exercised on CPU tensors."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("x and weight must be tensors")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"x and weight must be bf16, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    (m, k), (n, kw) = x.shape, weight.shape
    if k != kw:
        raise ValueError(f"x has K={k} columns but weight has K={kw}")
    if m > MAX_M:
        raise ValueError(f"M={m} tokens: at most {MAX_M}")
    if k <= 0 or k % K_MULTIPLE:
        raise ValueError(f"K={k}: must be a positive multiple of {K_MULTIPLE}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    check_activation_layout(x, weight)
    if n * k >= _INT32_LIMIT or m * n >= _INT32_LIMIT or (m - 1) * x.stride(0) + k >= _INT32_LIMIT:
        raise ValueError("an index of x, weight or y would overflow int32")
    if out is not None:
        if out_dtype is not None and out_dtype != out.dtype:
            raise ValueError(f"out is {out.dtype} but out_dtype {out_dtype} was asked for")
        out_dtype = out.dtype
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out dtype {out_dtype}: bf16 or fp32")
    if out is not None and out.numel() and (_overlap(out, x) or _overlap(out, weight)):
        raise ValueError("out overlaps x or weight")
    tensors = (x, weight) if out is None else (x, weight, out)
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError("x, weight and out must be CUDA tensors on one device")
    return m, n, k, out_dtype


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def config_for(m: int, n: int, k: int, out_dtype: torch.dtype = torch.bfloat16, num_sms: int = 132) -> LinearConfig:
    """The config linear_cute uses for a problem: the measured one (tuned.py) where there is one, else
    LinearConfig.for_shape; memoized, since it runs on every call."""
    dtype = _OUT_DTYPES[out_dtype]
    return tuned_config(m, n, k, num_sms, dtype) or LinearConfig.for_shape(m, n, k, num_sms=num_sms, out_dtype=dtype)


def _resolve(m: int, n: int, k: int, out_dtype: torch.dtype, config: LinearConfig | None, num_sms: int):
    """(config, compiled kernel) for a call: the heuristic's config or `config` with the call's out dtype."""
    if config is None:
        config = config_for(m, n, k, out_dtype, num_sms)
    else:
        config = dataclasses.replace(config, out_dtype=_OUT_DTYPES[out_dtype])
        config.check(m, k)
    return config, _CACHE.get((config, m, k, current_cute_arch()), lambda: compile_kernel(config, m, k))


def prepare(m: int, n: int, k: int, out_dtype: torch.dtype = torch.bfloat16, config: LinearConfig | None = None,
            num_sms: int | None = None) -> LinearConfig:
    """Compile (once per process) the kernel a call of this shape runs, without launching it, and return its
    config: for warming up outside CUDA-graph capture and timed regions."""
    return _resolve(m, n, k, out_dtype, config, num_sms or _num_sms(torch.cuda.current_device()))[0]


def linear_cute(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, config: LinearConfig | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ weight[N, K]^T with fp32 accumulation, one kernel launch; y bf16 (or fp32 with
    out_dtype=torch.float32, or out's dtype). `config` overrides the heuristic (its out_dtype is replaced by
    the output's). Raises ValueError, before writing anything, on input outside the envelope (module doc)."""
    require_dsl(DSL.error)
    m, n, k, out_dtype = check_args(x, weight, out, out_dtype)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config, kernel = _resolve(m, n, k, out_dtype, config, _num_sms(x.device.index))
    kernel(*launch_args(x.data_ptr(), weight.data_ptr(), out.data_ptr(), config.out_dtype, n,
                    x.stride(0) if m > 1 else k, torch.cuda.current_stream(x.device).cuda_stream))
    return out


def compile_keys(contract) -> list[tuple[LinearConfig, int, int]]:
    """The gate's compile protocol: the (config, M, K) the entry point compiles, at every in_features and out_features
    the contract admits, for the token counts of COMPILE_TOKENS inside its batch range."""
    tokens = [m for m in COMPILE_TOKENS if contract.batch.min <= m <= min(contract.batch.max, MAX_M)]
    keys = {(config_for(m, n, k), m, k) for m in tokens for n in contract.shapes["out_features"]
            for k in contract.shapes["in_features"]}
    return sorted(keys, key=lambda key: (key[2], key[1], repr(key[0])))


def compile(key: tuple[LinearConfig, int, int], target: str):  # noqa: A001 - the name the gate's protocol asks for
    """Compile one (config, M, K) for a target ('sm_90a', 'sm_100a') without a GPU: a kernels.cute.CompileReport."""
    config, m, k = key
    return compile_report(config, m, k, arch=target)
