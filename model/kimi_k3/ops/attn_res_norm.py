"""attn_res_norm: a sublayer's input, the Block AttnRes mix followed by the sublayer's RMSNorm (SPEC.md §2: every
attention and FFN sublayer reads RMSNorm(AttnRes(sources)), and nothing else reads the mix).

    y = attn_res_norm(sources, norm_w, proj_w, eps, out_w, out_eps)   # sources: m tensors [T, D]; y [T, D]

The composition exactly: the mix rounded to the sources' dtype as attn_res returns it, then rms_norm. One op so that
a kernel may compute both in one launch; the standard runs the two ops' standards one after the other.
"""

from __future__ import annotations

import torch

from .attn_res import attn_res
from .op import Cost, Op, nbytes
from .rms_norm import rms_norm


def attn_res_norm(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                  out_w: torch.Tensor, out_eps: float) -> torch.Tensor:
    """rms_norm(attn_res(sources, norm_w, proj_w, eps), out_w, out_eps)."""
    return rms_norm(attn_res(sources, norm_w, proj_w, eps), out_w, out_eps)


def attn_res_norm_standard(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                           out_w: torch.Tensor, out_eps: float) -> torch.Tensor:
    """The two ops' GPU standards in sequence: attn_res's torch composition, then FLA's fused RMSNorm."""
    from .attn_res_standard import attn_res_standard
    from .rms_norm_standard import rms_norm_standard

    return rms_norm_standard(attn_res_standard(sources, norm_w, proj_w, eps), out_w, out_eps)


def signature(sources, norm_w, proj_w, eps, out_w, out_eps):
    return (len(sources), sources[0].shape[-1]), (norm_w.dtype,)


def cost(sources, norm_w, proj_w, eps, out_w, out_eps):
    """Each source read once, the three weight vectors, the output written; scores, mix and norm are 7 FLOPs an
    output element a source or less."""
    m, (t, d) = len(sources), sources[0].shape
    return Cost(bytes=(m + 1) * t * d * sources[0].element_size() + nbytes(norm_w, proj_w, out_w),
                flops=4 * m * t * d + 3 * t * d)


OP = Op("attn_res_norm", attn_res_norm, shapes=("sources", "hidden"), dtypes=("weights",), signature_of=signature,
        cost_of=cost, gpu_standard="model.kimi_k3.ops.attn_res_norm:attn_res_norm_standard",
        standard_label="attn_res's torch composition, then FLA 0.6.0 fused RMSNorm (Triton)")
