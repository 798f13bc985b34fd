"""Benchmark (GPU) of mla_decode_cute per `partial` path against the standard, in CUDA graphs.

Per (B, L, H), every sequence at the full length L (the floor's case): the standard, and for each path
(MlaConfig.path: "fma", "mma"; "e4m3": the mma path over the same cache quantized to e4m3 with a calibrated scale,
through mla_decode_fp8_cute) the entry point end to end and its attention core alone.

Method. Per point one CUDA graph per implementation, replayed by kernels.timing.time_graphs with the L2 flushed
before each replay (flush='l2'); the median is reported. Cache bytes = B L 1152 (576 for e4m3); the floor is all
bytes / 4.3 TB/s (NOTES.md's table; the bf16 cache's); TB/s is the path's cache bytes over its core's time. Each path
is first checked at each point against a float64 reference of its own op (e4m3: over the dequantized cache): a
failure prints FAIL and that path is not timed there.

    python -m model.kimi_k3.specialized.mla_decode.bench                       # the NOTES points, 12 and 6 heads
    python -m model.kimi_k3.specialized.mla_decode.bench --paths fma mma       # both paths side by side
    python -m model.kimi_k3.specialized.mla_decode.bench --points 1x4096 64x32768 --heads 12 --paths mma
    python -m model.kimi_k3.specialized.mla_decode.bench --paths mma e4m3      # the FP8 cache beside bf16
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

HBM_BYTES_PER_S = 4.3e12
PATHS = ("fma", "mma", "e4m3")
POINTS = ("1x1024", "1x4096", "1x32768", "16x4096", "16x8192", "64x4096", "64x32768")
N, V, C, R = 128, 128, 512, 64
SCALE = 192 ** -0.5


def inputs(b: int, max_len: int, h: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(b, max_len, C + R, generator=gen, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(b, generator=gen, device="cuda")
    lengths = torch.full((b,), max_len, dtype=torch.int64, device="cuda")
    q_nope = torch.randn(b, h, N, generator=gen, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(b, h, R, generator=gen, device="cuda", dtype=torch.bfloat16)
    w_uk = (torch.randn(h, N, C, generator=gen, device="cuda") * N ** -0.5).to(torch.bfloat16)
    w_uv = (torch.randn(h, V, C, generator=gen, device="cuda") * C ** -0.5).to(torch.bfloat16)
    return q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, SCALE


def reference64(q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, scale, kv_scale: float = 1.0) -> torch.Tensor:
    outs = []
    for i in range(q_nope.shape[0]):
        ent = kv[slots[i], : int(lengths[i])].double() * kv_scale
        query = torch.cat([torch.einsum("hn,hnc->hc", q_nope[i].double(), w_uk.double()), q_pe[i].double()], -1)
        p = torch.softmax(query @ ent.T * scale, dim=-1)
        outs.append(torch.einsum("hc,hvc->hv", p @ ent[:, :C], w_uv.double()))
    return torch.stack(outs)


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


def variant(path: str, h: int, args: tuple) -> tuple:
    """(entry point, its arguments, the attention core, config, cache bytes a row) of one path on the bf16 inputs."""
    from model.kimi_k3.ops.mla_decode_fp8 import E4M3_MAX, quantize_kv
    from model.kimi_k3.specialized import mla_decode as mk
    from model.kimi_k3.specialized import mla_decode_fp8 as mk8

    q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, scale = args
    if path != "e4m3":
        cfg = mk.prepare(h, config=dataclasses.replace(mk.config_for(h), path=path))
        return lambda *a: mk.mla_decode_cute(*a, config=cfg), args, (kv, scale), cfg, C + R
    kv_scale = float(kv.abs().max()) / E4M3_MAX
    cfg = mk.prepare(h, config=mk8.config_for(h))
    kv8 = quantize_kv(kv, kv_scale)
    return (lambda *a: mk8.mla_decode_fp8_cute(*a, config=cfg), (q_nope, q_pe, kv8, kv_scale, *args[3:]),
            (kv8, scale * kv_scale), cfg, C + R)


def bench_point(b: int, max_len: int, h: int, iters: int, paths: list[str]) -> None:
    from kernels.timing import time_graphs
    from model.kimi_k3.ops.mla_decode_standard import mla_decode_standard
    from model.kimi_k3.specialized import mla_decode as mk

    args = inputs(b, max_len, h)
    q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, scale = args
    label = f"B={b:3d} L={max_len:6d} H={h:2d}"
    query = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope.float(), w_uk.float()), q_pe.float()], -1).contiguous()
    graphs, errs, row_bytes = {"standard": capture(lambda: mla_decode_standard(*args))}, {}, {}
    for path in paths:
        entry, call, (cache, core_scale), cfg, width = variant(path, h, args)
        row_bytes[path] = width * cache.element_size()
        want = reference64(q_nope, q_pe, cache, slots, lengths, w_uk, w_uv, scale, core_scale / scale)
        got = entry(*call)
        errs[path] = float((got.double() - want).norm() / want.norm())
        if not torch.isfinite(got).all() or errs[path] > 1e-2:
            print(f"FAIL {label} path {path}: rel_l2 {errs[path]:.3g}")
            continue
        graphs[f"cute {path}"] = capture(lambda entry=entry, call=call: entry(*call))
        graphs[f"core {path}"] = capture(lambda cache=cache, core_scale=core_scale, cfg=cfg: mk.attention_core(
            query, cache, slots, lengths, core_scale, cfg, C))
    us = {name: time_graphs([g], iters=iters, flush="l2").median_us for name, g in graphs.items()}
    floor = (b * max_len * (C + R) * 2 + 2 * h * N * C * 2) / HBM_BYTES_PER_S * 1e6
    print(f"{label}: standard {us['standard']:8.2f} us  floor {floor:7.2f} us (bf16 cache)")
    for path in paths:
        if f"cute {path}" in us:
            cute_us, core_us = us[f"cute {path}"], us[f"core {path}"]
            cache_bytes = b * max_len * row_bytes[path]
            print(f"    {path}: cute {cute_us:8.2f} us  core {core_us:8.2f} us "
                  f"({cache_bytes / core_us / 1e6:5.2f} TB/s)  speedup {us['standard'] / cute_us:5.2f}x  "
                  f"rel_l2 {errs[path]:.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="*", default=list(POINTS), help="BxL")
    parser.add_argument("--heads", nargs="*", type=int, default=[12, 6])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--paths", nargs="*", default=["fma", "mma"], choices=PATHS,
                        help="the `partial` paths to time (MlaConfig.path; e4m3: the mma path over an FP8 cache)")
    a = parser.parse_args(argv)
    for point in a.points:
        b, max_len = (int(x) for x in point.split("x"))
        for h in a.heads:
            bench_point(b, max_len, h, a.iters, a.paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
