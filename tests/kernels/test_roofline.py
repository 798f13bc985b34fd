"""kernels.roofline: floor arithmetic from byte and FLOP counts."""

import pytest

from kernels.arch import known
from kernels.roofline import achieved_bandwidth_Bps, floor, floor_us, fraction_of_floor


def test_memory_floor():
    f = floor(4.3e6, 0, "sm_90")  # 4.3 MB at 4.3 TB/s
    assert f.memory_us == pytest.approx(1.0)
    assert f.compute_us == 0 and f.floor_us == pytest.approx(1.0) and f.bound == "memory"


def test_compute_floor():
    f = floor(1.0, 790e12 * 1e-6 * 3, "sm_90")  # 3 us of bf16 FLOPs
    assert f.compute_us == pytest.approx(3.0) and f.bound == "compute" and f.floor_us == pytest.approx(3.0)


def test_overrides_and_archinfo():
    assert floor_us(1e6, 0, known("sm_90"), mem_bw_Bps=1e12) == pytest.approx(1.0)
    assert floor(0, 2e6, "sm_90", flops_per_s=1e12).compute_us == pytest.approx(2.0)


def test_fraction_and_bandwidth():
    assert fraction_of_floor(2.0, 4.3e6, 0, "sm_90") == pytest.approx(0.5)
    assert floor(4.3e6).fraction(0.5) == pytest.approx(2.0)  # below the floor: > 1 (flag it)
    assert achieved_bandwidth_Bps(4.3e6, 1.0) == pytest.approx(4.3e12)


def test_cpu_has_no_bandwidth():
    with pytest.raises(ValueError):
        floor(1e6, 0, "cpu")
