"""`bench layer` and `bench step`: K3 decode on the GPU at real rank shapes, timed as a decode step runs.

Layer bench, per (layer kind, TP size, batch), for each backend (`auto`: every op's standard; `latency_specialized`:
every contracted kernel inside its envelope; `declared`: as latency_specialized, with the kernels whose contracts
only declare this arch counted as validated, to measure kernels still waiting for their gate; its rows are never
evidence: `k3forge evidence decode` refuses them):
- in-pipeline time: N distinct layers (their weights together far beyond the L2) captured back to back in one CUDA
  graph, replay time / N (kernels.timing.time_pipeline), beside the one-layer-per-graph time with the L2 flushed
  (launch latency included, as the benchmark gate used to time ops);
- kernels per layer and a per-op breakdown from an eager profiler trace, and a per-block one (attention, MoE or
  MLP, AttnRes: `trace.tracking_blocks`) with each block's bytes and floor;
- bytes the layer must move (each op's own cost model over the calls it made; only the experts routed to) and the
  fraction of the bandwidth floor, at the copy bandwidth measured on the device (`floor_bandwidth`);
- correctness on the same weights: each backend's layer output against the reference layer's, and every op
  call's standard against its reference within the op's `standard_tolerance`.
Collectives are excluded (one rank of the TP group on one GPU), and so is the drafter in speculative mode; or, with
`bench_layers_on_ranks` (`bench layer --collectives`), every rank of a real TP group runs the same layers at its
own shapes with the all-reduces (NCCL on GPUs, one process per GPU, captured in the timed graphs), and a row's
time is its slowest rank's.
"""

from __future__ import annotations

import functools
import gc
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from kernels import arch as arch_info
from kernels.timing import count_kernels, time_op, time_pipeline

from ..config import KimiK3Config
from ..dispatch import DECODE_BACKENDS, Dispatcher, Reason, Target, judged_here
from ..distributed import BACKENDS
from ..errors import UsageError
from ..ops import moe_experts_standard
from ..ops.op import Cost
from ..ops.registry import OPS, load_specialized
from ..parallel import TP
from .layers import BenchLayer, build_layer, layer_ids, planned_bytes, standard_copy_bytes
from .trace import BLOCKS, RecordingDispatcher, call_costs, op_trace, tracking_blocks

DECLARED = "declared"  # the bench-only backend (module doc)
BENCH_BACKENDS = (*DECODE_BACKENDS, DECLARED)
LAYER_OUTPUT_REL_L2 = 2e-2  # a bf16 layer against the reference layer: many bf16 roundings, none amplified
HEADROOM_BYTES = 8 << 30  # left free on the device for graphs, workspaces and temporaries
FLOOR_ARCH_OFF_GPU = "sm_90"  # whose declared bandwidth the floors take off a GPU (CI's tiny shapes)


class BenchError(UsageError):
    """A request the device cannot hold or the bench cannot run; the message says what fits (one line, exit 2)."""


@dataclass
class LayerRow:
    kind: str
    tp: int
    batch: int
    context: int
    backend: str
    layers_in_graph: int
    us: float | None  # in-pipeline, per layer (None where no GPU times it)
    us_q1: float | None
    us_q3: float | None
    us_one_per_graph: float | None
    kernels: int | None
    bytes: float
    floor_us: float
    fraction_of_floor: float | None
    ops: dict[str, dict] = field(default_factory=dict)  # per-op trace rows
    blocks: dict[str, dict] = field(default_factory=dict)  # per block of the layer: µs, kernels, bytes, floor_us
    dispatch: dict = field(default_factory=dict)  # specialized / standard calls and fallback reasons per op
    output_rel_l2: float | None = None  # vs the reference layer, every token
    output_rel_l2_same_routing: float | None = None  # over the tokens routed to the same experts as the reference
    routing_flips: int = 0  # tokens whose experts differ from the reference's (near-tied router keys)
    op_checks: dict[str, dict] = field(default_factory=dict)  # standard vs reference per op (auto only)
    collectives: str = "excluded"  # or the TP group's backend ("nccl"; "gloo" untimed on CPU): the all-reduces ran
    kv_cache: str = "auto"  # the MLA cache's dtype ("fp8": e4m3, ModelCache)
    ranks_us: list[float | None] | None = None  # with collectives: each rank's in-pipeline µs (`us` the slowest)
    floor_bandwidth_Bps: float | None = None  # the copy bandwidth floor_us is at (FloorBandwidth)
    floor_bandwidth_source: str | None = None  # measured on which device, or declared for which arch

    def as_dict(self) -> dict:
        return asdict(self)


def target(tp_size: int, device: torch.device) -> Target:
    info = arch_info.detect(device)
    return Target(info.arch, info.device_name, tp_size, torch.bfloat16)


def dispatcher(backend: str, tgt: Target) -> RecordingDispatcher:
    if backend == DECLARED:
        declared = {op: s for op, s in load_specialized().items()
                    if tgt.arch in (*s.contract.archs_validated, *(h.arch for h in s.contract.hardware.declared))}
        specialized = {op: replace(s, contract=judged_here(s.contract, tgt)) for op, s in declared.items()}
        return RecordingDispatcher(tgt, "latency_specialized", specialized)
    specialized = load_specialized(arch=tgt.arch) if backend == "latency_specialized" else {}
    return RecordingDispatcher(tgt, backend, specialized)


class ReferenceDispatcher(RecordingDispatcher):
    """Every op's reference, whatever the device: the numerics ground truth for a whole layer."""

    def _standard_fn(self, name: str) -> Callable:
        return OPS[name].reference


def free_device_bytes(device: torch.device) -> int | None:
    """The device's free bytes once this process holds only what is still alive (None off a GPU: nothing to fit).
    It is called before a point builds its layers, when the earlier point's are gone; but the caching allocator keeps
    their blocks, and the MXFP4 experts' standard keeps each prepared weight set's repacked copy (~2 GB per MoE layer
    at TP8) until its cache is cleared: both are released first, so they count as free (run 13: 32.3 GiB read free
    after `bench step` batch 1, on an 80 GB H100). A live layer whose set is dropped is prepared again by its first
    eager call, which every point makes before it captures a graph."""
    if device.type != "cuda":
        return None
    gc.collect()  # an earlier point's layers held only in reference cycles
    moe_experts_standard.clear_cache()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def fit_count(cfg: KimiK3Config, ids: Sequence[int], tp: int, batch: int, context: int, wanted: int,
              device: torch.device, kv_cache_dtype: str = "auto") -> int:
    """How many distinct layers of `ids` fit the device's free memory (at most `wanted`); an error saying what
    fits when not even one does."""
    free = free_device_bytes(device)
    if free is None:
        return wanted
    per_layer = (planned_bytes(cfg, ids[0], tp, batch, context, kv_cache_dtype=kv_cache_dtype)
                 + standard_copy_bytes(cfg, ids[0], tp))
    fits = int((free - HEADROOM_BYTES) // per_layer)
    if fits < 1:
        raise BenchError(f"one layer at TP{tp}, batch {batch}, context {context} needs {per_layer / 2**30:.1f} GiB; "
                         f"{free / 2**30:.1f} GiB are free: lower the batch or the context")
    return min(wanted, fits)


def fit_weight_sets(wanted: dict[str, int], set_bytes: dict[str, int], free: int) -> dict[str, int]:
    """The weight sets per kind `bench step` builds: `wanted`, or, where those and HEADROOM_BYTES exceed `free`, fewer:
    one set at a time off the kind with the most (ties: the larger set), down to one of each kind. An error when one
    set of each kind does not fit."""
    sets = dict(wanted)

    def need() -> int:
        return sum(set_bytes[kind] * n for kind, n in sets.items())

    while need() + HEADROOM_BYTES > free:
        kind = max(sets, key=lambda k: (sets[k], set_bytes[k]))
        if sets[kind] == 1:
            raise BenchError(f"one weight set of each kind ({', '.join(sets)}) needs {need() / 2**30:.1f} GiB; "
                             f"{free / 2**30:.1f} GiB are free (keep {HEADROOM_BYTES >> 30} GiB headroom): "
                             f"lower the batch or the context")
        sets[kind] -= 1
    return sets


def set_order(kinds: Sequence[str], sets: dict[str, int]) -> list[tuple[str, int]]:
    """(kind, weight set) of each layer of the schedule `kinds`: each kind's sets taken in turn."""
    turns: Counter[str] = Counter()
    order = []
    for kind in kinds:
        order.append((kind, turns[kind] % sets[kind]))
        turns[kind] += 1
    return order


def bytes_between_turns(kinds: Sequence[str], sets: dict[str, int], layer_bytes: dict[str, float],
                        head_bytes: float) -> float:
    """The fewest bytes a step moves from one turn of a weight set to its next: between reading a weight and reading
    it again the device reads the rest of that turn's layer, every layer between the turns and the start of the next
    turn, which sum to this (each layer reads its bytes in the same order every turn). Steps replay back to back, so a
    set's last turn is followed by its first in the next step, the head between."""
    order = set_order(kinds, sets)
    starts = [0.0]
    for kind in kinds:
        starts.append(starts[-1] + layer_bytes[kind])
    step = starts[-1] + head_bytes
    turns: dict[tuple[str, int], list[int]] = {}
    for at, turn in enumerate(order):
        turns.setdefault(turn, []).append(at)
    return min(((starts[b] - starts[a]) if b > a else (step - starts[a] + starts[b])
                for at in turns.values() for a, b in zip(at, [*at[1:], at[0]])), default=0.0)


def _snapshot(bl: BenchLayer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = [*bl.cache.kv.values(), *bl.cache.conv.values(), *bl.cache.ssm.values()]
    return [(t, t.clone()) for t in caches]


def _restore(saved) -> None:
    for t, copy in saved:
        t.copy_(copy)


def same_routing(ids: torch.Tensor | None, ref_ids: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """[tokens] bool: the token chose the same set of experts in both runs (all True in a layer without the MoE). A
    token whose 16th and 17th router keys are within rounding of each other can choose differently under another
    summation order; its output then differs by a whole expert, which no tolerance should hide or excuse, so such
    tokens are counted and judged apart."""
    if ids is None or ref_ids is None:
        return torch.ones(tokens, dtype=torch.bool)
    return (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).cpu()


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _outputs(x) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else [t for t in x if isinstance(t, torch.Tensor)]


def check_op_calls(calls, gpu: bool) -> dict[str, dict]:
    """Each recorded call's standard output against its reference on clones of the same arguments: the worst
    relative L2 and close fraction per op, and whether the op's `standard_tolerance` holds. Integer outputs (the
    router's expert ids) are compared as the fraction that agree."""
    worst: dict[str, dict] = {}
    for name, args, kwargs in calls:
        op = OPS[name]
        ref = _outputs(op.reference(*_clone(args), **kwargs))
        std = _outputs(op.standard(gpu)(*_clone(args), **kwargs))
        tol = op.standard_tolerance
        row = worst.setdefault(name, {"rel_l2": 0.0, "close_fraction": 1.0, "calls": 0, "ok": True,
                                      "bound": {"max_rel_l2": tol.max_rel_l2, "atol": tol.atol, "rtol": tol.rtol,
                                                "min_close_fraction": tol.min_close_fraction}})
        row["calls"] += 1
        for got, exp in zip(std, ref, strict=True):
            if not exp.is_floating_point():
                row["close_fraction"] = min(row["close_fraction"], float((got == exp).float().mean()))
                continue
            close = float(torch.isclose(got.float(), exp.float(), atol=tol.atol, rtol=tol.rtol).float().mean())
            row["rel_l2"] = max(row["rel_l2"], rel_l2(got, exp))
            row["close_fraction"] = min(row["close_fraction"], close)
        row["ok"] = row["rel_l2"] <= tol.max_rel_l2 and row["close_fraction"] >= tol.min_close_fraction
    return worst


def bench_layers(cfg: KimiK3Config, kind: str, tp: int, batch: int, context: int, count: int,
                 backends: Sequence[str], device: torch.device, iters: int = 30, seed: int = 0,
                 progress: Callable[[str], None] = lambda _: None, group: TP | None = None,
                 kv_cache_dtype: str = "auto") -> list[LayerRow]:
    """Rows for one (kind, TP, batch) point, one per backend (see the module docstring); `group`: this rank's TP
    group of size `tp`, whose collectives then run (every rank must make the same call); kv_cache_dtype the MLA
    cache's (ModelCache)."""
    for b in backends:
        if b not in BENCH_BACKENDS:
            raise BenchError(f"backend {b!r}: one of {', '.join(BENCH_BACKENDS)}")
    bandwidth = floor_bandwidth(device)  # first: its 2 GiB measurement must not compete with the layers
    ids = layer_ids(cfg, kind)
    n = fit_count(cfg, ids, tp, batch, context, count, device, kv_cache_dtype)
    # Layers spread over the network, so AttnRes mixes as many sources as a mid-network layer does.
    chosen = [ids[(i * len(ids)) // n] for i in range(n)]
    progress(f"{kind} TP{tp} batch {batch}: building {n} layers")
    layers = [build_layer(cfg, lid, tp, batch, context, device, seed + i, group=group, kv_cache_dtype=kv_cache_dtype)
              for i, lid in enumerate(chosen)]
    tgt = target(tp, device)

    reference = ReferenceDispatcher(tgt)
    reference.begin_step(layers[0].step)
    saved = _snapshot(layers[0])
    reference.record()
    ref_out = layers[0].run(reference)
    ref_ids = reference.routed()
    _restore(saved)

    rows = []
    for backend in backends:
        progress(f"{kind} TP{tp} batch {batch}: {backend}")
        ops = dispatcher(backend, tgt)
        ops.begin_step(layers[0].step)
        ops.record()
        _restore(saved)  # the reference's starting state: earlier runs advanced it
        out = layers[0].run(ops)
        _restore(saved)
        agree = same_routing(ops.routed(), ref_ids, out[0].shape[0])
        out_rel = max(rel_l2(g, r) for g, r in zip(out, ref_out))
        out_rel_agree = (max(rel_l2(g[agree.to(g.device)], r[agree.to(r.device)]) for g, r in zip(out, ref_out))
                         if agree.any() else None)
        op_checks = check_op_calls(ops.calls, gpu=device.type == "cuda") if backend == "auto" else {}
        _restore(saved)
        ops.record()
        with tracking_blocks(ops, [bl.layer for bl in layers]):
            for bl in layers:  # the bytes each layer must move: its calls through the op cost models
                bl.run(ops)
        costs, block_costs = call_costs(ops.calls), call_costs(ops.calls, ops.call_blocks)
        ops.calls = None
        layer_bytes = sum(c.bytes for c in costs.values()) / n
        floor_us = layer_bytes / bandwidth.Bps * 1e6
        dispatch = _dispatch_summary(ops, layers[0])
        row = LayerRow(kind, tp, batch, context, backend, n, None, None, None, None, None, layer_bytes, floor_us,
                       None, dispatch=dispatch, output_rel_l2=out_rel, output_rel_l2_same_routing=out_rel_agree,
                       routing_flips=int((~agree).sum()), op_checks=op_checks, kv_cache=kv_cache_dtype,
                       floor_bandwidth_Bps=bandwidth.Bps, floor_bandwidth_source=bandwidth.source)
        row.blocks = per_block(block_costs, n, bandwidth)
        if device.type == "cuda":
            _time_layers(row, layers, ops, costs, block_costs, bandwidth, iters)
        rows.append(row)
    return rows


def bench_layers_on_ranks(tp: TP, device: torch.device, cfg: KimiK3Config, kind: str, batches: Sequence[int],
                          context: int, count: int, backends: Sequence[str], iters: int = 30,
                          seed: int = 0, kv_cache_dtype: str = "auto") -> list[LayerRow]:
    """`bench_layers` at every batch on each rank of a real TP group (`distributed.run_tp` calls it on every rank):
    the same layers at each rank's shapes, their collectives run (on GPUs NCCL, captured in the timed graphs, so
    each replay waits for the other ranks as a decode step does). The ranks first agree on the layer count the
    fullest GPU holds, since a rank that built fewer layers would leave the others waiting in a collective. Rows
    with every rank's in-pipeline time, and the slowest rank's times as the row's."""
    rows = []
    for batch in batches:
        fits = torch.tensor([fit_count(cfg, layer_ids(cfg, kind), tp.size, batch, context, count, device,
                                       kv_cache_dtype)], device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=tp.group)
        for row in bench_layers(cfg, kind, tp.size, batch, context, int(fits), backends, device, iters, seed,
                                group=tp, kv_cache_dtype=kv_cache_dtype):
            row.collectives = BACKENDS[device.type]
            times: list = [None] * tp.size
            dist.all_gather_object(times, (row.us, row.us_q1, row.us_q3, row.us_one_per_graph), group=tp.group)
            row.ranks_us = [t[0] for t in times]
            if row.us is not None:
                row.us, row.us_q1, row.us_q3, row.us_one_per_graph = max(times)
                row.fraction_of_floor = row.floor_us / row.us
            rows.append(row)
    return rows


def _time_layers(row: LayerRow, layers: list[BenchLayer], ops: RecordingDispatcher, costs, block_costs,
                 bandwidth: FloorBandwidth, iters: int) -> None:
    """Fill the row's times, kernel count and per-op and per-block traces (GPU only)."""
    n = len(layers)
    with tracking_blocks(ops, [bl.layer for bl in layers]):
        trace, traced_blocks = op_trace([bl.closure(ops) for bl in layers], ops)
    with ops.recording():
        row.kernels = count_kernels(layers[0].closure(ops))
        piped = time_pipeline([bl.closure(ops) for bl in layers], iters=iters)
        single = time_op(layers[0].closure(ops), iters=iters)
    for name, op_row in trace.items():
        op_row["us"] /= n
        op_row["kernels"] /= n
        op_row["bytes"] = costs[name].bytes / n if name in costs else 0.0
    row.ops = trace
    row.blocks = per_block(block_costs, n, bandwidth, traced_blocks)
    row.us, row.us_q1, row.us_q3, row.us_one_per_graph = piped.median_us, piped.q1_us, piped.q3_us, single.median_us
    row.fraction_of_floor = row.floor_us / piped.median_us


def per_block(costs: dict[str, Cost], n: int, bandwidth: FloorBandwidth,
              traced: dict[str, dict] | None = None) -> dict[str, dict]:
    """One layer's share per block (of `n` traced): the µs and kernels the eager trace placed in it (None untimed),
    the bytes its op calls must move (their cost models) and their floor at the row's bandwidth. A block holding
    only glue kernels (no op call) has no bytes."""
    traced = traced or {}
    out = {}
    for block in (b for b in BLOCKS if b in costs or b in traced):
        t, moved = traced.get(block), costs[block].bytes / n if block in costs else 0.0
        out[block] = {"us": t["us"] / n if t else None, "kernels": t["kernels"] / n if t else None, "bytes": moved,
                      "floor_us": moved / bandwidth.Bps * 1e6}
    return out


@dataclass(frozen=True)
class FloorBandwidth:
    """The copy bandwidth (read + write bytes per second) a row's floors are at, and where the figure comes from."""

    Bps: float
    source: str  # "measured on <device>" or "declared for <arch> (<device>); no GPU measured it"


def floor_bandwidth(device: torch.device) -> FloorBandwidth:
    """The bandwidth every floor of the layer and step rows is at. On a GPU its copy bandwidth, measured once per
    process and device: an arch's declared figure is one device's (sm_90's is the H200's 4.3 TB/s, where an H100
    copies ~2.98 TB/s, so at the declared figure an H100's fractions of the floor read ~30 % low). Off a GPU (CI's
    tiny shapes, untimed) FLOOR_ARCH_OFF_GPU's declared figure, so the floors stay comparable, and the source says
    so."""
    if device.type != "cuda":
        declared = arch_info.known(FLOOR_ARCH_OFF_GPU)
        return FloorBandwidth(declared.mem_bw_Bps,
                              f"declared for {declared.arch} ({declared.device_name}); no GPU measured it")
    return _measured_bandwidth(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _measured_bandwidth(index: int) -> FloorBandwidth:
    measured = arch_info.measure_copy_bandwidth(index)
    torch.cuda.empty_cache()  # the measurement's 2 GiB back to the device, before any layer is fitted to it
    return FloorBandwidth(measured, f"measured on {torch.cuda.get_device_name(index)}")


def _dispatch_summary(ops: Dispatcher, layer: BenchLayer) -> dict:
    """Which implementation each op call of one layer took, and why the specialized kernel did not run."""
    with ops.recording() as decisions:
        ops.begin_step(layer.step)
        layer.run(ops)
    return tally_decisions(decisions)


def tally_decisions(decisions) -> dict[str, dict]:
    """Per op: calls that ran the specialized kernel and the standard, fallbacks by reason, and what a kernel that
    raised said (reason "error": the timing then measured the standard where the kernel was meant to run)."""
    out: dict[str, dict] = {}
    for name, specialized, fallback in decisions:
        row = out.setdefault(name, {"specialized": 0, "standard": 0, "fallbacks": {}})
        row["specialized" if specialized else "standard"] += 1
        if fallback is not None:
            row["fallbacks"][fallback.reason.value] = row["fallbacks"].get(fallback.reason.value, 0) + 1
            if fallback.reason is Reason.ERROR and fallback.detail not in row.setdefault("errors", []):
                row["errors"].append(fallback.detail)
    return out


def kernel_errors(rows) -> list[str]:
    """One line per (row, op) whose specialized kernel raised during a bench (its figure timed the standard)."""
    return [f"{r.backend} batch {r.batch}: {op}'s specialized kernel raised, so the standard ran and was timed: "
            f"{detail}" for r in rows for op, d in r.dispatch.items() for detail in d.get("errors", [])]


def batch_points(text: str) -> list[int]:
    """'1,4,16,64' -> [1, 4, 16, 64]; a clear error for anything else."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"--batch {text!r}: a comma-separated list of positive integers") from None
    if not values or any(v < 1 for v in values):
        raise BenchError(f"--batch {text!r}: a comma-separated list of positive integers")
    return values


def speculative_tokens_per_step(spec_tokens: int, acceptance: float) -> float:
    """Tokens a verification step emits per sequence: the accepted drafts plus the target's own token."""
    return spec_tokens * acceptance + 1


@dataclass
class StepRow:
    tp: int
    batch: int
    context: int
    spec_tokens: int
    backend: str
    layers: int
    weight_sets: dict[str, int]  # distinct layers built per kind, cycled through the schedule
    ms: float | None  # None where no GPU times it
    ms_q1: float | None
    ms_q3: float | None
    kernels: int | None
    bytes: float
    floor_ms: float
    fraction_of_floor: float | None
    tokens_per_step: float  # per sequence: 1, or the accepted drafts plus one
    tokens_per_s: float | None  # the whole batch's (accepted) tokens per second
    dispatch: dict = field(default_factory=dict)
    floor_bandwidth_Bps: float | None = None  # the copy bandwidth floor_ms is at (FloorBandwidth)
    floor_bandwidth_source: str | None = None  # measured on which device, or declared for which arch

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Head:
    """The end of a step: the final AttnRes over every block, the norm and this rank's lm_head shard."""

    modules: torch.nn.Module
    sources: list[torch.Tensor]

    def run(self, ops: Dispatcher) -> torch.Tensor:
        res, norm, vocab = self.modules
        return vocab.logits(norm(res(self.sources, ops), ops), ops)


def build_head(cfg: KimiK3Config, tp: int, tokens: int, device: torch.device, seed: int) -> Head:
    from ..attn_res import AttnResWeights
    from ..model import VocabParallel
    from ..module import RMSNorm
    from .layers import RankOfTP, fill_random_

    rank = RankOfTP(size=tp)
    d, eps, dtype = cfg.hidden_size, cfg.rms_norm_eps, torch.bfloat16
    with torch.device(device):
        modules = torch.nn.ModuleList([AttnResWeights("model.", "output_attn_res", d, eps, rank, dtype),
                                       RMSNorm("model.norm.weight", d, eps, rank, dtype),
                                       VocabParallel(cfg, rank, dtype)])
    gen = torch.Generator(device).manual_seed(seed)
    fill_random_(modules, gen)
    sources = [torch.randn(tokens, d, generator=gen, device=device).to(dtype)
               for _ in range(cfg.num_attn_res_blocks + 1)]
    return Head(modules, sources)


def schedule(cfg: KimiK3Config) -> list[str]:
    """The kind of every layer in model order: 'dense' (layer 0), 'kda' or 'mla'."""
    return ["dense" if not cfg.is_moe_layer(i) else "mla" if cfg.is_mla_layer(i) else "kda"
            for i in range(cfg.num_hidden_layers)]


def bench_step(cfg: KimiK3Config, tp: int, batch: int, context: int, spec_tokens: int, acceptance: float,
               backends: Sequence[str], device: torch.device, kda_sets: int = 8, mla_sets: int = 3, iters: int = 20,
               seed: int = 0, progress: Callable[[str], None] = lambda _: None) -> list[StepRow]:
    """One whole decode (or verification) step of the model's schedule in one CUDA graph per backend: every layer
    in model order, each kind's distinct weight sets cycled, then the final AttnRes, norm and lm_head."""
    bandwidth = floor_bandwidth(device)  # first: its 2 GiB measurement must not compete with the layers
    kinds = schedule(cfg)
    wanted = {"dense": 1, "kda": kda_sets, "mla": mla_sets}
    ids = {kind: layer_ids(cfg, kind) for kind in wanted}
    set_bytes = {k: planned_bytes(cfg, ids[k][0], tp, batch, context, spec_tokens)
                 + standard_copy_bytes(cfg, ids[k][0], tp) for k in wanted}
    free = free_device_bytes(device)
    # Fewer sets than asked still time cold weights: from one turn of a set to its next the step moves at least one
    # whole layer's bytes (bytes_between_turns: a K3 layer at TP8 moves ~280-300 MB at batch 1, ~5x an H100's 50 MB
    # L2, more at larger batches), so no weight is still in the L2 when it is read again; where the sets were
    # reduced, this is checked on the GPU below with the bytes each backend's layers must move.
    counts = wanted if free is None else fit_weight_sets(wanted, set_bytes, free)
    if counts != wanted:
        asked = sum(set_bytes[k] * n for k, n in wanted.items())
        progress(f"step TP{tp} batch {batch}: {counts['kda']} KDA and {counts['mla']} MLA weight sets, not "
                 f"{kda_sets} and {mla_sets}: those need {asked / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free "
                 f"(keep {HEADROOM_BYTES >> 30} GiB headroom)")
    sets: dict[str, list[BenchLayer]] = {}
    for kind, n in counts.items():
        progress(f"step TP{tp} batch {batch}: building {n} {kind} layers")
        chosen = [ids[kind][(i * len(ids[kind])) // n] for i in range(n)]
        sets[kind] = [build_layer(cfg, lid, tp, batch, context, device, seed + 100 * len(sets) + j, spec_tokens)
                      for j, lid in enumerate(chosen)]
    head = build_head(cfg, tp, batch * (1 + spec_tokens), device, seed + 1)
    # one StepBatch for every layer, as the model has: the tensors a step makes once for all its layers (the MLA
    # block table) are then made once here too, in the pass each whole step opens (the layers' caches have one
    # geometry, so any layer's table is every layer's)
    step = sets["dense"][0].step
    sets = {kind: [replace(bl, step=step) for bl in built] for kind, built in sets.items()}
    order = [sets[kind][j] for kind, j in set_order(kinds, counts)]

    tgt = target(tp, device)
    per_step = speculative_tokens_per_step(spec_tokens, acceptance) if spec_tokens else 1.0
    rows = []
    for backend in backends:
        progress(f"step TP{tp} batch {batch}: {backend}")
        ops = dispatcher(backend, tgt)
        ops.begin_step(order[0].step)
        per_kind_bytes = {kind: _recorded_bytes(ops, [bl.run for bl in sets[kind]]) / len(sets[kind])
                          for kind in wanted}
        head_bytes = _recorded_bytes(ops, [head.run])
        step_bytes = sum(per_kind_bytes[k] for k in kinds) + head_bytes
        if device.type == "cuda" and counts != wanted:
            _check_cold(bytes_between_turns(kinds, counts, per_kind_bytes, head_bytes), device, counts)

        def whole_step(ops=ops) -> None:
            with step.forward_pass():
                for bl in order:
                    bl.run(ops)
            head.run(ops)

        floor_ms = step_bytes / bandwidth.Bps * 1e3
        row = StepRow(tp, batch, context, spec_tokens, backend, len(kinds), dict(counts), None, None, None, None,
                      step_bytes, floor_ms, None, per_step, None, floor_bandwidth_Bps=bandwidth.Bps,
                      floor_bandwidth_source=bandwidth.source)
        with ops.recording() as decisions:
            if device.type == "cuda":
                row.kernels = count_kernels(whole_step)
                timing = time_pipeline([whole_step], iters=iters)
                row.ms, row.ms_q1, row.ms_q3 = timing.median_us / 1e3, timing.q1_us / 1e3, timing.q3_us / 1e3
                row.fraction_of_floor = floor_ms / row.ms
                row.tokens_per_s = batch * per_step / (row.ms / 1e3)
            else:
                whole_step()
        row.dispatch = tally_decisions(decisions)
        rows.append(row)
    return rows


COLD_L2_MULTIPLE = 2  # bytes moved between two reads of a weight, in L2 sizes, for it to have left the L2


def _check_cold(between: float, device: torch.device, counts: dict[str, int]) -> None:
    """An error where the sets `fit_weight_sets` left could be read again while still in the L2 (layers too small for
    that few sets): the step would be timed warm where the asked sets were cold."""
    l2 = arch_info.detect(device).l2_bytes
    if between < COLD_L2_MULTIPLE * l2:
        raise BenchError(f"with {counts['kda']} KDA and {counts['mla']} MLA weight sets a set is read again after "
                         f"{between / 1e6:.1f} MB, under {COLD_L2_MULTIPLE}x the {l2 / 1e6:.0f} MB L2: its weights "
                         f"would be timed warm: lower the batch or the context")


def _recorded_bytes(ops: RecordingDispatcher, runs: Sequence[Callable[[Dispatcher], object]]) -> float:
    """Bytes the op calls of `runs` must move, by the ops' own cost models (one eager run each)."""
    ops.calls = []
    try:
        for run in runs:
            run(ops)
        return sum(c.bytes for c in call_costs(ops.calls).values())
    finally:
        ops.calls = None
