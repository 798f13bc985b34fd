"""attn_res_norm: a sublayer's input, the Block AttnRes mix followed by the sublayer's RMSNorm (SPEC.md §2: every
attention and FFN sublayer reads RMSNorm(AttnRes(sources)), and nothing else reads the mix), and the running partial
sum's add before it where the layer has one.

    y = attn_res_norm(sources, norm_w, proj_w, eps, out_w, out_eps)   # sources: m tensors [T, D]; y [T, D]
    y, summed = attn_res_norm(sources, norm_w, proj_w, eps, out_w, out_eps, addend)   # addend [T, D]

The composition exactly: with an addend, summed = sources[-1] + addend in the sources' dtype (a torch add: the
decoder layer's `partial + ffn_prev` or `partial + a`) replaces the last source; the mix rounded to the sources'
dtype as attn_res returns it, then rms_norm. One op so that a kernel may compute all of it in one launch; the
standard runs the add and the two ops' standards one after the other. The layer needs the sum again (the next add,
a block), hence the second output.
"""

from __future__ import annotations

import torch

from .attn_res import attn_res
from .op import Cost, Op, nbytes
from .rms_norm import rms_norm


def with_partial_sum(sources: list[torch.Tensor], addend: torch.Tensor | None):
    """(the sources the op mixes, the sum or None): the last source plus `addend` in the sources' dtype (a torch
    add, the layer's own), where there is one; every implementation of the op starts from this."""
    if addend is None:
        return sources, None
    summed = sources[-1] + addend
    return [*sources[:-1], summed], summed


def attn_res_norm(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                  out_w: torch.Tensor, out_eps: float, addend: torch.Tensor | None = None):
    """rms_norm(attn_res(sources, norm_w, proj_w, eps), out_w, out_eps); with `addend`, the last source summed with
    it first, and (that, the sum) returned."""
    mixed, summed = with_partial_sum(sources, addend)
    y = rms_norm(attn_res(mixed, norm_w, proj_w, eps), out_w, out_eps)
    return y if summed is None else (y, summed)


def attn_res_norm_standard(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
                           out_w: torch.Tensor, out_eps: float, addend: torch.Tensor | None = None):
    """The add (a torch kernel), then the two ops' GPU standards in sequence: attn_res's torch composition, then
    FLA's fused RMSNorm."""
    from .attn_res_standard import attn_res_standard
    from .rms_norm_standard import rms_norm_standard

    mixed, summed = with_partial_sum(sources, addend)
    y = rms_norm_standard(attn_res_standard(mixed, norm_w, proj_w, eps), out_w, out_eps)
    return y if summed is None else (y, summed)


def signature(sources, norm_w, proj_w, eps, out_w, out_eps, addend=None):
    return (len(sources), sources[0].shape[-1], 1 + (addend is not None)), (norm_w.dtype,)


def cost(sources, norm_w, proj_w, eps, out_w, out_eps, addend=None):
    """Each source (and the addend) read once, the three weight vectors, the output (and the sum) written; scores,
    mix and norm are 7 FLOPs an output element a source or less, the add one."""
    m, (t, d), added = len(sources), sources[0].shape, int(addend is not None)
    return Cost(bytes=(m + 1 + 2 * added) * t * d * sources[0].element_size() + nbytes(norm_w, proj_w, out_w),
                flops=4 * m * t * d + 3 * t * d + added * t * d)


OP = Op("attn_res_norm", attn_res_norm, shapes=("sources", "hidden", "partial_terms"), dtypes=("weights",),
        signature_of=signature, cost_of=cost, gpu_standard="model.kimi_k3.ops.attn_res_norm:attn_res_norm_standard",
        standard_label="the add in torch, attn_res's torch composition, then FLA 0.6.0 fused RMSNorm (Triton)")
