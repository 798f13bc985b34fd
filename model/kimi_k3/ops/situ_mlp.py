"""situ_mlp: a dense SiTU MLP's rank-local part, down(SiTU(gate x, up x)): the shared experts (SPEC.md §5,
step 12) and dense layer 0 (§6). The caller all-reduces the partial sum over TP ranks.

    y = situ_mlp(x, gate_up, down, beta, beta_lin)      # x [T, D], gate_up [2I, D], down [D, I] -> [T, D]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .op import Cost, Op, nbytes


def situ(a: torch.Tensor, b: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """SiTU(a, b) = [beta tanh(a/beta) sigmoid(a)] * [beta_lin tanh(b/beta_lin)], in fp32, cast back."""
    af, bf = a.float(), b.float()
    out = beta * torch.tanh(af / beta) * torch.sigmoid(af) * (beta_lin * torch.tanh(bf / beta_lin))
    return out.to(a.dtype)


def situ_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """Both products accumulate in fp32 and round to x's dtype, as a bf16 GEMM does; rows 0..I-1 of gate_up are
    the gate (a), rows I..2I-1 the up projection (b)."""
    a, b = F.linear(x.float(), gate_up.float()).to(x.dtype).chunk(2, dim=-1)
    return F.linear(situ(a, b, beta, beta_lin).float(), down.float()).to(x.dtype)


def situ_mlp_standard(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, beta: float,
                      beta_lin: float) -> torch.Tensor:
    """cuBLAS for both products, SiTU as PyTorch elementwise ops."""
    a, b = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(situ(a, b, beta, beta_lin), down)


def signature(x, gate_up, down, beta, beta_lin):
    return (down.shape[1], down.shape[0]), (down.dtype,)


def cost(x, gate_up, down, beta, beta_lin):
    t = x.shape[0]
    return Cost(bytes=2 * nbytes(x) + nbytes(gate_up, down),
                flops=2 * t * (gate_up.numel() + down.numel()) + 10 * t * down.shape[1])


OP = Op("situ_mlp", situ_mlp, shapes=("intermediate", "hidden"), dtypes=("weights",), signature_of=signature,
        cost_of=cost, gpu_standard="model.kimi_k3.ops.situ_mlp:situ_mlp_standard",
        standard_label="cuBLAS (torch F.linear) for gate_up and down, SiTU as torch elementwise ops")
