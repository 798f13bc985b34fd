"""A correct candidate whose import makes the standard's f_b GEMM run twice: the standard beside it is slower by
one small GEMM, under the ERROR the yardstick's time alone sets; it launches one kernel more than alone."""

from model.kimi_k3.ops.kda_decode import kda_decode as reference
from tests.adversarial.repeats_matmul import repeat_matmul

repeat_matmul(2)


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return reference(proj, conv_state, ssm_state, slots, w)
