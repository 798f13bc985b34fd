"""situ_mlp (the shared experts, dense layer 0's MLP) in three launches on sm_90: the gate-up GEMM, SiTU in one CuTe
DSL launch (`kernel.py`), the down GEMM. Entry point: `situ_mlp_cute`, the reference's signature
(model/kimi_k3/ops/situ_mlp.py).

    >>> y = situ_mlp_cute(x, gate_up, down, beta, beta_lin)   # x [T, D], gate_up [2I, D], down [D, I] bf16 -> [T, D]

The GEMMs: the projection GEMV (`specialized/linear`, validated faster than cuBLAS at one token) where T = 1, cuBLAS
above (where it is at parity or ahead of the GEMV: linear's NOTES). Their outputs round to bf16 as the reference's
do, so the rounding points are the reference's. Envelope: bf16 everywhere; gate_up [2I, D] and down
[D, I] contiguous with I a multiple of 32 and D a multiple of 128; x [T, D] contiguous; one CUDA device. Anything else
raises ValueError before anything is launched. T = 0 returns an empty output without a launch. Any T: a verify step
brings batch x (1 + drafts) tokens, up to 512 at K3's envelope.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.cute import CompileCache, current_cute_arch, kernel_available, require_dsl

from ..linear import linear_cute
from .kernel import DSL, SituConfig, compile_kernel, compile_report, launch_args

__all__ = ["SituConfig", "available", "check_args", "compile", "compile_keys", "config_for", "prepare", "situ",
           "situ_mlp_cute"]

GEMV_TOKENS = 1  # tokens up to which the GEMMs run on the projection GEMV (its contract's batch)
I_MULTIPLE = 32  # the down GEMM's K: the GEMV's K steps
D_MULTIPLE = 128  # the gate-up GEMM's K: the GEMV path's K step

_CACHE = CompileCache("situ_mlp", module=f"{__name__}.kernel")


def available() -> tuple[bool, str]:
    """(True, 'ok') where the kernel can run: CuTe DSL importable and an sm_90 GPU."""
    return kernel_available(DSL.error)


@functools.cache
def config_for(intermediate: int) -> SituConfig:
    """The config a call of intermediate size I uses (SituConfig.for_shape); memoized, since it runs on every call."""
    return SituConfig.for_shape(intermediate)


def check_args(x, gate_up, down) -> tuple[int, int, int]:
    """Validate a call; return (T, I, D). Raises ValueError, device last, so that every other check runs on CPU
    tensors."""
    tensors = (x, gate_up, down)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("x, gate_up and down must be tensors")
    if any(t.dtype != torch.bfloat16 for t in tensors):
        raise ValueError(f"x, gate_up and down must be bf16, got {x.dtype}, {gate_up.dtype}, {down.dtype}")
    if x.dim() != 2 or gate_up.dim() != 2 or down.dim() != 2:
        raise ValueError(f"x [T, D], gate_up [2I, D] and down [D, I], got {tuple(x.shape)}, {tuple(gate_up.shape)}, "
                         f"{tuple(down.shape)}")
    (t, d), (d_out, i) = x.shape, down.shape
    if gate_up.shape != (2 * i, d) or d_out != d:
        raise ValueError(f"gate_up must be [2I, D] = [{2 * i}, {d}] and down [D, I] = [{d}, {i}], got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if t * 2 * i >= 2**31 or t * d >= 2**31:
        raise ValueError(f"T={t} tokens: an index would overflow int32")
    if i <= 0 or i % I_MULTIPLE or d <= 0 or d % D_MULTIPLE:
        raise ValueError(f"I={i} must be a positive multiple of {I_MULTIPLE} and D={d} of {D_MULTIPLE}")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("x, gate_up and down must be contiguous")
    if any(t.data_ptr() % 16 for t in tensors):
        raise ValueError("x, gate_up and down must be 16-byte aligned")
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError("x, gate_up and down must be CUDA tensors on one device")
    return t, i, d


def _compiled(cfg: SituConfig, intermediate: int):
    return _CACHE.get((cfg, intermediate, current_cute_arch()), lambda: compile_kernel(cfg, intermediate))


def prepare(intermediate: int) -> SituConfig:
    """Compile (once per process) the SiTU kernel for I without launching it; return its config: for warming up
    outside CUDA-graph capture and timed regions."""
    cfg = config_for(intermediate)
    _compiled(cfg, intermediate)
    return cfg


def situ(gate_up_out: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """h [T, I] = SiTU(g[:, :I], g[:, I:]) of a contiguous bf16 gate-up output g [T, 2I] on the GPU, one launch."""
    require_dsl(DSL.error)
    t, width = gate_up_out.shape[0], gate_up_out.shape[1] // 2
    out = torch.empty(t, width, dtype=torch.bfloat16, device=gate_up_out.device)
    if t > 0:
        _compiled(config_for(width), width)(*launch_args(
            gate_up_out.data_ptr(), out.data_ptr(), t, float(beta), float(beta_lin),
            torch.cuda.current_stream(out.device).cuda_stream))
    return out


def situ_mlp_cute(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, beta: float,
                  beta_lin: float) -> torch.Tensor:
    """down(SiTU(gate x, up x)) in three launches: [T, D] bf16 (the module doc has the method)."""
    t, _, _ = check_args(x, gate_up, down)
    if t == 0:
        return torch.empty_like(x)
    gemm = linear_cute if t <= GEMV_TOKENS else F.linear
    return gemm(situ(gemm(x, gate_up), beta, beta_lin), down)


def compile_keys(contract) -> list[tuple[SituConfig, int]]:
    """The gate's compile protocol: the (config, I) of the SiTU launch for every intermediate size the contract admits
    (T, beta and beta_lin are runtime arguments; the GEMV's own keys are the linear contract's)."""
    return [(config_for(i), i) for i in sorted(contract.shapes["intermediate"])]


def compile(key: tuple[SituConfig, int], target: str):  # noqa: A001 - the name the gate's protocol asks for
    """Compile one (config, I) for a target ('sm_90a', 'sm_100a') without a GPU: a kernels.cute.CompileReport."""
    cfg, intermediate = key
    return compile_report(cfg, intermediate, arch=target)
