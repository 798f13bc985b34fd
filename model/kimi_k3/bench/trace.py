"""What a layer's op calls are, what they cost, and where its kernels' time goes.

- `RecordingDispatcher` keeps every op call's name and arguments (for the cost model and for checking each op's
  standard against its reference on the very arguments the layer passed);
- `op_trace` runs closures eagerly under the profiler, each op call in a `record_function` range that ends with a
  device synchronize, so every kernel an op launched (cuBLAS, Triton, CuTe DSL alike) starts inside its op's range;
  it sums the kernels' device time and counts them per op. NCCL's kernels (a TP group's all-reduces and
  all-gathers, their wait for the other ranks included) are 'collectives'; other kernels outside any op (residual
  adds, splits) are 'glue'.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch

from ..dispatch import Dispatcher
from ..ops.op import Cost
from ..ops.registry import OPS

OP_RANGE = "op::"
GLUE = "glue"
COLLECTIVES = "collectives"


class RecordingDispatcher(Dispatcher):
    """A dispatcher that records each call `(op, args, kwargs)` when `calls` is a list, and opens a profiler range
    named after the op when `annotate` is set; the calls themselves run as the wrapped backend decides."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, tuple, dict]] | None = None
        self.results: list = []  # the recorded calls' outputs, in order
        self.annotate = False

    def call(self, name: str, *args, **kwargs):
        if self.calls is not None:
            self.calls.append((name, args, kwargs))
        if not self.annotate:
            out = super().call(name, *args, **kwargs)
        else:
            with torch.profiler.record_function(OP_RANGE + name):
                out = super().call(name, *args, **kwargs)
                torch.cuda.synchronize()  # the op's kernels run inside its range, so their start times place them
        if self.calls is not None:
            self.results.append(out)
        return out

    def record(self) -> None:
        """Start recording calls and their outputs afresh."""
        self.calls, self.results = [], []

    def routed(self) -> torch.Tensor | None:
        """The expert ids [T, k] of the first recorded moe_route call (None in a layer without the MoE)."""
        return next((out[0] for (name, _, _), out in zip(self.calls or [], self.results) if name == "moe_route"),
                    None)


def call_costs(calls: Sequence[tuple[str, tuple, dict]]) -> dict[str, Cost]:
    """Bytes and FLOPs per op summed over the recorded calls (the op's own cost model)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, args, kwargs in calls:
        cost = OPS[name].cost_of(*args, **kwargs)
        out[name][0] += cost.bytes
        out[name][1] += cost.flops
    return {name: Cost(b, f) for name, (b, f) in out.items()}


def op_trace(fns: Sequence[Callable[[], object]], ops: RecordingDispatcher) -> dict[str, dict]:
    """{op, 'collectives' or 'glue': {'us': device µs, 'kernels': count, 'names': {kernel: count}}} summed over one
    eager call of each closure; divide by len(fns) for one call's share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for fn in fns:  # warm: autotuners and compile caches stay out of the trace
        fn()
    torch.cuda.synchronize()
    ops.annotate = True
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for fn in fns:
                fn()
            torch.cuda.synchronize()
    finally:
        ops.annotate = False
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end, e.name.removeprefix(OP_RANGE))
                    for e in events if e.name.startswith(OP_RANGE))
    table: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "kernels": 0, "names": defaultdict(int)})
    for k in events:
        # device-side kernels only: not the ranges' own GPU annotations, synchronizations, copies or memsets
        if k.device_type != DeviceType.CUDA or k.name.startswith((OP_RANGE, "cuda", "Memcpy", "Memset")):
            continue
        start = k.time_range.start
        owner = COLLECTIVES if k.name.startswith("nccl") else next(
            (name for lo, hi, name in ranges if lo <= start <= hi), GLUE)
        row = table[owner]
        row["us"] += k.time_range.elapsed_us()
        row["kernels"] += 1
        row["names"][k.name] += 1
    return {name: {**row, "names": dict(row["names"])} for name, row in table.items()}
