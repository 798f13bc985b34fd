"""rms_norm: RMSNorm computed in fp32, result in the input's dtype (SPEC.md §2-§5: every norm of the model but
KDA's gated output norm, which is part of kda_decode).

    y = rms_norm(x, weight, eps)        # x [T, D], weight [D]
"""

from __future__ import annotations

import torch

from .op import Op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def signature(x, weight, eps):
    return (x.shape[-1],), (weight.dtype,)


OP = Op("rms_norm", rms_norm, shapes=("hidden",), dtypes=("weights",), signature_of=signature)
