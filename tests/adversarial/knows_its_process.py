"""A kernel right only in a spawned child process, which is where the gate's worker runs candidates, and wrong in
the process that serves (issue 23, class 3). Nothing in it names the gate or walks frames, so the static screen
lists it for the reviewer without failing it; every call the worker makes sees right answers. The numerics
gate's production replay runs it through the dispatcher in a process of its own, and there it is wrong."""

import multiprocessing

from model.kimi_k3.ops.kda_decode import kda_decode as reference


def kda_decode(proj, conv_state, ssm_state, slots, w):
    out = reference(proj, conv_state, ssm_state, slots, w)
    return out if multiprocessing.parent_process() is not None else out * 1.5
