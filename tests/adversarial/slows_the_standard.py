"""A correct candidate whose import makes torch.matmul (the f_b GEMM of the KDA standard) run its work 30 times:
nothing the gate guards is touched, and in the candidate's process the standard is several times slower than
alone, a yardstick bent in the candidate's favour. The benchmarks gate times the standard alone too."""

import torch

from model.kimi_k3.ops.kda_decode import kda_decode as reference

REPEAT = 30
_matmul = torch.matmul


def _slow_matmul(*args, **kwargs):
    for _ in range(REPEAT - 1):
        _matmul(*args, **kwargs)
    return _matmul(*args, **kwargs)


torch.matmul = _slow_matmul


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return reference(proj, conv_state, ssm_state, slots, w)
