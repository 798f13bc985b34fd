"""Benchmark (GPU) of mla_decode_cute per `partial` path against the standard, in CUDA graphs.

Per (B, L, H): the standard, and for each path (MlaConfig.path: "fma", "mma"; "e4m3": the mma path over the same
cache quantized to e4m3 with a calibrated scale, through mla_decode_fp8_cute) the entry point end to end and its
attention core alone (the two launches: partials, and the merge with the output absorption). Inputs are the op's
problem's (gates/problems/mla_decode.py `make_case`, seed 0): a paged cache of `--page-size` rows a page (default
64; 0: one page of L rows per sequence, the slot form) with each sequence's pages in a random order, every sequence
at the full length L (`--lengths full`, the floor's case) or lengths drawn as the gate draws them (`--lengths
random`: in [1, L], one at 1 and one at L). `--ctas-per-sm` times each path at each value of the split heuristic's
knob (MlaConfig.ctas_per_sm: how many waves of CTAs the splits aim at), `--stages` at each ring depth.

Method. Per point one CUDA graph per implementation, replayed by kernels.timing.time_graphs with the L2 flushed
before each replay (flush='l2'); the median is reported. The floor is the cache bytes the call reads (the valid
rows, bf16, and the weights) / 4.3 TB/s (NOTES.md's table), each path's own beside its time (e4m3: half the cache
bytes); TB/s is the path's cache bytes over its core's time. Each path is first
checked at each point against the problem's float64 reference (e4m3: over the dequantized cache): a failure prints
FAIL and that path is not timed there.

    python -m model.kimi_k3.specialized.mla_decode.bench                       # the NOTES points, 12 and 6 heads
    python -m model.kimi_k3.specialized.mla_decode.bench --paths fma mma       # both paths side by side
    python -m model.kimi_k3.specialized.mla_decode.bench --points 1x4096 64x32768 --heads 12 --paths mma
    python -m model.kimi_k3.specialized.mla_decode.bench --paths mma e4m3      # the FP8 cache beside bf16
    python -m model.kimi_k3.specialized.mla_decode.bench --paths mma --lengths random --ctas-per-sm 2 4 8
    python -m model.kimi_k3.specialized.mla_decode.bench --paths mma --page-size 16 64 0  # paging's cost
    ncu -k regex:"partial|merge" python -m model.kimi_k3.specialized.mla_decode.bench --check-only ...  # a profile

`--check-only` runs each path once per point (the check against float64) and times nothing: under a profiler, each
point then launches each path's kernels exactly once.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from gates.problems.mla_decode import make_case, reference
from kernels.trees import clone
from model.kimi_k3.specialized.mla_decode.kernel import MlaConfig

HBM_BYTES_PER_S = 4.3e12
PATHS = ("fma", "mma", "e4m3")
POINTS = ("1x1024", "1x4096", "1x32768", "16x4096", "16x8192", "64x4096", "64x32768")
N, C, R = 128, 512, 64


def inputs(b: int, max_len: int, h: int, full_lengths: bool, page_size: int) -> tuple:
    """The problem's call at this point (seed 0, "normal"), pages of `page_size` rows (0: max_len), on the GPU."""
    return clone(make_case(b, max_len, h, C, R, 0, full_lengths=full_lengths, page_size=page_size or max_len).args,
                 "cuda")


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def variant(path: str, h: int, args: tuple, ctas_per_sm: int, stages: int) -> tuple:
    """(entry point, its arguments, the attention core's cache and score scale, config, cache elements a row) of one
    path on the bf16 inputs."""
    from gates.problems import Case
    from gates.problems.mla_decode_fp8 import fp8_case
    from model.kimi_k3.specialized import mla_decode as mk
    from model.kimi_k3.specialized import mla_decode_fp8 as mk8

    if path != "e4m3":
        cfg = mk.prepare(h, config=dataclasses.replace(mk.config_for(h), path=path, ctas_per_sm=ctas_per_sm,
                                                       stages=stages))
        return lambda *a: mk.mla_decode_cute(*a, config=cfg), args, (args[2], args[-1]), cfg, C + R
    cfg = mk.prepare(h, config=dataclasses.replace(mk8.config_for(h), ctas_per_sm=ctas_per_sm, stages=stages))
    call = fp8_case(Case(args=args)).args  # (q_nope, q_pe, kv8, kv_scale, block_table, ...)
    return (lambda *a: mk8.mla_decode_fp8_cute(*a, config=cfg), call, (call[2], call[-1] * call[3]), cfg, C + R)


def bench_point(b: int, max_len: int, h: int, iters: int, paths: list[str], full_lengths: bool,
                ctas_per_sm: list[int], stages: list[int], page_size: int = 64, check_only: bool = False,
                trace: bool = False) -> None:
    from kernels.timing import time_graphs
    from model.kimi_k3.ops.mla_decode_standard import mla_decode_standard
    from model.kimi_k3.specialized import mla_decode as mk

    args = inputs(b, max_len, h, full_lengths, page_size)
    q_nope, q_pe, kv, table, lengths, w_uk, w_uv, scale = args
    label = f"B={b:3d} L={max_len:6d} H={h:2d} P={kv.shape[1]:5d}"
    rows = int(lengths.sum())
    q_lat = torch.einsum("bhn,hnc->hbc", q_nope.float(), w_uk.float()).contiguous()  # the core's first input
    graphs, errs, row_bytes, cfgs = {"standard": capture(lambda: mla_decode_standard(*args))}, {}, {}, {}
    runs = [(path, k, st) for path in paths for k in ctas_per_sm for st in stages]
    keep = []  # every captured graph's inputs, alive until it has been replayed (a graph holds raw addresses)
    for path, k, st in runs:
        entry, call, (cache, core_scale), cfgs[path, k, st], width = variant(path, h, args, k, st)
        keep.append((call, cache))
        row_bytes[path] = width * cache.element_size()
        want = reference(q_nope, q_pe, cache, table, lengths, w_uk, w_uv, scale, core_scale / scale)
        got = entry(*call)
        errs[path, k, st] = float((got.double() - want.double()).norm() / want.double().norm())
        name = f"{path} (ctas_per_sm {k}, stages {st})"
        if not torch.isfinite(got).all() or errs[path, k, st] > 1e-2:
            print(f"FAIL {label} {name}: rel_l2 {errs[path, k, st]:.3g}")
            continue
        if check_only:
            print(f"ok {label} {name}: rel_l2 {errs[path, k, st]:.2e}")
            continue
        graphs["cute", path, k, st] = capture(lambda entry=entry, call=call: entry(*call))
        graphs["core", path, k, st] = capture(lambda cache=cache, core_scale=core_scale, cfg=cfgs[path, k, st]:
                                              mk.attention_core(q_lat, q_pe, cache, table, lengths, w_uv, core_scale,
                                                                cfg, core_scale / scale))
    if check_only:
        return
    us = {}
    for name, g in graphs.items():
        if trace:  # with CUDA_LAUNCH_BLOCKING=1, the last name printed is the graph whose replay failed
            print(f"timing {label} {name}", flush=True)
        us[name] = time_graphs([g], iters=iters, flush="l2").median_us
    weights = 2 * h * N * C * 2  # W_UK and W_UV, bf16
    floor = (rows * (C + R) * 2 + weights) / HBM_BYTES_PER_S * 1e6
    print(f"{label} ({rows} rows): standard {us['standard']:8.2f} us  floor {floor:7.2f} us (bf16 cache)")
    for path, k, st in runs:
        if ("cute", path, k, st) in us:
            cute_us, core_us = us["cute", path, k, st], us["core", path, k, st]
            splits, _ = mk.split_plan(b, table.shape[1] * kv.shape[1],
                                      torch.cuda.get_device_properties(0).multi_processor_count, cfgs[path, k, st])
            path_floor = (rows * row_bytes[path] + weights) / HBM_BYTES_PER_S * 1e6  # its own cache's bytes
            print(f"    {path} (ctas_per_sm {k}, stages {st}, {splits} splits): cute {cute_us:8.2f} us  core "
                  f"{core_us:8.2f} us ({rows * row_bytes[path] / core_us / 1e6:5.2f} TB/s, "
                  f"{path_floor / cute_us:4.0%} of its floor)  speedup {us['standard'] / cute_us:5.2f}x  "
                  f"rel_l2 {errs[path, k, st]:.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="*", default=list(POINTS), help="BxL")
    parser.add_argument("--heads", nargs="*", type=int, default=[12, 6])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--paths", nargs="*", default=["fma", "mma"], choices=PATHS,
                        help="the `partial` paths to time (MlaConfig.path; e4m3: the mma path over an FP8 cache)")
    parser.add_argument("--lengths", choices=("full", "random"), default="full",
                        help="every sequence at L (the floor's case), or lengths drawn as the gate draws them")
    parser.add_argument("--ctas-per-sm", nargs="*", type=int, default=[2],
                        help="values of MlaConfig.ctas_per_sm, the split heuristic's knob, to time each path at")
    parser.add_argument("--stages", nargs="*", type=int, default=[MlaConfig().stages],
                        help="values of MlaConfig.stages (the mma path's tiles in flight; each compiles its own code)")
    parser.add_argument("--page-size", nargs="*", type=int, default=[64],
                        help="rows a page of the cache (0: one page of L rows per sequence, the slot form)")
    parser.add_argument("--trace", action="store_true",
                        help="print each graph's name before timing it (with CUDA_LAUNCH_BLOCKING=1: which failed)")
    parser.add_argument("--check-only", action="store_true",
                        help="check each path once per point against float64 and time nothing (for a profiler)")
    a = parser.parse_args(argv)
    for point in a.points:
        b, max_len = (int(x) for x in point.split("x"))
        for h in a.heads:
            for page_size in a.page_size:
                bench_point(b, max_len, h, a.iters, a.paths, a.lengths == "full", a.ctas_per_sm, a.stages, page_size,
                            a.check_only, a.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
