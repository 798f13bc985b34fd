"""moe_experts: the routed experts of the latent MoE, weighted and combined in fp32 (SPEC.md §5, step 9).

    y = moe_experts(z, ids, weights, w13, w2, beta, beta_lin)     # z [T, L], ids/weights [T, k] -> y [T, L] fp32

Expert weights as the checkpoint stores them: MXFP4 pairs (packed uint8, E8M0 scale uint8) or dense tensors;
`w13` stacks w1 (gate) over w3 (up) per expert: [E, 2I, L]; `w2` is [E, L, I].
"""

from __future__ import annotations

import torch

from .. import mxfp4
from .op import Cost, Op, nbytes
from .situ_mlp import situ


def expert_matrices(w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...], e: int, dtype: torch.dtype):
    """Dense [2I, L] and [L, I] weights of expert e from MXFP4 (packed, scale) pairs or dense tensors."""
    if len(w13) == 2:
        return mxfp4.dequantize(w13[0][e], w13[1][e], dtype), mxfp4.dequantize(w2[0][e], w2[1][e], dtype)
    return w13[0][e], w2[0][e]


def moe_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: tuple[torch.Tensor, ...],
                w2: tuple[torch.Tensor, ...], beta: float, beta_lin: float) -> torch.Tensor:
    """y[t] = sum_k weights[t,k] * w2_e(SiTU(w1_e z, w3_e z)), e = ids[t,k]; accumulated in fp32 -> [T, L].

    Tokens are grouped by expert so each expert's weights are expanded once per call.
    """
    y = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        m13, m2 = expert_matrices(w13, w2, e, z.dtype)
        a, b = (z[tok] @ m13.t()).chunk(2, dim=-1)
        h = situ(a, b, beta, beta_lin) @ m2.t()
        y.index_add_(0, tok, weights[tok, slot].unsqueeze(-1) * h.float())
    return y


def expert_dtype(w13: tuple[torch.Tensor, ...]) -> torch.dtype | str:
    return "mxfp4" if len(w13) == 2 else w13[0].dtype


def signature(z, ids, weights, w13, w2, beta, beta_lin):
    return (w13[0].shape[0], ids.shape[1], z.shape[1]), (expert_dtype(w13),)


def cost(z, ids, weights, w13, w2, beta, beta_lin):
    """Only the experts the call routes to are read (their packed weights and scales, or dense rows): the count
    of distinct ids is read on the host, so this is for planning and reporting, never inside a captured step."""
    active = int(ids.unique().numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in (*w13, *w2))
    t, k, latent = z.shape[0], ids.shape[1], z.shape[1]
    inter = w13[0].shape[1] // 2
    return Cost(bytes=active * per_expert + nbytes(z, ids, weights) + t * latent * 4,
                flops=2 * t * k * 3 * inter * latent)


OP = Op("moe_experts", moe_experts, shapes=("experts", "top_k", "latent_dim"), dtypes=("weights",),
        signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.moe_experts_standard:moe_experts_standard",
        standard_label="humming 0.1.20 MoE W4A16 (MXFP4) indexed GEMMs with SiTU fused (Triton routing alignment and "
                       "slot sum); a gathered-dequantization PyTorch composition where humming cannot serve")
