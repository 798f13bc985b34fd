"""kernels.timing: statistics on CPU; graph timing and kernel counting on the GPU."""

import pytest
import torch

from kernels.timing import quartiles, summarize


def test_quartiles_and_summary():
    q1, med, q3 = quartiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (q1, med, q3) == (2.0, 3.0, 4.0)
    assert quartiles([7.0]) == (7.0, 7.0, 7.0)
    r = summarize([1.0, 2.0, 3.0, 4.0, 5.0], "test", host_us=[10.0, 30.0, 20.0])
    assert r.median_us == 3.0 and r.iqr_us == 2.0 and r.min_us == 1.0 and r.n == 5
    assert r.host_median_us == 20.0
    d = r.as_dict()
    assert d["iqr_us"] == 2.0 and "samples_us" not in d


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_op_and_count_kernels():
    from kernels.timing import count_kernels, time_op

    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)

    def op():
        torch.mul(x, 2.0, out=y)
        y.add_(1.0)

    r = time_op(op, iters=50, host_iters=10)
    assert 0 < r.median_us < 1000 and r.q1_us <= r.median_us <= r.q3_us and r.host_median_us > 0
    assert count_kernels(op) == 2
    rot = time_op([op, op], iters=20, flush="rotate", host_iters=5)
    assert rot.n == 20
