"""lm_head: the logits of a vocabulary shard, fp32 from bf16 operands (SPEC.md §7).

    logits = lm_head(h, weight)         # h [T, D] (after the final norm), weight [V/tp, D] -> [T, V/tp] fp32
"""

from __future__ import annotations

import torch

from kernels.contract import Tolerance

from .op import Cost, Op, nbytes


def lm_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h.float() @ weight.float().t()


def lm_head_standard(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cuBLAS with bf16 operands, fp32 accumulation and fp32 output: no bf16 rounding of the logits."""
    return torch.mm(h.to(weight.dtype), weight.t(), out_dtype=torch.float32)


def signature(h, weight):
    return (weight.shape[0], weight.shape[1]), (weight.dtype,)


def cost(h, weight):
    t, (v, d) = h.shape[0], weight.shape
    return Cost(bytes=nbytes(h, weight) + t * v * 4, flops=2 * t * v * d)


OP = Op("lm_head", lm_head, shapes=("vocab_rows", "hidden"), dtypes=("weights",), signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.lm_head:lm_head_standard",
        standard_label="cuBLAS bf16 GEMM with fp32 output (torch.mm out_dtype)",
        standard_tolerance=Tolerance(atol=1e-3, rtol=1e-4, max_rel_l2=1e-5, min_close_fraction=0.999))
