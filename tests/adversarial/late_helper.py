"""The helper tests.adversarial.dynamic_helper loads at run time."""

from model.kimi_k3.ops.kda_decode import kda_decode


def step(proj, conv_state, ssm_state, slots, w):
    return kda_decode(proj, conv_state, ssm_state, slots, w)
