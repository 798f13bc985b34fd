"""kda_decode: the whole KDA step after the input projection, one token per sequence (SPEC.md §3).

    out = kda_decode(proj, conv_state, ssm_state, slots, w)       # conv_state, ssm_state updated in place

Layouts and the shared math are in `ops/kda.py`; the GPU standard (FLA's kernels) in `kda_decode_standard.py`.
"""

from __future__ import annotations

import torch

from .kda import KDAColumns, KDAWeights, conv_update, finish, prepare
from .op import Cost, Op, nbytes


def kda_decode(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
               w: KDAWeights) -> torch.Tensor:
    """One decode token per sequence: the whole KDA step after the input projection, reference form.

    proj [B, W]; slots [B] index the caches; both caches are updated in place. Returns [B, P].
    """
    cols = KDAColumns.of(ssm_state, w)
    x = conv_update(proj[:, cols.qkv], conv_state, slots, w.conv_weight)
    q, k, v, g, beta = prepare(proj, x, cols, w)
    s = ssm_state[slots].float()  # [B, H, V, K]
    s = s * torch.exp(g).unsqueeze(2)
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", s, k))
    s = s + u.unsqueeze(-1) * k.unsqueeze(2)
    o = torch.einsum("bhvk,bhk->bhv", s, q)
    ssm_state[slots] = s.to(ssm_state.dtype)
    return finish(o, proj, cols, w)



def signature(proj, conv_state, ssm_state, slots, w):
    return (ssm_state.shape[1], ssm_state.shape[3]), (w.f_b.dtype, ssm_state.dtype)


def cost(proj, conv_state, ssm_state, slots, w):
    """The projection row, the slots' conv windows and fp32 states read and written back, the weights, the output;
    FLOPs: f_b, the short conv, and per head 7 K^2 (decay, S k, rank-1 update, S q)."""
    cols = KDAColumns.of(ssm_state, w)
    b, h, k, p, r = proj.shape[0], cols.heads, cols.head_dim, cols.p, cols.rank
    act, wc = proj.element_size(), conv_state.shape[-1]
    weights = nbytes(w.conv_weight, w.f_b, w.A_log, w.dt_bias, w.o_norm)
    moved = (b * cols.width * act + 2 * b * 3 * p * wc * conv_state.element_size()
             + 2 * b * h * k * k * ssm_state.element_size() + nbytes(slots) + b * p * act + weights)
    return Cost(bytes=moved, flops=2 * b * r * p + 2 * b * 3 * p * wc + 7 * b * h * k * k)


OP = Op("kda_decode", kda_decode, shapes=("heads", "head_dim"), dtypes=("weights", "ssm_state"),
        signature_of=signature, cost_of=cost, gpu_standard="model.kimi_k3.ops.kda_decode_standard:kda_decode_standard",
        standard_label="FLA 0.6.0: causal_conv1d_update, fused_recurrent_kda (gate, L2 norm, beta in kernel), "
                       "fused gated RMSNorm; cuBLAS f_b")
