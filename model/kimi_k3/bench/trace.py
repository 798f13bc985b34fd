"""What a layer's op calls are, what they cost, and where its kernels' time goes.

- `RecordingDispatcher` keeps every op call's name and arguments (for the cost model and for checking each op's
  standard against its reference on the very arguments the layer passed);
- `op_trace` runs closures eagerly under the profiler with each op call in a `record_function` range and sums the
  device time and count of the kernels under each op; kernels outside any op (residual adds, splits) are 'glue'.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from typing import Callable, Sequence

import torch

from ..dispatch import Dispatcher
from ..ops.op import Cost
from ..ops.registry import OPS

OP_RANGE = "op::"
GLUE = "glue"


class RecordingDispatcher(Dispatcher):
    """A dispatcher that records each call `(op, args, kwargs)` when `calls` is a list, and opens a profiler range
    named after the op when `annotate` is set; the calls themselves run as the wrapped backend decides."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, tuple, dict]] | None = None
        self.annotate = False

    def call(self, name: str, *args, **kwargs):
        if self.calls is not None:
            self.calls.append((name, args, kwargs))
        scope = torch.profiler.record_function(OP_RANGE + name) if self.annotate else nullcontext()
        with scope:
            return super().call(name, *args, **kwargs)


def call_costs(calls: Sequence[tuple[str, tuple, dict]]) -> dict[str, Cost]:
    """Bytes and FLOPs per op summed over the recorded calls (the op's own cost model)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, args, kwargs in calls:
        cost = OPS[name].cost_of(*args, **kwargs)
        out[name][0] += cost.bytes
        out[name][1] += cost.flops
    return {name: Cost(b, f) for name, (b, f) in out.items()}


def _kernels(evt) -> list:
    found = list(evt.kernels)
    for child in evt.cpu_children:
        found += _kernels(child)
    return found


def op_trace(fns: Sequence[Callable[[], object]], ops: RecordingDispatcher) -> dict[str, dict]:
    """{op or 'glue': {'us': device µs, 'kernels': count, 'names': {kernel: count}}} summed over one eager call of
    each closure; divide by len(fns) for one call's share."""
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
    table: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "kernels": 0, "names": defaultdict(int)})
    seen = set()
    for evt in prof.events():
        if not evt.name.startswith(OP_RANGE):
            continue
        row = table[evt.name.removeprefix(OP_RANGE)]
        for k in _kernels(evt):
            seen.add(id(k))
            row["us"] += k.duration
            row["kernels"] += 1
            row["names"][k.name] += 1
    for evt in prof.events():
        if evt.name.startswith(OP_RANGE) or evt.cpu_parent is not None:
            continue
        for k in _kernels(evt):
            if id(k) not in seen:
                seen.add(id(k))
                row = table[GLUE]
                row["us"] += k.duration
                row["kernels"] += 1
                row["names"][k.name] += 1
    return {name: {**row, "names": dict(row["names"])} for name, row in table.items()}
