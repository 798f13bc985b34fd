"""moe_route: the latent MoE's sigmoid router with correction bias (SPEC.md §5, steps 1-7).

    ids, weights = moe_route(x, gate_w, bias, top_k, renormalize, scaling)     # [T, k] int64, [T, k] fp32
"""

from __future__ import annotations

import torch

from kernels.contract import Tolerance

from .op import Cost, Op, nbytes


def router_scores(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """sigmoid(x W^T) [T, E] in fp32: plus the correction bias they are the choice keys; un-biased, the weights."""
    return torch.sigmoid(x.float() @ gate_w.float().t())


def route_weights(chosen: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """The chosen experts' un-biased scores [..., k] -> their routing weights (renormalized to sum 1, then scaled)."""
    if renormalize:
        chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
    return chosen * scaling


def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with correction bias (noaux_tc, one group): choose by score + bias, weigh by the
    un-biased scores. Returns (expert ids [T, k] int64, weights [T, k] fp32), ids by decreasing key.

    Equal keys go to the lower expert id (a stable sort; torch.topk leaves their order unspecified), the rule
    the specialized router and the TP-split form (moe_route_tp) follow."""
    scores = router_scores(x, gate_w)
    ids = (scores + bias.float()).argsort(dim=-1, descending=True, stable=True)[..., :top_k]
    return ids, route_weights(scores.gather(-1, ids), renormalize, scaling)


def moe_route_standard(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPU standard: the router GEMM on cuBLAS with bf16 operands and fp32 output (vLLM's `GateLinear`), then
    sigmoid, biased top-k and the renormalization as PyTorch ops."""
    scores = torch.sigmoid(torch.mm(x, gate_w.t(), out_dtype=torch.float32))
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    return ids, route_weights(scores.gather(-1, ids), renormalize, scaling)


def signature(x, gate_w, bias, top_k, renormalize, scaling):
    return (gate_w.shape[0], top_k, gate_w.shape[1]), (gate_w.dtype,)


def cost(x, gate_w, bias, top_k, renormalize, scaling):
    t, e = x.shape[0], gate_w.shape[0]
    return Cost(bytes=nbytes(x, gate_w, bias) + t * top_k * (8 + 4), flops=2 * t * e * gate_w.shape[1])


# The weights are fp32 from fp32 scores; ids are compared exactly by the checker (near-ties reported apart).
OP = Op("moe_route", moe_route, shapes=("experts", "top_k", "hidden"), dtypes=("weights",), signature_of=signature,
        cost_of=cost, gpu_standard="model.kimi_k3.ops.moe_route:moe_route_standard",
        standard_label="cuBLAS bf16 GEMM with fp32 output (GateLinear), torch sigmoid / topk / gather",
        standard_tolerance=Tolerance(atol=1e-4, rtol=1e-3, max_rel_l2=1e-4, min_close_fraction=0.999))
