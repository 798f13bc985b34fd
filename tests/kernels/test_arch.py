"""kernels.arch: detection on CPU, declared targets, arch string helpers."""

import pytest
import torch

from kernels.arch import ArchInfo, arch_from_capability, cute_arch_for, detect, known


def test_detect_never_raises_and_matches_device():
    info = detect()
    assert isinstance(info, ArchInfo)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert info.arch == f"sm_{major}{minor}" and info.sm_count > 0 and info.l2_bytes > 0
    else:
        assert info.arch == "cpu" and not info.is_gpu and info.cute_arch == "" and info.capability is None


def test_known_targets():
    h200 = known("sm_90")
    assert h200.cute_arch == "sm_90a" and h200.mem_bw_Bps == pytest.approx(4.3e12) and h200.capability == (9, 0)
    assert known("sm_90a").arch == "sm_90"
    gb300 = known("sm_100")
    assert gb300.cute_arch == "sm_100a" and not gb300.measured
    with pytest.raises(KeyError):
        known("sm_75")


def test_arch_strings():
    assert arch_from_capability(9, 0) == "sm_90"
    assert arch_from_capability(10, 0) == "sm_100"
    assert cute_arch_for("sm_90") == "sm_90a"
    assert cute_arch_for("sm_100") == "sm_100a"
    assert cute_arch_for("sm_80") == "sm_80"
    assert cute_arch_for("cpu") == ""


def test_frozen():
    with pytest.raises(Exception):
        known("sm_90").arch = "sm_80"
