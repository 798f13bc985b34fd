"""gates.core.l2: the L2 set-aside read and released through the runtime calls bound at import (a fake runtime on
CPU, the real one on the GPU)."""

import pytest
import torch

from gates.core import l2


class _FakeRuntime:
    """cuda.bindings.runtime's shape for the three L2 calls: (error, value) tuples, the limit held here."""

    class cudaError_t:
        cudaSuccess, cudaErrorInsufficientDriver = object(), type("E", (), {"name": "cudaErrorInsufficientDriver"})()

    class cudaLimit:
        cudaLimitPersistingL2CacheSize = 6

    def __init__(self, limit: int, error=None):
        self.limit, self.error, self.resets = limit, error, 0

    def calls(self) -> dict:
        ok = self.error or self.cudaError_t.cudaSuccess

        def get(which):
            return ok, self.limit

        def set_(which, value):
            self.limit = value
            return (ok,)

        def reset():
            self.resets += 1
            return (ok,)

        return {"cudaDeviceGetLimit": get, "cudaDeviceSetLimit": set_, "cudaCtxResetPersistingL2Cache": reset}


def test_the_l2_set_aside_is_read_and_released_through_the_calls_bound_at_import(monkeypatch):
    fake = _FakeRuntime(limit=8 << 20)
    monkeypatch.setattr(l2, "cuda_runtime", fake)
    monkeypatch.setattr(l2, "_L2", fake.calls())
    assert l2.persisting_l2_bytes() == 8 << 20
    l2.release_persisting_l2()
    assert l2.persisting_l2_bytes() == 0 and fake.resets == 1


def test_a_failing_runtime_call_is_an_error_naming_the_call_and_its_error(monkeypatch):
    fake = _FakeRuntime(limit=0, error=_FakeRuntime.cudaError_t.cudaErrorInsufficientDriver)
    monkeypatch.setattr(l2, "cuda_runtime", fake)
    monkeypatch.setattr(l2, "_L2", fake.calls())
    with pytest.raises(RuntimeError, match="cudaDeviceGetLimit: cudaErrorInsufficientDriver"):
        l2.persisting_l2_bytes()
    monkeypatch.setattr(l2, "cuda_runtime", None)
    with pytest.raises(RuntimeError, match="cuda.bindings is not installed"):
        l2.release_persisting_l2()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_set_aside_made_in_the_process_is_read_and_released_on_the_gpu():
    torch.cuda.init()
    limit = l2.cuda_runtime.cudaLimit.cudaLimitPersistingL2CacheSize
    err, = l2.cuda_runtime.cudaDeviceSetLimit(limit, 4 << 20)
    assert err == l2.cuda_runtime.cudaError_t.cudaSuccess
    assert l2.persisting_l2_bytes() > 0  # the driver may round the request to its granularity
    l2.release_persisting_l2()
    assert l2.persisting_l2_bytes() == 0
