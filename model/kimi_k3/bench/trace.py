"""What a layer's op calls are, what they cost, and where its kernels' time goes.

- `RecordingDispatcher` keeps every op call's name and arguments (for the cost model and for checking each op's
  standard against its reference on the very arguments the layer passed);
- `op_trace` runs closures eagerly under the profiler, each op call in a `record_function` range that ends with a
  device synchronize, so every kernel an op launched (cuBLAS, Triton, CuTe DSL alike) starts inside its op's range;
  it sums the kernels' device time and counts them per op. NCCL's kernels (a TP group's all-reduces and
  all-gathers, their wait for the other ranks included) are 'collectives'; other kernels outside any op (residual
  adds, splits) are 'glue';
- `tracking_blocks` charges each op call, and under `op_trace` each kernel (glue included), to the block of the layer
  it ran in (BLOCK_OF: attention, the MoE, layer 0's MLP, AttnRes), so a layer's time and bytes split per block.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ..dispatch import Dispatcher
from ..kda import KimiDeltaAttention
from ..mla import KimiMLA
from ..model import DecoderLayer
from ..moe import DenseMLP, LatentMoE
from ..ops.op import Cost
from ..ops.registry import OPS

OP_RANGE = "op::"
BLOCK_RANGE = "block::"
GLUE = "glue"
COLLECTIVES = "collectives"
OTHER = "other"  # the block of calls and kernels outside every BLOCK_OF module
# The block of a layer each module's forward is, the innermost running one deciding. A DecoderLayer's own forward,
# outside its attention and FFN, is AttnRes: the mixes, the sublayer input norms fused into them (attn_res_norm) and
# the partial sum's adds. The MoE's block holds its router, latent projections, experts, latent norm, shared experts
# (on a side stream) and its add.
BLOCK_OF: dict[type, str] = {DecoderLayer: "attn_res", KimiDeltaAttention: "attention", KimiMLA: "attention",
                             LatentMoE: "moe", DenseMLP: "mlp"}
BLOCKS = ("attn_res", "attention", "moe", "mlp", COLLECTIVES, OTHER)  # in a layer's order, for tables


class RecordingDispatcher(Dispatcher):
    """A dispatcher that records each call `(op, args, kwargs)` when `calls` is a list, and opens a profiler range
    named after the op when `annotate` is set; the calls themselves run as the wrapped backend decides."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, tuple, dict]] | None = None
        self.results: list = []  # the recorded calls' outputs, in order
        self.call_blocks: list[str] = []  # the block each recorded call ran in, in order
        self.block = OTHER  # the block running now (tracking_blocks sets it)
        self.annotate = False

    def call(self, name: str, *args, **kwargs):
        if self.calls is not None:
            self.calls.append((name, args, kwargs))
            self.call_blocks.append(self.block)
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
        """Start recording calls, their blocks and their outputs afresh."""
        self.calls, self.results, self.call_blocks = [], [], []

    def routed(self) -> torch.Tensor | None:
        """The expert ids [T, k] of the first recorded moe_route call (None in a layer without the MoE)."""
        return next((out[0] for (name, _, _), out in zip(self.calls or [], self.results) if name == "moe_route"),
                    None)


def call_costs(calls: Sequence[tuple[str, tuple, dict]], keys: Sequence[str] | None = None) -> dict[str, Cost]:
    """Bytes and FLOPs summed over the recorded calls (each op's own cost model): per op, or per `keys[i]` of call i
    (the dispatcher's `call_blocks`: per block)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for i, (name, args, kwargs) in enumerate(calls):
        cost = OPS[name].cost_of(*args, **kwargs)
        key = name if keys is None else keys[i]
        out[key][0] += cost.bytes
        out[key][1] += cost.flops
    return {key: Cost(b, f) for key, (b, f) in out.items()}


@contextlib.contextmanager
def tracking_blocks(ops: RecordingDispatcher, modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """While open, `ops.block` names the block (BLOCK_OF) of the innermost block module running among `modules` and
    their submodules, so each call `ops` records is charged to it. With `ops.annotate` (op_trace), each block
    module's forward also runs in a profiler range `block::NAME` with the device synchronized at its entry and its
    exit: the kernels issued before it finish before it opens, and every kernel it launched, on any stream (the MoE's
    shared experts run on a side stream), starts and ends inside it, so a kernel's start time places it."""
    open_blocks: list[tuple[str, torch.profiler.record_function | None]] = []  # (the block it interrupted, range)

    def enter(module, _args) -> None:
        block, opened = BLOCK_OF[type(module)], None
        if ops.annotate:
            torch.cuda.synchronize()
            opened = torch.profiler.record_function(BLOCK_RANGE + block)
            opened.__enter__()
        open_blocks.append((ops.block, opened))
        ops.block = block

    def leave(_module, _args, _output) -> None:
        ops.block, opened = open_blocks.pop()
        if opened is not None:
            torch.cuda.synchronize()
            opened.__exit__(None, None, None)

    hooks = [hook for module in modules for sub in module.modules() if type(sub) in BLOCK_OF
             for hook in (sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave, always_call=True))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def op_trace(fns: Sequence[Callable[[], object]], ops: RecordingDispatcher) -> tuple[dict[str, dict], dict[str, dict]]:
    """({op, 'collectives' or 'glue': row}, {block, 'collectives' or 'other': row}), each row {'us': device µs,
    'kernels': count, 'names': {kernel: count}} summed over one eager call of each closure; divide by len(fns) for
    one call's share. Blocks are traced where the closures run inside `tracking_blocks` (else all 'other')."""
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

    def ranges(prefix: str) -> list[tuple[float, float, str]]:
        return sorted((e.time_range.start, e.time_range.end, e.name.removeprefix(prefix))
                      for e in events if e.name.startswith(prefix))

    op_ranges, block_ranges = ranges(OP_RANGE), ranges(BLOCK_RANGE)
    per_op, per_block = _table(), _table()
    for k in events:
        # device-side kernels only: not the ranges' own GPU annotations, synchronizations, copies or memsets
        if k.device_type != DeviceType.CUDA or k.name.startswith((OP_RANGE, BLOCK_RANGE, "cuda", "Memcpy", "Memset")):
            continue
        start, nccl = k.time_range.start, k.name.startswith("nccl")
        for table, owner in ((per_op, COLLECTIVES if nccl else _innermost(start, op_ranges, GLUE)),
                             (per_block, COLLECTIVES if nccl else _innermost(start, block_ranges, OTHER))):
            row = table[owner]
            row["us"] += k.time_range.elapsed_us()
            row["kernels"] += 1
            row["names"][k.name] += 1
    return ({name: {**row, "names": dict(row["names"])} for name, row in per_op.items()},
            {name: {**row, "names": dict(row["names"])} for name, row in per_block.items()})


def _table() -> defaultdict[str, dict]:
    return defaultdict(lambda: {"us": 0.0, "kernels": 0, "names": defaultdict(int)})


def _innermost(start: float, ranges: Sequence[tuple[float, float, str]], default: str) -> str:
    """The name of the innermost of `ranges` (sorted by start; nested or disjoint, as one thread opens them) holding
    `start`: the last-opened one that holds it; `default` where none does."""
    inner = default
    for lo, hi, name in ranges:
        if lo > start:
            break
        if start <= hi:
            inner = name
    return inner
