"""Ops computed exactly: the evals gate's yardstick for an op whose standard rounds as its reference does.

On the GPU the evals hold a candidate to `slack` x the standard path's own distance from the reference (bf16 on
random weights: routing flips amplify any rounding difference). That yardstick assumes the standard rounds unlike the
reference. Where it rounds alike, a correct kernel has nothing to hide under. attn_res is that case: its standard
computes each source's score as the fp32 reference does, and a softmax over scores of |l| ~ 100 passes their
rounding straight on to the mix. Measured on the H200 (gate subject: k3, 2 layers, TP8 shapes; the sampling eval's
KL at T = 1, bound 1.5 x the standard's 0.122): the reference over the sources in reverse order 0.122, the CuTe
kernel 0.234, the mix computed in float64 0.233 (model/kimi_k3/specialized/attn_res/results/gate1/). The exact
answer failed the gate. An op joins this list only on such a measurement (`gates/evals/probe.py`): situ_mlp's probe
found its kernel, the reference with K summed in halves and the float64 MLP all at the standard's distance, so it
keeps the plain yardstick (model/kimi_k3/specialized/situ_mlp/NOTES.md, gate 3).

For the ops listed here the yardstick is the standard path with the op computed in float64 and rounded once to the
reference's dtype, wherever the candidate's kernel would run (`exact_path`): a kernel is held to 1.5 x what the
exact answer does to the model, never closer to the fp32 reference than that. The functions live here, in the gate's
own code: a kernel's change cannot loosen its yardstick.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.contract import Contract
from model.kimi_k3.dispatch import Dispatcher, Target
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.ops.attn_res_norm import with_partial_sum
from model.kimi_k3.ops.registry import Specialized

from .paths import DecodePath, dispatched_path


def attn_res_exact(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The reference's AttnRes mix (model/kimi_k3/ops/attn_res.py) in float64, rounded once to the sources' dtype."""
    s = torch.stack([x.double() for x in sources])
    w = norm_w.double() * proj_w.double().reshape(-1)
    logits = (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps) * w).sum(-1)
    return (torch.softmax(logits, dim=0).unsqueeze(-1) * s).sum(0).to(sources[0].dtype)


def attn_res_norm_exact(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                        out_w: torch.Tensor, out_eps: float, addend: torch.Tensor | None = None):
    """attn_res_exact's mix (rounded to the sources' dtype, as the op's reference rounds it), then the RMSNorm in
    float64, rounded once. The norm hides none of the mix's rounding: attn_res's measurement holds for it. With an
    addend, the partial sum is the reference's bf16 add (it has one right answer) and comes back beside the input."""
    mixed, summed = with_partial_sum(sources, addend)
    h = attn_res_exact(mixed, norm_w, proj_w, eps).double()
    y = (h * torch.rsqrt((h * h).mean(-1, keepdim=True) + out_eps) * out_w.double()).to(sources[0].dtype)
    return y if summed is None else (y, summed)


EXACT: dict[str, Callable] = {"attn_res": attn_res_exact, "attn_res_norm": attn_res_norm_exact}


def exact_path(model: KimiK3Model, contract: Contract, kv_cache_dtype: str = "auto") -> DecodePath:
    """The standard path with `contract.op` computed by EXACT inside the contract's envelope (where the candidate
    runs its kernel; outside it, the standard as the candidate falls back to)."""
    ops = Dispatcher(Target.of(model), "latency_specialized",
                     {contract.op: Specialized(contract, f"exact {contract.op} (gates/evals/exact.py)",
                                               EXACT[contract.op])})
    return dispatched_path(model, ops, f"standard, {contract.op} exact", kv_cache_dtype)
