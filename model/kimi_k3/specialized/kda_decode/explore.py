"""Time kernel variants side by side in one process: kernel source files and tuning knobs, across batch sizes.

    python -m model.kimi_k3.specialized.kda_decode.explore --heads 12 --batches 1 4 16 64 --json out.json
    python -m model.kimi_k3.specialized.kda_decode.explore --batches 1 4 --sources variants/a.py variants/b.py
    python -m model.kimi_k3.specialized.kda_decode.explore --batches 1 --tunings v_split=1 v_split=2 v_split=4

A variant is (source, tuning). A source is a file with kernel.py's interface (the config, `compile_kernel`,
`launch_args`), loaded as its own module and run through this package's entry point (`decode_with`), so an edited
copy of the kernel (a branch's kernel.py) runs beside this tree's; a tuning overrides
KDADecodeConfig fields ('default': the entry point's choice). Each variant's output and state are checked
against the reference first. Timing is the gate's (CUDA-graph replay, L2 flushed before every replay), split
into --rounds rounds that visit the variants in turn, so drift over the run hits every variant alike; each
variant's ratio to the first one is the median of the per-round ratios, with their range.

Also times a one-kernel graph (a 4-byte fill) with the same method: the floor of the measurement itself
(graph launch + events) on this machine; --probe adds the dependency-chain probe (probe.py: the step's bytes in
its dependency order, no math), a measured lower bound for any one-kernel step in that data flow, the same bytes
walked by a persistent grid (another data flow), and the state bytes alone scaled in place (what a plain copy of
them costs in this timing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

THIS_KERNEL = Path(__file__).with_name("kernel.py")


def load_source(path: Path, index: int):
    """The kernel module at `path`: this tree's own module for kernel.py, else the file loaded under a name
    of its own (its compile cache is its own too)."""
    if path.resolve() == THIS_KERNEL.resolve():
        from model.kimi_k3.specialized.kda_decode import kernel

        return kernel
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"kda_decode_variant_{index}", path)
    if spec is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's postponed annotations through it
    spec.loader.exec_module(module)
    missing = [name for name in ("KDADecodeConfig", "compile_kernel", "launch_args", "DSL")
               if not hasattr(module, name)]
    if missing:
        raise SystemExit(f"{path}: has no {', '.join(missing)} (not a kernel.py variant)")
    return module


def parse_tuning(text: str) -> dict | None:
    """'v_split=4,chunk_rows=0' -> {'v_split': 4, 'chunk_rows': 0}; 'default' -> None."""
    if text == "default":
        return None
    try:
        return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise SystemExit(f"--tunings {text!r}: expected name=int[,name=int...] or 'default'") from None


def main(argv=None):
    from gates.problems.kda_decode import make_case
    from kernels.arch import detect
    from kernels.timing import time_op
    from model.kimi_k3.specialized.kda_decode import decode_with
    from model.kimi_k3.specialized.kda_decode.bench import check_against_reference, step_floor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[12])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--sources", type=Path, nargs="+", default=[THIS_KERNEL],
                    help="kernel.py variants to compare (default: this tree's); the first is the baseline")
    ap.add_argument("--tunings", nargs="+", default=["default"],
                    help="config overrides per variant, e.g. v_split=1 v_split=4,chunk_rows=2 (default: 'default')")
    ap.add_argument("--standard", action="store_true", help="time the standard path (FLA + cuBLAS) beside them")
    ap.add_argument("--probe", action="store_true", help="time the dependency-chain probe beside them")
    ap.add_argument("--slots", choices=("scattered", "contiguous", "offset"), default="scattered",
                    help="the batch's cache slots (gates.problems.kda_decode.make_slots): the gate's scattered "
                         "ones, or a contiguous run, which separates the tiles' scatter from their access pattern")
    ap.add_argument("--iters", type=int, default=300, help="timed replays per variant and point, over all rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("explore needs a CUDA GPU")

    variants = []
    for i, path in enumerate(a.sources):
        module = load_source(path, i)
        for text in a.tunings:
            tuning = parse_tuning(text)
            name = f"{path.stem}[{text}]" if len(a.tunings) > 1 else path.stem
            variants.append((name, lambda *args, m=module, t=tuning: decode_with(m, *args, tuning=t), True))
    if a.standard:
        from model.kimi_k3.ops.kda_decode_standard import kda_decode_standard, standard_available

        ok, why = standard_available()
        if not ok:
            raise SystemExit(f"--standard: {why}")
        variants.append(("standard", kda_decode_standard, True))
    if a.probe:
        from functools import partial

        from model.kimi_k3.specialized.kda_decode.probe import available, chain_probe, state_scale

        ok, why = available()
        if not ok:
            raise SystemExit(f"--probe: {why}")
        variants.append(("chain probe (no math)", chain_probe, False))
        for per_sm, stages in ((1, 1), (1, 2), (1, 3), (2, 1)):
            variants.append((f"chain probe, persistent {per_sm}/SM x{stages}",
                             partial(chain_probe, persistent=per_sm, stages=stages), False))
        variants.append(("state bytes, contiguous scale", state_scale, False))

    tiny = torch.zeros(1, device="cuda")
    empty = time_op(lambda: tiny.fill_(1.0), iters=a.iters)
    warm_empty = time_op(lambda: tiny.fill_(1.0), iters=a.iters, flush="none")
    print(f"one-kernel graph (fill of 4 B): cold L2 {empty.median_us:.2f} us (IQR {empty.iqr_us:.2f}), "
          f"warm {warm_empty.median_us:.2f} us")
    rows = [dict(kind="empty", us=empty.median_us, warm_us=warm_empty.median_us)]
    per_round = max(1, a.iters // a.rounds)
    info = detect()
    for heads in a.heads:
        for batch in a.batches:
            floor_us = step_floor(heads, batch, info).floor_us
            args = make_case(heads, batch, device="cuda", seed=heads + batch, slot_pattern=a.slots).args()
            for name, impl, checked in list(variants):  # a probe that cannot launch here (resources) is dropped
                try:
                    impl(*args)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - reported, and the others still run
                    print(f"  {name}: dropped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                    variants.remove((name, impl, checked))
            errors = {name: check_against_reference(impl, heads, batch, seed=batch, exact_gemm=True)[:2]
                      if checked else None for name, impl, checked in variants}
            samples = {name: [] for name, _, _ in variants}
            round_medians = {name: [] for name, _, _ in variants}
            for r in range(a.rounds):
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                for name, impl, _ in order:
                    res = time_op(lambda impl=impl: impl(*args), iters=per_round, host_iters=0)
                    samples[name].extend(res.samples_us)
                    round_medians[name].append(res.median_us)
            base = variants[0][0]
            print(f"H={heads} B={batch} floor {floor_us:.2f} us")
            for name, _, _ in variants:
                ratios = [b / v for b, v in zip(round_medians[base], round_medians[name])]
                med = statistics.median(samples[name])
                err, serr = errors[name] or (None, None)
                checked = f"out {err:.1e} state {serr:.1e}" if errors[name] else "not checked"
                print(f"  {name:<32} {med:7.2f} us  x{statistics.median(ratios):.3f} vs {base} "
                      f"[{min(ratios):.3f}, {max(ratios):.3f}]  {checked}", flush=True)
                rows.append(dict(kind="variant", heads=heads, batch=batch, variant=name, us=med,
                                 round_medians_us=round_medians[name], ratio_to_first=statistics.median(ratios),
                                 out_rel=err, state_rel=serr, floor_us=floor_us))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
