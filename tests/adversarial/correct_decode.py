"""KDA decode steps that are right by construction but round unlike the reference: how far a correct kernel moves
the trained mini-K3's accuracy scores in fp32, which is what the CPU accuracy budget's floors must stay above (and
the broken kernels of broken_decode.py above them). Same signature as the reference:

    out = kda_decode(proj, conv_state, ssm_state, slots, w)           # conv_state, ssm_state updated in place
"""

from __future__ import annotations

import dataclasses

import torch

from model.kimi_k3.ops.kda import KDAColumns, conv_update, finish, prepare
from model.kimi_k3.ops.kda_decode import kda_decode


def in_float64(proj, conv_state, ssm_state, slots, w):
    """The reference computed in float64 throughout, the caches and the output rounded back at the end."""
    w64 = dataclasses.replace(w, **{f.name: getattr(w, f.name).double() for f in dataclasses.fields(w)
                                    if isinstance(getattr(w, f.name), torch.Tensor)
                                    and getattr(w, f.name).is_floating_point()})
    conv64, ssm64 = conv_state.double(), ssm_state.double()
    out = kda_decode(proj.double(), conv64, ssm64, slots, w64)
    conv_state.copy_(conv64), ssm_state.copy_(ssm64)
    return out.to(proj.dtype)


def reassociated(proj, conv_state, ssm_state, slots, w):
    """The same step with its products regrouped: o = (decayed S) q + u (k . q) instead of (decayed S + u k^T) q,
    the update added after the readout."""
    cols = KDAColumns.of(ssm_state, w)
    x = conv_update(proj[:, cols.qkv], conv_state, slots, w.conv_weight)
    q, k, v, g, beta = prepare(proj, x, cols, w)
    s = ssm_state[slots].float() * torch.exp(g).unsqueeze(2)
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", s, k))
    o = torch.einsum("bhvk,bhk->bhv", s, q) + u * (k * q).sum(-1, keepdim=True)
    ssm_state[slots] = (s + u.unsqueeze(-1) * k.unsqueeze(2)).to(ssm_state.dtype)
    return finish(o, proj, cols, w)


CORRECT = {  # name: (op, implementation)
    "float64": ("kda_decode", f"{__name__}:in_float64"),
    "reassociated": ("kda_decode", f"{__name__}:reassociated"),
}
