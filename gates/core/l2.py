"""The L2 set-aside for persisting accesses, which the benchmarks read and release, and a probe of what survives
their flush.

A process can set aside part of the L2 for persisting accesses (cudaLimitPersistingL2CacheSize, device-wide) and mark
a kernel's accesses persisting (an access policy window on a stream or a graph's kernel node): such lines cannot be
evicted by normal accesses, so they outlive the benchmarks' flush (kernels.timing.L2Flusher: normal writes) and a
timed call starts warm, where a decode step's other layers would have evicted them. BenchSession
(gates.core.worker) reads the set-aside after the implementations ran (`persisting_l2_bytes`) and releases it before
anything is timed (`release_persisting_l2`).

`python -m gates.core.l2 [--json F]` (GPU only) times one read of a buffer of a quarter of the L2 (a Triton kernel,
CUDA events, median of `--iters`) after each of these histories:
- cold: the flush alone (the floor of a cold read);
- warm: read just before, no flush (the L2 hit time);
- flushed: read, then the flush;
- evict_last, flushed: read with PTX evict_last hints (Triton's eviction_policy), then the flush;
- persisting, flushed: an L2 set-aside and an access policy window over the buffer on the stream, read, flush;
- persisting, released, flushed: the same, with `release_persisting_l2()` before the flush (what BenchSession does).
A row near `warm` names a history whose lines outlive the flush; the benchmarks rely on every flushed row reading as
`cold` once the set-aside is released (gates/PRACTICES.md records the H200's answer).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from kernels.timing import L2Flusher

try:  # the CUDA runtime's Python bindings, a dependency of the CuTe DSL (absent: no GPU timing here either)
    from cuda.bindings import runtime as cuda_runtime
except ImportError:
    cuda_runtime = None
# What the set-aside is read and released with, bound once at import: the worker imports this module before any
# candidate code and reports a replaced one (gates.core.worker.GUARDED), so these are never a candidate's.
L2_CALLS = ("cudaDeviceGetLimit", "cudaDeviceSetLimit", "cudaCtxResetPersistingL2Cache")
_L2 = {name: getattr(cuda_runtime, name) for name in L2_CALLS} if cuda_runtime is not None else {}


def _runtime():
    if cuda_runtime is None:
        raise RuntimeError("cuda.bindings is not installed: the L2 set-aside cannot be read or released")
    return cuda_runtime


def _checked(name: str, reply: tuple):
    """A runtime call's (error, value...) reply: its value, or RuntimeError naming the call and its error."""
    err, *value = reply
    if err != _runtime().cudaError_t.cudaSuccess:
        raise RuntimeError(f"{name}: {err.name}")
    return value[0] if value else None


def _l2_call(name: str, *args):
    """The runtime call `name` (one of L2_CALLS) as bound at import, checked."""
    _runtime()
    return _checked(name, _L2[name](*args))


def persisting_l2_bytes() -> int:
    """Bytes of the current device's L2 set aside for persisting accesses: 0 unless code in this process asked."""
    return int(_l2_call("cudaDeviceGetLimit", _runtime().cudaLimit.cudaLimitPersistingL2CacheSize))


def release_persisting_l2() -> None:
    """No L2 set aside for persisting accesses, and every line kept persisting so far normal again: from here a
    flush of normal accesses evicts everything, whatever access policy a kernel carries."""
    _l2_call("cudaDeviceSetLimit", _runtime().cudaLimit.cudaLimitPersistingL2CacheSize, 0)
    _l2_call("cudaCtxResetPersistingL2Cache")


BLOCK = 4096


@functools.cache
def _reader():
    """The Triton read kernel (Triton comes with torch's CUDA builds only)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src, out, n, EVICT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n, other=0, eviction_policy=EVICT)
        # a use of every value, so no load is dropped; one sum a block (an atomic onto one word serialized the blocks
        # and hid the read: 35 us warm or cold on the H200, session 25)
        tl.store(out + tl.program_id(0), tl.sum(x, axis=0))

    return read_kernel


def blocks(buf: torch.Tensor) -> int:
    return -(-buf.numel() // BLOCK)


def read(buf: torch.Tensor, out: torch.Tensor, evict: str = "") -> None:
    """Every element of `buf` read once; `out` holds one sum a block (blocks(buf) elements)."""
    _reader()[(blocks(buf),)](buf, out, buf.numel(), EVICT=evict, BLOCK=BLOCK)


def _window(buf: torch.Tensor, persisting: bool) -> None:
    """The current stream's access policy window: persisting over `buf`, or none (num_bytes 0)."""
    rt = cuda_runtime
    value = rt.cudaStreamAttrValue()
    w = value.accessPolicyWindow
    w.base_ptr, w.num_bytes = (buf.data_ptr(), buf.numel() * buf.element_size()) if persisting else (0, 0)
    w.hitRatio = 1.0
    w.hitProp = rt.cudaAccessProperty.cudaAccessPropertyPersisting
    w.missProp = rt.cudaAccessProperty.cudaAccessPropertyStreaming
    _checked("cudaStreamSetAttribute", rt.cudaStreamSetAttribute(
        torch.cuda.current_stream().cuda_stream, rt.cudaStreamAttrID.cudaLaunchAttributeAccessPolicyWindow, value))


def _timed_read(buf, out) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    read(buf, out)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def probe(iters: int) -> dict:
    flush = L2Flusher()
    l2 = flush.nbytes // 2
    buf = torch.randint(0, 100, (l2 // 4 // 4,), dtype=torch.int32, device="cuda")
    out = torch.zeros(blocks(buf), dtype=torch.int32, device="cuda")
    limit = cuda_runtime.cudaLimit.cudaLimitPersistingL2CacheSize

    def persist():
        _checked("cudaDeviceSetLimit", cuda_runtime.cudaDeviceSetLimit(limit, buf.numel() * buf.element_size()))
        _window(buf, True)
        read(buf, out)

    def released():
        persist()
        release_persisting_l2()

    histories = {
        "cold": (lambda: None, True),
        "warm": (lambda: read(buf, out), False),
        "flushed": (lambda: read(buf, out), True),
        "evict_last, flushed": (lambda: read(buf, out, "evict_last"), True),
        "persisting, flushed": (persist, True),
        "persisting, released, flushed": (released, True),
    }
    read(buf, out), read(buf, out, "evict_last")  # compile both variants
    rows = {}
    for name, (before, flushed) in histories.items():
        samples = []
        for _ in range(iters):
            before()
            if flushed:
                flush()
            torch.cuda.synchronize()
            samples.append(_timed_read(buf, out))
            _window(buf, False)
            release_persisting_l2()
        rows[name] = statistics.median(samples)
    return {"device": torch.cuda.get_device_name(), "l2_bytes": l2, "buffer_bytes": buf.numel() * 4,
            "set_aside_after_release": persisting_l2_bytes(), "median_us": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gates.core.l2",
                                     description="What survives the benchmarks' L2 flush (GPU only; see the module)")
    parser.add_argument("--iters", type=int, default=50, help="timed reads a history (default 50)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    result = probe(args.iters)
    for name, us in result["median_us"].items():
        print(f"{name:32s} {us:8.2f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
