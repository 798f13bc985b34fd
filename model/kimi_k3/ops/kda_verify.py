"""kda_verify: speculative verification through KDA, 1 + K tokens per sequence (SPEC.md §8).

    out = kda_verify(proj, conv_state, ssm_state, slots, w, spec_conv, spec_ssm)

Position by position this is `kda_decode`, which defines the numerics.
"""

from __future__ import annotations

import torch

from .kda import KDAWeights
from .kda_decode import cost as kda_cost
from .kda_decode import kda_decode
from .op import Cost, Op, nbytes


def kda_verify(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
               w: KDAWeights, spec_conv: torch.Tensor, spec_ssm: torch.Tensor) -> torch.Tensor:
    """Speculative verification: 1 + K tokens per sequence (the last sampled token, then K drafts).

    proj [B, 1 + K, W]; slots [B]. Reads the committed caches at `slots` and leaves them unchanged;
    writes the conv window and state after each position t into spec_conv[slots, t] [3P, Wc] and
    spec_ssm[slots, t] [H, V, K], so that decoding can continue from any accepted position. Returns
    [B, 1 + K, P]. Position by position this is `kda_decode`, which defines the numerics.
    """
    rows = torch.arange(proj.shape[0], device=proj.device)
    conv, ssm = conv_state[slots], ssm_state[slots]  # working copies, indexed by row
    outs = []
    for t in range(proj.shape[1]):
        outs.append(kda_decode(proj[:, t], conv, ssm, rows, w))
        spec_conv[slots, t] = conv
        spec_ssm[slots, t] = ssm
    return torch.stack(outs, dim=1)


def signature(proj, conv_state, ssm_state, slots, w, spec_conv, spec_ssm):
    return (ssm_state.shape[1], ssm_state.shape[3]), (w.f_b.dtype, ssm_state.dtype)


def cost(proj, conv_state, ssm_state, slots, w, spec_conv, spec_ssm):
    """The committed states read once; the state after each of the 1 + K positions written to the spec buffers."""
    steps = proj.shape[1]
    one = kda_cost(proj[:, 0], conv_state, ssm_state, slots, w)
    state_write = nbytes(ssm_state[0]) + nbytes(conv_state[0])
    return Cost(bytes=steps * one.bytes - (steps - 1) * proj.shape[0] * state_write, flops=steps * one.flops)


OP = Op("kda_verify", kda_verify, shapes=("heads", "head_dim"), dtypes=("weights", "ssm_state"),
        signature_of=signature, cost_of=cost)
