"""rms_norm: RMSNorm computed in fp32, result in the input's dtype or `out_dtype` (SPEC.md §2-§5: every norm of the
model but KDA's gated output norm, which is part of kda_decode).

    y = rms_norm(x, weight, eps)                   # x [T, D], weight [D]
    y = rms_norm(x, weight, eps, torch.bfloat16)   # rounded once from the fp32 result: the MoE's latent norm, whose
                                                   # input is the experts' fp32 sum and whose reader takes bf16
"""

from __future__ import annotations

import torch

from .op import Cost, Op, nbytes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * weight.float()).to(out_dtype or x.dtype)


def signature(x, weight, eps, out_dtype=None):
    return (x.shape[-1],), (weight.dtype,)


def cost(x, weight, eps, out_dtype=None):
    out_bytes = x.numel() * (out_dtype or x.dtype).itemsize
    return Cost(bytes=nbytes(x) + out_bytes + nbytes(weight), flops=4 * x.numel())


OP = Op("rms_norm", rms_norm, shapes=("hidden",), dtypes=("weights",), signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.rms_norm_standard:rms_norm_standard",
        standard_label="FLA 0.6.0 fused RMSNorm (Triton)")
