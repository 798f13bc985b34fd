"""attn_res: the Block Attention Residuals mix (SPEC.md §2), a softmax over earlier block sums and the running
partial sum, per token.

    out = attn_res(sources, norm_w, proj_w, eps)       # sources: m tensors [T, D]; out [T, D]
"""

from __future__ import annotations

import torch

from .op import Cost, Op, nbytes


def attn_res(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """sources: m tensors [T, D]. Scores l_i = <s_i / rms(s_i), norm_w * proj_w>; the output mixes the
    un-normalized sources in fp32 with softmax(l) and is returned in the sources' dtype."""
    s = torch.stack([x.float() for x in sources])  # [m, T, D]
    w = norm_w.float() * proj_w.float().reshape(-1)
    logits = (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps) * w).sum(-1)  # [m, T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * s).sum(0).to(sources[0].dtype)


def signature(sources, norm_w, proj_w, eps):
    return (len(sources), sources[0].shape[-1]), (norm_w.dtype,)


def cost(sources, norm_w, proj_w, eps):
    """Each source read once, the two weight vectors, the mix written; scores and mix are 4 FLOPs an element."""
    m, (t, d) = len(sources), sources[0].shape
    return Cost(bytes=(m + 1) * t * d * sources[0].element_size() + nbytes(norm_w, proj_w), flops=4 * m * t * d)


OP = Op("attn_res", attn_res, shapes=("sources", "hidden"), dtypes=("weights",), signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.attn_res_standard:attn_res_standard",
        standard_label="PyTorch composition: one stack, fp32 math (flash-attn-res does not fit decode; "
                       "attn_res_standard.py says why)")
