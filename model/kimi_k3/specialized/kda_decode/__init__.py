"""Fused KDA decode step in CuTe DSL (sm_90). Entry point: `kda_decode_cute`.

    >>> out = kda_decode_cute(proj, conv_state, ssm_state, slots, w)      # the reference's signature, one launch
    >>> out = kda_decode_cute(proj, conv_state, ssm_state, slots, w, tuning={"v_split": 2})

Envelope: head_dim and rank 128, conv width 4; proj [B, W] bf16 with contiguous columns (rows may be strided by a
multiple of 8 elements); conv_state [slots, 3P, 4] bf16 and ssm_state [slots, H, 128, 128] fp32 contiguous, updated
in place at rows `slots` [B] (int32 or int64, distinct); fp32 conv taps, A_log, dt_bias, o_norm; bf16 f_b. Anything
else raises before anything is written. The kernel, its config and the launch heuristic are in `kernel.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

import torch

from kernels.cute import CompileCache, current_cute_arch, kernel_available, require_dsl
from model.kimi_k3.ops.kda import KDAColumns, KDAWeights

from . import kernel
from .kernel import KDADecodeConfig, compile_report

__all__ = ["KDADecodeConfig", "available", "compile", "compile_keys", "decode_with", "kda_decode_cute"]

_SLOT_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def available() -> tuple[bool, str]:
    """(True, 'ok') where the kernel can run: CuTe DSL importable and an sm_90 GPU."""
    return kernel_available(kernel.DSL.error)


@functools.cache
def _cache(module: ModuleType) -> CompileCache:
    """One compile cache per kernel module; on disk only for this tree's own (a variant loaded from a file by
    explore.py has no dotted name whose imports the cache could hash)."""
    return CompileCache(module.__name__, module=module.__name__ if module is kernel else None)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape=None) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _address(name: str, t: torch.Tensor, align: int) -> int:
    if t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer not {align}-byte aligned")
    return t.data_ptr()


def decode_with(module: ModuleType, proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                slots: torch.Tensor, w: KDAWeights, *, tuning: dict | None = None) -> torch.Tensor:
    """`kda_decode_cute` with the kernel of `module` (this package's `kernel`, or an edited copy explore.py
    loaded from a file)."""
    require_dsl(module.DSL.error)
    if not proj.is_cuda:
        raise RuntimeError("kda_decode_cute needs CUDA tensors")
    cols = KDAColumns.of(ssm_state, w)
    heads, head_dim, rank, p, batch = cols.heads, cols.head_dim, cols.rank, cols.p, proj.shape[0]
    wc = w.conv_weight.shape[-1]
    if proj.dtype != torch.bfloat16 or proj.dim() != 2 or proj.stride(1) != 1:
        raise ValueError("proj: [B, W] bf16 with contiguous columns")
    if ssm_state.shape[2] != head_dim:
        raise ValueError("ssm_state: V must equal K")
    _check("conv_state", conv_state, torch.bfloat16, (conv_state.shape[0], 3 * p, wc))
    _check("ssm_state", ssm_state, torch.float32)
    _check("conv_weight", w.conv_weight, torch.float32, (3 * p, wc))
    _check("f_b", w.f_b, torch.bfloat16, (p, rank))
    _check("A_log", w.A_log, torch.float32, (heads,))
    _check("dt_bias", w.dt_bias, torch.float32, (p,))
    _check("o_norm", w.o_norm, torch.float32, (head_dim,))
    if slots.dtype not in _SLOT_DTYPES or slots.shape != (batch,) or not slots.is_contiguous():
        raise ValueError("slots: contiguous [B] int32 or int64")
    out = torch.empty(batch, p, dtype=proj.dtype, device=proj.device)
    if batch == 0:
        return out
    cfg = module.KDADecodeConfig.for_problem(heads, batch, head_dim=head_dim, rank=rank, conv_width=wc,
                                             proj_stride=proj.stride(0), slot_dtype=_SLOT_DTYPES[slots.dtype])
    cfg = dataclasses.replace(cfg, **(tuning or {}))
    fn = _cache(module).get((cfg, current_cute_arch()), lambda: module.compile_kernel(cfg))
    slot_bytes = slots.element_size()
    fn(*module.launch_args(
        cfg, _address("proj", proj, 16), _address("conv_state", conv_state, 16),
        _address("ssm_state", ssm_state, 16), _address("slots", slots, slot_bytes),
        _address("conv_weight", w.conv_weight, 16), _address("f_b", w.f_b, 16), _address("A_log", w.A_log, 4),
        _address("dt_bias", w.dt_bias, 4), _address("o_norm", w.o_norm, 4), _address("out", out, 4), batch,
        float(w.lower_bound), float(w.norm_eps), torch.cuda.current_stream(proj.device).cuda_stream))
    return out


def kda_decode_cute(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                    w: KDAWeights, *, tuning: dict | None = None) -> torch.Tensor:
    """Same signature and semantics as model.kimi_k3.ops.kda_decode.kda_decode; one kernel launch.

    Returns out [B, P] bf16; conv_state and ssm_state are updated in place at rows `slots`. `tuning` overrides
    KDADecodeConfig fields (v_split, smem_carveout, ...) of `KDADecodeConfig.for_problem`'s choice.
    """
    return decode_with(kernel, proj, conv_state, ssm_state, slots, w, tuning=tuning)


def compile_keys(contract) -> list[KDADecodeConfig]:
    """The gate's compile protocol: every config the entry point compiles across the contract's envelope."""
    configs = {KDADecodeConfig.for_problem(h, b, slot_dtype="int64")
               for h in contract.shapes["heads"] for b in range(contract.batch.min, contract.batch.max + 1)}
    return sorted(configs, key=lambda c: (c.heads, c.v_split))


def compile(key: KDADecodeConfig, target: str):  # noqa: A001 - the name the gate's protocol asks for
    """Compile one config for a target ('sm_90a', 'sm_100a') without a GPU: a kernels.cute.CompileReport."""
    return compile_report(key, arch=target)
