"""kda_decode: the whole KDA step after the input projection, one token per sequence (SPEC.md §3).

    out = kda_decode(proj, conv_state, ssm_state, slots, w)       # conv_state, ssm_state updated in place

Layouts and the shared math are in `ops/kda.py`; the GPU standard (FLA's kernels) in `kda_decode_standard.py`.
"""

from __future__ import annotations

import torch

from .kda import KDAColumns, KDAWeights, conv_update, finish, prepare
from .op import Op

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


OP = Op("kda_decode", kda_decode, shapes=("heads", "head_dim"), dtypes=("weights", "ssm_state"),
        signature_of=signature, gpu_standard="model.kimi_k3.ops.kda_decode_standard:kda_decode_standard",
        standard_label="FLA 0.6.0: causal_conv1d_update, fused_recurrent_kda (gate, L2 norm, beta in kernel), "
                       "fused gated RMSNorm; cuBLAS f_b")
