"""rms_norm: RMSNorm computed in fp32, result in the input's dtype (SPEC.md §2-§5: every norm of the model but
KDA's gated output norm, which is part of kda_decode).

    y = rms_norm(x, weight, eps)        # x [T, D], weight [D]
"""

from __future__ import annotations

import torch

from .op import Cost, Op, nbytes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def signature(x, weight, eps):
    return (x.shape[-1],), (weight.dtype,)


def cost(x, weight, eps):
    return Cost(bytes=2 * nbytes(x) + nbytes(weight), flops=4 * x.numel())


OP = Op("rms_norm", rms_norm, shapes=("hidden",), dtypes=("weights",), signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.rms_norm_standard:rms_norm_standard",
        standard_label="FLA 0.6.0 fused RMSNorm (Triton)")
