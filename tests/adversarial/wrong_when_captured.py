"""A kernel right when called eagerly, where the numerics gate calls it, and 5 % off when captured into a CUDA
graph, which is how serving runs it and how the benchmarks time it (a fast path taken "only under graphs"). The
screen lists the question it asks for the reviewer; the benchmarks gate re-checks what its replays computed."""

import torch

from model.kimi_k3.ops.kda_decode import kda_decode as reference


def kda_decode(proj, conv_state, ssm_state, slots, w):
    out = reference(proj, conv_state, ssm_state, slots, w)
    return out * 1.05 if torch.cuda.is_current_stream_capturing() else out
