"""Subtly wrong decode kernels that numerics at one step can miss but accuracy must not (issue 25): each is the
reference with one mistake a real kernel could make, and a trained model's scores (gates/evals/accuracy.py) must
drop below the reference's. Same signatures as the references they stand in for:

    out = kda_decode(proj, conv_state, ssm_state, slots, w)           # conv_state, ssm_state updated in place
    y = moe_experts(z, ids, weights, w13, w2, beta, beta_lin)         # [T, L] fp32

Each is registered as its op's specialized kernel by `gates.evals.accuracy.kernel_path` (BROKEN lists them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from model.kimi_k3.ops.kda_decode import kda_decode
from model.kimi_k3.ops.registry import OPS

SKIP_EVERY = 64
_calls: Counter = Counter()  # decode calls per KDA state buffer (one per layer)


def decay_scaled(proj, conv_state, ssm_state, slots, w):
    """The log-decay g scaled by 1.01 (the gate's lower bound folded in one percent off): old state fades faster."""
    return kda_decode(proj, conv_state, ssm_state, slots, replace(w, lower_bound=w.lower_bound * 1.01))


def skips_update(proj, conv_state, ssm_state, slots, w):
    """Every 64th decode step of a layer leaves the recurrent state as it was (the output is still computed)."""
    _calls[ssm_state.data_ptr()] += 1
    if _calls[ssm_state.data_ptr()] % SKIP_EVERY:
        return kda_decode(proj, conv_state, ssm_state, slots, w)
    kept = ssm_state[slots].clone()
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    ssm_state[slots] = kept
    return out


def fp16_state(proj, conv_state, ssm_state, slots, w):
    """Keeps the recurrent state in fp16 between steps (rounded after every update)."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    ssm_state[slots] = ssm_state[slots].half().float()
    return out


def expert_id_off(z, ids, weights, w13, w2, beta, beta_lin):
    """Each token's last routed expert is read one id off (an off-by-one in the last top-k slot's index); the
    standard kernels compute the rest."""
    shifted = ids.clone()
    shifted[:, -1] = (shifted[:, -1] + 1) % w13[0].shape[0]
    standard = OPS["moe_experts"].standard(z.is_cuda)
    return standard(z, shifted, weights, w13, w2, beta, beta_lin)


BROKEN = {  # name: (op, implementation)
    "decay_x1.01": ("kda_decode", f"{__name__}:decay_scaled"),
    "skip_update_every_64": ("kda_decode", f"{__name__}:skips_update"),
    "fp16_state": ("kda_decode", f"{__name__}:fp16_state"),
    "expert_id_off": ("moe_experts", f"{__name__}:expert_id_off"),
}
