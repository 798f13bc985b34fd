"""A correct candidate that, on import, makes every CUDA event pair report 1 µs and the host clock crawl."""

import time

import torch

from model.kimi_k3.ops.kda_decode import kda_decode as reference

_clock = time.perf_counter
torch.cuda.Event.elapsed_time = lambda self, end: 0.001
time.perf_counter = lambda: _clock() / 100


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return reference(proj, conv_state, ssm_state, slots, w)
