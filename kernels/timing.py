"""GPU timing for decode-sized work: CUDA-graph replay, cold L2, median and IQR, host wall time.

Method (gates/PRACTICES.md):
- the op is captured once in a CUDA graph (launch gaps inside the op are still counted: they are
  part of its device time);
- before every timed replay the L2 is made cold, either by writing a buffer of 2x the L2 size
  (`flush="l2"`, the default) or by replaying graphs captured on `rotate` distinct input sets whose
  footprint together exceeds the L2 (`flush="rotate"`);
- after the flush a spin kernel holds the stream while the host enqueues the start event, the replay and
  the end event (NVBench's blocking kernel), so the events time the GPU's work, never the host's enqueueing
  (a replay the host has not submitted when the stream reaches the start event would be charged the host's
  delay);
- each replay is bracketed by CUDA events on the capture stream: `device_us` statistics;
- separately, host wall time of replay + full device synchronize: `host_us` statistics, which catch
  work hidden on other streams.

    >>> from kernels.timing import time_op, count_kernels
    >>> r = time_op(lambda: my_op(*args), iters=200)
    >>> r.median_us, r.iqr_us, r.host_median_us
    >>> count_kernels(lambda: my_op(*args))   # kernels launched per call, all streams
    >>> time_pipeline([lambda a=a: my_op(*a) for a in input_sets])   # in-pipeline: N calls in one graph
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

PAD_CYCLES = 200_000  # the spin before a timed replay: ~100 us at H200 clocks, longer than the host's enqueueing


@dataclass(frozen=True)
class TimingResult:
    median_us: float
    q1_us: float
    q3_us: float
    min_us: float
    mean_us: float
    n: int
    host_median_us: float | None
    method: str
    samples_us: tuple[float, ...] = field(default=(), repr=False)

    @property
    def iqr_us(self) -> float:
        return self.q3_us - self.q1_us

    def as_dict(self, samples: bool = False) -> dict:
        d = asdict(self)
        d["iqr_us"] = self.iqr_us
        if not samples:
            d.pop("samples_us")
        return d


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3) with linear interpolation; works for any n >= 1."""
    xs = sorted(samples)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def summarize(samples_us: Sequence[float], method: str, host_us: Sequence[float] | None = None) -> TimingResult:
    q1, med, q3 = quartiles(samples_us)
    return TimingResult(median_us=med, q1_us=q1, q3_us=q3, min_us=min(samples_us),
                        mean_us=statistics.fmean(samples_us), n=len(samples_us),
                        host_median_us=statistics.median(host_us) if host_us else None,
                        method=method, samples_us=tuple(samples_us))


class L2Flusher:
    """Writes a buffer of `factor` x L2 bytes; after it, no earlier data is left in the L2."""

    def __init__(self, device=None, factor: int = 2, l2_bytes: int | None = None):
        import torch

        if l2_bytes is None:
            props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
            l2_bytes = int(getattr(props, "L2_cache_size", 0) or 60 * 1024 * 1024)
        self.nbytes = factor * l2_bytes
        self.buf = torch.empty(self.nbytes // 4, dtype=torch.int32, device=device or "cuda")

    def __call__(self) -> None:
        self.buf.fill_(0x5A5A5A5A)


def capture_graph(fn: Callable[[], object], warmup: int = 3, stream=None):
    """Warm `fn` up on a side stream (autotuners, compile caches), then capture it in a CUDA graph."""
    import torch

    s = stream or torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_graphs(graphs: Sequence, iters: int = 200, flush: str = "l2", host_iters: int = 50,
                flusher: L2Flusher | None = None) -> TimingResult:
    """Time replays of already-captured graphs, cycling through them (one graph per input set).

    flush: 'l2' writes a 2xL2 buffer before every replay; 'rotate' relies on the rotation alone
    (the graphs' inputs together must exceed the L2); 'none' times a warm L2.
    """
    import torch

    if flush not in ("l2", "rotate", "none"):
        raise ValueError(f"flush must be 'l2', 'rotate' or 'none', got {flush!r}")
    fl = (flusher or L2Flusher()) if flush == "l2" else None
    stream = torch.cuda.current_stream()
    for g in graphs:  # warm replays
        g.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if fl is not None:
            fl()
        torch.cuda._sleep(PAD_CYCLES)
        starts[i].record(stream)
        graphs[i % len(graphs)].replay()
        ends[i].record(stream)
    torch.cuda.synchronize()
    device_us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    host_us = []
    for i in range(host_iters):
        if fl is not None:
            fl()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs[i % len(graphs)].replay()
        torch.cuda.synchronize()
        host_us.append((time.perf_counter() - t0) * 1e6)
    method = f"cuda-graph replay, events, flush={flush}, graphs={len(graphs)}"
    return summarize(device_us, method, host_us)


def time_op(fn: Callable[[], object] | Sequence[Callable[[], object]], iters: int = 200, flush: str = "l2",
            warmup: int = 3, host_iters: int = 50) -> TimingResult:
    """Capture `fn` (or each of a list of closures over distinct input sets) in a CUDA graph and time it.

    A list of closures with flush='rotate' gives buffer rotation instead of an explicit L2 flush.
    """
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    graphs = [capture_graph(f, warmup=warmup) for f in fns]
    return time_graphs(graphs, iters=iters, flush=flush, host_iters=host_iters)


def capture_pipeline(fns: Sequence[Callable[[], object]], flusher: L2Flusher | None = None, warmup: int = 3):
    """One CUDA graph that calls every closure of `fns` in order (with an L2 flush before each one when a flusher
    is given): many distinct layers or input sets in one replay, as a decode step runs them."""
    def run_all() -> None:
        for fn in fns:
            if flusher is not None:
                flusher()
            fn()

    return capture_graph(run_all, warmup=warmup)


def time_pipeline(fns: Sequence[Callable[[], object]], iters: int = 50, flush_each: bool = False,
                  warmup: int = 3) -> TimingResult:
    """Per-call time of `fns` (closures over N distinct input sets) run back to back in one CUDA graph: the graph's
    launch latency is paid once for N calls, as a decode step pays it once for all its layers.

    Without `flush_each` the inputs must together exceed the L2 (distinct weights of several layers do), and each
    sample is replay time / N after an L2 flush. With it, an L2 flush precedes every call, and the same flushes
    alone are timed in an identical graph replayed in alternation with it: each sample is
    (replay - flushes-only replay) / N, so ops whose inputs fit the L2 are timed cold too.
    """
    import torch

    n = len(fns)
    if n < 1:
        raise ValueError("time_pipeline needs at least one closure")
    flusher = L2Flusher()
    timed = capture_pipeline(fns, flusher if flush_each else None, warmup)
    baseline = capture_pipeline([lambda: None] * n, flusher, warmup=1) if flush_each else None
    graphs = [timed] + ([baseline] if baseline else [])
    stream = torch.cuda.current_stream()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
              for _ in range(iters)]
    for pairs in events:
        for g, (start, end) in zip(graphs, pairs):
            flusher()
            torch.cuda._sleep(PAD_CYCLES)
            start.record(stream)
            g.replay()
            end.record(stream)
    torch.cuda.synchronize()
    samples = []
    for pairs in events:
        times = [s.elapsed_time(e) * 1e3 for s, e in pairs]
        samples.append((times[0] - (times[1] if baseline else 0.0)) / n)
    method = (f"in-pipeline: {n} distinct calls in one CUDA graph, "
              + ("L2 flushed before each, the flushes' own graph subtracted" if flush_each
                 else "L2 flushed before the replay, inputs together beyond the L2"))
    return summarize(samples, method)


def time_eager(fn: Callable[[], object], iters: int = 100, flush: str = "l2", warmup: int = 3) -> TimingResult:
    """Events around eager calls (no graph): includes launch overhead; for ops that cannot be captured."""
    import torch

    fl = L2Flusher() if flush == "l2" else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        if fl is not None:
            fl()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) * 1e3)
    return summarize(samples, f"eager, events, flush={flush}")


def count_kernels(fn: Callable[[], object], warmup: int = 2) -> int:
    """Number of GPU kernels one call of `fn` launches, on all streams (torch.profiler, CUDA activity).

    Memset/memcpy activities are not counted as kernels.
    """
    return len(kernel_names(fn, warmup))


def kernel_names(fn: Callable[[], object], warmup: int = 2) -> list[str]:
    """Names of the GPU kernels one call of `fn` launches, on all streams; memset/memcpy activities left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for ev in prof.events():
        dev_type = getattr(ev, "device_type", None)
        if dev_type is not None and "CUDA" not in str(dev_type):
            continue
        name = ev.name or ""
        if name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")) or name.startswith("cuda"):
            continue
        names.append(name)
    return names
