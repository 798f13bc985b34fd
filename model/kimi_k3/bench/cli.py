"""`k3forge bench layer` / `k3forge bench step` (also `python -m model.kimi_k3.bench layer|step ...`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from gates.evidence.bundle import git_state
from kernels.arch import detect

from ..cache import KV_CACHE_DTYPES
from ..config import preset
from ..dispatch import DECODE_BACKENDS
from ..distributed import run_tp, tp_backend
from ..ops.registry import REPO_ROOT
from .layers import KINDS
from .run import (
    BENCH_BACKENDS,
    LAYER_OUTPUT_REL_L2,
    BenchError,
    batch_points,
    bench_layers,
    bench_layers_on_ranks,
    bench_step,
    kernel_errors,
)

out = Console(highlight=False)
RANKS_TIMEOUT_S = 3600  # the TP ranks' whole run, every batch point: a broken collective ends it, never hangs it


def _at_least(low: int):
    """An argparse type: an integer >= low (a one-line usage error otherwise, never a traceback later)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def add_commands(sub) -> None:
    """Add `layer` and `step` to a subparsers object (the `bench` command's, or this module's own)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default="k3", help="model config preset (default k3; tiny for CPU smoke runs)")
    common.add_argument("--tp", type=_at_least(1), default=8,
                        help="TP size whose rank-local shapes are built (default 8)")
    common.add_argument("--batch", default="1,4,16,64", help="comma-separated batch sizes (default 1,4,16,64)")
    common.add_argument("--context", type=_at_least(1), default=8192,
                        help="cached tokens per sequence (default 8192)")
    common.add_argument("--backend", choices=[*BENCH_BACKENDS, "both", "all"], default="both",
                        help="which decode backend to time (default both: auto and latency_specialized side by "
                             "side; declared: latency_specialized with the kernels that only declare this arch "
                             "counted as validated, a measurement that is never evidence; all: the three)")
    common.add_argument("--iters", type=_at_least(1), default=30, help="timed replays per point (default 30)")
    common.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")
    common.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON to FILE")
    common.add_argument("--device", default="cuda", help="torch device (default cuda; cpu runs the same code "
                                                         "path untimed on small presets)")

    layer = sub.add_parser("layer", parents=[common], help="one decoder layer of a kind, in-pipeline")
    layer.add_argument("--kind", choices=KINDS, default="kda", help="KDA+MoE, MLA+MoE, or layer 0 (dense MLP)")
    layer.add_argument("--layers", type=_at_least(1), default=8,
                       help="distinct layers in one CUDA graph (default 8; fewer if memory says so)")
    layer.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                       help="the MLA cache: auto (the activation dtype, default) or fp8 (e4m3: mla_decode_fp8)")
    layer.add_argument("--collectives", action="store_true",
                       help="also run the layer on all --tp ranks, one process per GPU (NCCL; gloo and untimed "
                            "with --device cpu), with its all-reduces captured in the timed graphs: rows marked "
                            "with the backend, beside the one-rank rows with the collectives excluded")
    layer.set_defaults(func=run_layer)

    step = sub.add_parser("step", parents=[common], help="the whole decode step: every layer, final norm, lm_head")
    step.add_argument("--kda-sets", type=_at_least(1), default=8,
                      help="distinct KDA layer weight sets (default 8; fewer, down to 1, where the device cannot "
                           "hold them: KDA's first, the row records how many)")
    step.add_argument("--mla-sets", type=_at_least(1), default=3,
                      help="distinct MLA layer weight sets (default 3; fewer where the device cannot hold them)")
    step.add_argument("--spec-tokens", type=_at_least(0), default=0,
                      help="verify 1 + K tokens per sequence (speculative mode; default 0: plain decode)")
    step.add_argument("--acceptance", type=_fraction, default=6 / 7,
                      help="synthetic fraction of drafts accepted in speculative mode (default 6/7)")
    step.set_defaults(func=run_step)


def _backends(args) -> list[str]:
    return {"both": list(DECODE_BACKENDS), "all": list(BENCH_BACKENDS)}.get(args.backend, [args.backend])


def _device(args) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: this machine has no CUDA GPU (use --device cpu --preset tiny to run the "
                         "code path untimed)")
    return device


def _write(args, command: str, rows) -> None:
    """The rows with what produced them: the command and its options, the machine, the commit, and the sha256 of
    every repository source loaded in this process (what an evidence bundle of these rows covers)."""
    if not args.json:
        return
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    record = {"command": command, "options": options, "environment": run_environment(), "sources": loaded_sources(),
              "rows": [r.as_dict() for r in rows]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))


def loaded_sources() -> dict[str, str]:
    """{repository-relative path: sha256} of every module of this repository loaded so far (dynamic imports too) and
    of every contract (they decide what `latency_specialized` runs)."""
    root = REPO_ROOT.resolve()
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = Path(path).resolve()
        if path.suffix == ".py" and path.is_file() and path.is_relative_to(root) and ".venv" not in path.parts:
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    for path in (root / "contracts").glob("*.yaml"):
        found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(found.items()))


def run_environment() -> dict:
    """Versions, device and the checkout's state as a gate records it (K3FORGE_COMMIT where a runner names the
    commit: a GPU runner's copy of the tree can carry another commit's history). `dirty` True: the measured tree
    differs from `commit` (the sources' hashes say what ran)."""
    git = git_state()
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "commit": git.commit, "dirty": git.dirty, "arch": detect().arch}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30))
    return info


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _collectives(r) -> str:
    if r.collectives == "excluded":
        return "excluded (one rank)"
    return f"{r.collectives}, slowest of {len(r.ranks_us)} ranks" if r.us is not None else f"{r.collectives}, untimed"


def _floors(rows) -> str | None:
    """The tables' caption: the bandwidth the rows' floors are at, and whether it was measured or declared."""
    figures = dict.fromkeys(f"{r.floor_bandwidth_Bps / 1e12:.2f} TB/s, {r.floor_bandwidth_source}" for r in rows)
    return f"floors at {'; '.join(figures)}" if figures else None


def run_layer(args) -> int:
    device, cfg, batches = _device(args), preset(args.preset), batch_points(args.batch)
    cfg.check_tp(args.tp)  # the field --tp cannot divide, before any weight is drawn
    if args.collectives:
        try:
            tp_backend(device, args.tp)
        except ValueError as e:
            raise BenchError(f"--collectives: {e}") from None
    rows = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=out) as bar:
        task = bar.add_task("bench layer")
        if args.collectives:  # first, in fresh processes, before this one holds any device memory
            bar.update(task, description=f"{args.kind} TP{args.tp}: {args.tp} ranks with their collectives")
            rows += run_tp(bench_layers_on_ranks, args.tp, cfg, args.kind, batches, args.context, args.layers,
                           _backends(args), args.iters, args.seed, args.kv_cache_dtype, device=str(device),
                           timeout=RANKS_TIMEOUT_S)
        for batch in batches:
            rows += bench_layers(cfg, args.kind, args.tp, batch, args.context, args.layers, _backends(args), device,
                                 args.iters, args.seed, lambda text: bar.update(task, description=text),
                                 kv_cache_dtype=args.kv_cache_dtype)
    table = Table(title=f"bench layer: {args.kind}, TP{args.tp}, context {args.context}"
                        + (f", {args.kv_cache_dtype} MLA cache" if args.kv_cache_dtype != "auto" else ""),
                  caption=_floors(rows))
    for col in ("batch", "backend", "collectives", "µs (in-pipeline)", "µs (one per graph)", "kernels", "MB",
                "floor µs", "of floor", "vs reference"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.batch), r.backend, _collectives(r), _fmt(r.us, ".1f"), _fmt(r.us_one_per_graph, ".1f"),
                      _fmt(r.kernels, "d"), f"{r.bytes / 1e6:.1f}", f"{r.floor_us:.1f}",
                      _fmt(r.fraction_of_floor, ".0%"), _fmt(r.output_rel_l2_same_routing, ".1e"))
    out.print(table)
    bad = [f"standard outside its tolerance: {r.backend} batch {r.batch}: {op} {c['rel_l2']:.2e} rel. L2, "
           f"{c['close_fraction']:.4f} close" for r in rows for op, c in r.op_checks.items() if not c["ok"]]
    bad += [f"layer output off the reference layer's: {r.backend} batch {r.batch}: {r.output_rel_l2_same_routing:.2e} "
            f"rel. L2 over the tokens routed alike (bound {LAYER_OUTPUT_REL_L2:g})" for r in rows
            if r.output_rel_l2_same_routing is not None and r.output_rel_l2_same_routing > LAYER_OUTPUT_REL_L2]
    bad += kernel_errors(rows)
    for line in bad:
        out.print(line)
    for r in rows:
        if r.routing_flips:
            out.print(f"{r.backend} batch {r.batch}: {r.routing_flips} token(s) routed to other experts than the "
                      f"reference's (near-tied router keys); judged apart, all-token rel. L2 {r.output_rel_l2:.2e}")
    _write(args, "layer", rows)
    return 1 if bad else 0


def run_step(args) -> int:
    device, cfg = _device(args), preset(args.preset)
    cfg.check_tp(args.tp)  # the field --tp cannot divide, before any weight is drawn
    rows = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=out) as bar:
        task = bar.add_task("bench step")
        for batch in batch_points(args.batch):
            rows += bench_step(cfg, args.tp, batch, args.context, args.spec_tokens, args.acceptance, _backends(args),
                               device, args.kda_sets, args.mla_sets, args.iters, args.seed,
                               lambda text: bar.update(task, description=text))
    table = Table(title=f"bench step: TP{args.tp}, context {args.context}, {rows[0].layers if rows else 0} layers "
                        f"(collectives excluded)", caption=_floors(rows))
    for col in ("batch", "spec", "KDA/MLA sets", "backend", "ms", "kernels", "GB", "floor ms", "of floor", "tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:  # the sets: fewer than asked where the device could not hold them (bench_step)
        table.add_row(str(r.batch), str(r.spec_tokens), f"{r.weight_sets['kda']}/{r.weight_sets['mla']}", r.backend,
                      _fmt(r.ms, ".3f"), _fmt(r.kernels, "d"),
                      f"{r.bytes / 1e9:.2f}", f"{r.floor_ms:.3f}", _fmt(r.fraction_of_floor, ".0%"),
                      _fmt(r.tokens_per_s, ".0f"))
    out.print(table)
    bad = kernel_errors(rows)
    for line in bad:
        out.print(line)
    _write(args, "step", rows)
    return 1 if bad else 0
