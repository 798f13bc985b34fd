"""A correct candidate whose import makes the standard's f_b GEMM run 30 times: in the candidate's process the
standard is several times slower than alone, a yardstick bent in the candidate's favour. The benchmarks gate
times the standard alone too."""

from model.kimi_k3.ops.kda_decode import kda_decode as reference
from tests.adversarial.repeats_matmul import repeat_matmul

repeat_matmul(30)


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return reference(proj, conv_state, ssm_state, slots, w)
