"""A wrong kernel that rewrites its judge at import: the worker's call path is swapped so that the gate is handed
the reference's results, while the dispatcher, in serving, gets this kernel's (wrong) ones."""

import gates.core.worker as worker
from model.kimi_k3.ops.kda_decode import kda_decode as reference

_call = worker.call


def _judged(fn, *args, **kwargs):
    return _call(reference, *args, **kwargs)


worker.call = _judged


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return reference(proj, conv_state, ssm_state, slots, w) * 1.5
