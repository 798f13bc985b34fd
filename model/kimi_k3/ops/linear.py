"""linear: one bf16 projection of a decode layer, y = x W^T (every dense projection; which one is told by its
shape, as `k3forge config show` lists them per rank).

    y = linear(x, weight)        # x [T, in_features], weight [out_features, in_features] -> [T, out_features]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .op import Cost, Op, nbytes


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The product accumulated in fp32 and rounded once to x's dtype: what a bf16 GEMM with fp32 accumulation
    computes, without favouring any summation order."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def linear_standard(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def signature(x, weight):
    return (weight.shape[0], weight.shape[1]), (weight.dtype,)


def cost(x, weight):
    t, (n, k) = x.shape[0], weight.shape
    return Cost(bytes=nbytes(x, weight) + t * n * x.element_size(), flops=2 * t * n * k)


OP = Op("linear", linear, shapes=("out_features", "in_features"), dtypes=("weights",), signature_of=signature,
        cost_of=cost, gpu_standard="model.kimi_k3.ops.linear:linear_standard",
        standard_label="cuBLAS through torch F.linear")
