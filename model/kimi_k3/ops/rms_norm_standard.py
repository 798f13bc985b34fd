"""RMSNorm, STANDARD implementation: FLA's fused Triton RMSNorm (fla-core 0.6.0).

Same semantics as `model.kimi_k3.module.rms_norm(x, weight, eps)`: fp32 math, y = x * rsqrt(mean(x^2) + eps)
* weight, returned in x's dtype.

FLA's path: `fla.modules.norm.layernorm.layer_norm_fwd(x, weight, bias=None, eps, is_rms_norm=True)`, the
forward behind `fla.modules.norm.rms_norm` without the autograd wrapper. Checked in its source (0.6.0):
- D > 512 (K3's 7168 hidden and 3584 latent): `layer_norm_fwd_kernel_row`, one program per row: x loaded and
  cast to fp32, var = sum(x^2) / D, rstd = 1 / sqrt(var + eps), y = (x * rstd) * w with w loaded from its
  dtype (bf16) and cast to fp32, the product stored into y, whose dtype is x's (out_dtype=None), rounding
  to nearest. D <= 512: `layer_norm_fwd_kernel`, blocks of rows, the same arithmetic.
- The reference computes rsqrt(mean + eps) where FLA computes 1 / sqrt(var + eps): the two may differ in the
  last bit of the fp32 rstd, which reaches the output only as a rare one-ulp difference in x's dtype.
- The weight must be [D]; x is made [T, D] contiguous. It allocates y and an fp32 rstd [T] per call
  (capturable: no host synchronization); Triton autotunes on the first call per D (warm up before capture).
"""

from __future__ import annotations

import torch

_FLA = None
_FLA_ERROR: str | None = None


def _load_fla():
    global _FLA, _FLA_ERROR
    if _FLA is None and _FLA_ERROR is None:
        try:
            from fla.modules.norm.layernorm import layer_norm_fwd

            _FLA = layer_norm_fwd
        except Exception as e:  # ImportError without triton/fla, or a broken install
            _FLA_ERROR = f"fla-core not importable: {type(e).__name__}: {e}"
    return _FLA


def standard_available() -> tuple[bool, str]:
    """(True, 'ok') when FLA's Triton RMSNorm can run here, else (False, reason)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device: FLA's RMSNorm is a Triton GPU kernel (use the reference on CPU)"
    if _load_fla() is None:
        return False, _FLA_ERROR
    return True, "ok"


def standard_label() -> str:
    return "FLA fused Triton RMSNorm (fla.modules.norm.layernorm.layer_norm_fwd, is_rms_norm=True)"


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Same signature and semantics as the reference (ops/rms_norm.py) -> x's shape, x's dtype or `out_dtype`
    (FLA stores the fp32 product in it: one rounding, as the reference's cast of its fp32 result)."""
    ok, why = standard_available()
    if not ok:
        raise RuntimeError(f"rms_norm_standard unavailable: {why}")
    if not x.is_cuda:
        raise RuntimeError("rms_norm_standard needs CUDA tensors")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    w = weight.reshape(-1)
    if not w.is_contiguous():
        w = w.contiguous()
    y, _mean, _rstd, _res = _FLA(x2, w, None, eps=eps, out_dtype=out_dtype, is_rms_norm=True)
    return y.view(shape)
