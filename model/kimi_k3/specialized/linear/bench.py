"""Benchmark: linear_cute against cuBLAS (torch.nn.functional.linear) on K3's projection shapes, side by side.

Method. Per shape, `copies` distinct weight matrices (at least 8, together at least 3x the L2), and per
implementation one CUDA graph of `copies` calls, one per matrix (x shared, as in decode, where it was just
written): replaying it streams every matrix from HBM with a cold L2 and amortizes launch latency, and the time
per call is the replay time / copies. Replays are timed by kernels.timing.time_graphs (CUDA events; a spin
kernel holds the stream while the host enqueues); the kernel's and cuBLAS's graphs alternate over `rounds`
rounds and the median of all replays is reported. Bytes per call = W + x + y; the floor is bytes / 4.3 TB/s
(the H200's measured copy bandwidth). Before timing, each (shape, M) is checked against a float64 reference
(the kernel, and cuBLAS as a control); a failure prints a FAIL line and that point is not timed.

Compiling (~2-5 s per config) dominates a run, so shapes are spread over `--procs` worker processes that compile
in parallel, then take turns (a lock) to check and time, so that only one process uses the GPU at a time.

    python -m model.kimi_k3.specialized.linear.bench --out DIR                    # every shape, M in 1 2 4 8 16 64
    python -m model.kimi_k3.specialized.linear.bench --out DIR --shapes kda_in_proj lm_head --tokens 1 8
    python -m model.kimi_k3.specialized.linear.bench --out DIR --tuning stages=2 --no-alt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import threading
import time
import traceback

import torch

from model.kimi_k3.specialized.linear.shapes import PROJECTIONS, SHAPES, bytes_moved, names

HBM_BYTES_PER_S = 4.3e12  # the H200's measured copy bandwidth (kernels/arch.py)
TOKENS = (1, 2, 4, 8, 16, 64)
ATOL, RTOL, MAX_REL_L2 = 2e-2, 1.6e-2, 1e-2


def floor_us(m: int, n: int, k: int) -> float:
    return bytes_moved(m, n, k) / HBM_BYTES_PER_S * 1e6


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[bool, str]:
    """(ok, summary) against the float64 product: relative L2 < 1e-2 and every element within atol 2e-2 + rtol
    1.6e-2 of the reference rounded to bf16."""
    want = x.double() @ w.double().t()
    want_b = want.to(torch.bfloat16).double()
    err = (y.double() - want_b).abs()
    bad = ~(err <= ATOL + RTOL * want_b.abs())
    rel = ((y.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    msg = f"rel_l2 {rel:.2e}, {int(bad.sum())}/{bad.numel()} outside tolerance, {int(y.isnan().sum())} NaN"
    if bad.any():
        i = int(err.nan_to_num(float("inf")).argmax())
        mi, ni = divmod(i, y.shape[1])
        msg += f", worst y[{mi}, {ni}] = {y[mi, ni].item():.5g} want {want[mi, ni].item():.5g}"
        rows = bad.any(0).nonzero()[:, 0]
        msg += f", tokens {sorted(set(bad.nonzero()[:, 0].tolist()))[:16]}, rows {rows[:8].tolist()}.. ({rows.numel()})"
    return (not bad.any()) and rel < MAX_REL_L2, msg


def _config_str(cfg) -> str:
    return f"{cfg.path} {cfg.block_rows}r s{cfg.split_k} st{cfg.stages}"


def _time_pair(graphs: dict, copies: int, rounds: int, iters: int) -> dict:
    """Median time per call (us) of each implementation's graph, the graphs alternating over `rounds` rounds."""
    from kernels.timing import quartiles, time_graphs

    samples = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            samples[name] += time_graphs([g], iters=iters, flush="none", host_iters=2).samples_us
    out = {}
    for name, s in samples.items():
        q1, med, q3 = quartiles([v / copies for v in s])
        out[name] = dict(us=med, iqr_us=q3 - q1, n=len(s))
    return out


def bench_shape(n: int, k: int, tokens, args, emit) -> None:
    """Check and time every M of one shape; emit(row) per point."""
    import torch.nn.functional as F

    from kernels.timing import capture_graph
    from model.kimi_k3.specialized.linear import LinearConfig, linear_cute, prepare

    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 60 * 2**20)
    copies = max(8, math.ceil(3 * l2 / (2 * n * k)))
    g = torch.Generator(device="cuda").manual_seed(n * 7919 + k)
    weights = [(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16() for _ in range(copies)]
    for m in tokens:
        row = dict(shape=names(n, k), n=n, k=k, m=m, copies=copies, bytes=bytes_moved(m, n, k),
                   floor_us=floor_us(m, n, k))
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        variants = {"kernel": prepare(m, n, k, num_sms=props.multi_processor_count)}
        if args.tuning:
            variants["kernel"] = prepare(m, n, k, config=dataclasses.replace(variants["kernel"], **args.tuning))
        if args.alt and m <= 8:  # the tensor-core path at the CUDA-core path's sizes, to place the threshold
            alt = LinearConfig.for_shape(9, n, k, props.multi_processor_count)
            variants["alt_mma"] = prepare(m, n, k, config=alt)
        row["config"] = _config_str(variants["kernel"])
        if "alt_mma" in variants:
            row["alt_config"] = _config_str(variants["alt_mma"])
        calls = {}
        for name, cfg in variants.items():
            try:
                y = linear_cute(x, weights[0], config=cfg)
                torch.cuda.synchronize()
                ok, msg = check(y, x, weights[0])
            except Exception as e:  # a launch or compile failure: report and keep going
                ok, msg = False, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            row[f"{name}_check"] = "ok" if ok else msg
            if not ok:
                print(f"FAIL {names(n, k)} N={n} K={k} M={m} {name} {_config_str(cfg)}: {msg}", flush=True)
                continue
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
            calls[name] = lambda x=x, cfg=cfg, outs=outs: [linear_cute(x, w, out=o, config=cfg)
                                                           for w, o in zip(weights, outs)]
        ok, msg = check(F.linear(x, weights[0]), x, weights[0])
        row["cublas_check"] = "ok" if ok else msg
        if not ok:
            print(f"NOTE cuBLAS vs float64 {names(n, k)} M={m}: {msg}", flush=True)
        calls["cublas"] = lambda x=x: [F.linear(x, w) for w in weights]
        graphs = {name: capture_graph(fn, warmup=2) for name, fn in calls.items()}
        for name, t in _time_pair(graphs, copies, args.rounds, args.iters).items():
            row[f"{name}_us"], row[f"{name}_iqr_us"] = t["us"], t["iqr_us"]
            row[f"{name}_tbps"] = row["bytes"] / t["us"] / 1e6
            row[f"{name}_frac_floor"] = row["floor_us"] / t["us"]
        for name in ("kernel", "alt_mma"):
            if f"{name}_us" in row:
                row[f"{name}_speedup"] = row["cublas_us"] / row[f"{name}_us"]
        del graphs
        emit(row)


def _line(row: dict) -> str:
    def t(name):
        if f"{name}_us" not in row:
            return f"{'FAIL' if row.get(name + '_check', 'ok') != 'ok' else '-':>8} {'':>5}"
        return f"{row[name + '_us']:8.2f} {row[name + '_frac_floor']:5.0%}"

    sp = f"{row['kernel_speedup']:5.2f}x" if "kernel_speedup" in row else f"{'-':>6}"
    alt = f" | {t('alt_mma')} {row['alt_mma_speedup']:5.2f}x" if "alt_mma_speedup" in row else ""
    return (f"{row['shape'][:30]:30s} {row['n']:6d}x{row['k']:<5d} {row['m']:3d} | {row.get('config', ''):17s} "
            f"{row['floor_us']:7.2f} | {t('kernel')} {row.get('kernel_tbps', float('nan')):5.2f} | {t('cublas')} | "
            f"{sp}{alt}")


HEADER = (f"{'shape':30s} {'N x K':12s} {'M':>3s} | {'config':17s} {'floor':>7s} | {'kernel us':>8s} {'floor':>5s} "
          f"{'TB/s':>5s} | {'cuBLAS':>8s} {'floor':>5s} | {'speedup':>6s} | alt mma: us, floor, speedup")


def worker(shapes, tokens, args, lock, barrier, queue) -> None:
    """Compile every config of `shapes` first (CPU only), wait for the other workers to finish compiling, then
    check and time shape by shape holding the lock (one process on the GPU at a time)."""
    from model.kimi_k3.specialized.linear import LinearConfig, prepare

    torch.cuda.set_device(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = time.time()
    for n, k in shapes:
        for m in tokens:
            try:
                cfg = prepare(m, n, k, num_sms=sms)
                if args.tuning:
                    prepare(m, n, k, config=dataclasses.replace(cfg, **args.tuning))
                if args.alt and m <= 8:
                    prepare(m, n, k, config=LinearConfig.for_shape(9, n, k, sms))
            except Exception as e:
                print(f"FAIL compile N={n} K={k} M={m}: {type(e).__name__}: {e}", flush=True)
    print(f"[pid {os.getpid()}] compiled {len(shapes)} shapes in {time.time() - t0:.0f} s", flush=True)
    if barrier is not None:
        try:
            barrier.wait(timeout=900)
        except threading.BrokenBarrierError:  # a worker died while compiling: time what this one has
            print(f"[pid {os.getpid()}] another worker never finished compiling; timing anyway", flush=True)
    for n, k in shapes:
        with lock:
            try:
                bench_shape(n, k, tokens, args, lambda row: (print(_line(row), flush=True), queue.put(row)))
            except Exception as e:
                print(f"FAIL {names(n, k)} N={n} K={k}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
            torch.cuda.empty_cache()  # this shape's weight copies


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for linear_bench.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--shapes", nargs="+", help="projection names (shapes.py), default all")
    ap.add_argument("--procs", type=int, default=8, help="worker processes (compiling in parallel); 1 = this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="replays per implementation per round")
    ap.add_argument("--no-alt", dest="alt", action="store_false", help="skip timing the mma path at M <= 8")
    ap.add_argument("--tuning", help="config overrides for the kernel, e.g. stages=2,split_k=1")
    args = ap.parse_args(argv)
    args.tuning = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.tuning.split(",")} if args.tuning else None
    if not torch.cuda.is_available():
        sys.exit("bench needs a CUDA GPU")
    shapes = [s for s in SHAPES if not args.shapes
              or any(p.name in args.shapes and (p.n, p.k) == s for p in PROJECTIONS)]
    os.makedirs(args.out, exist_ok=True)
    print(HEADER, flush=True)
    rows = []
    procs = max(1, min(args.procs, len(shapes)))
    if procs == 1:
        worker(shapes, args.tokens, args, threading.Lock(), None, _ListQueue(rows))
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        lock, barrier, queue = ctx.Lock(), ctx.Barrier(procs), ctx.Queue()
        shards = [shapes[i::procs] for i in range(procs)]
        workers = [ctx.Process(target=worker, args=(shard, args.tokens, args, lock, barrier, queue))
                   for shard in shards]
        for p in workers:
            p.start()
        expected = len(shapes) * len(args.tokens)
        while len(rows) < expected and any(p.is_alive() for p in workers):
            try:
                rows.append(queue.get(timeout=1))
            except Exception:
                pass
        while not queue.empty():
            rows.append(queue.get())
        for p in workers:
            p.join()
    order = {s: i for i, s in enumerate(SHAPES)}
    rows.sort(key=lambda r: (order[(r["n"], r["k"])], r["m"]))
    env = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
               python=platform.python_version(), hbm_bytes_per_s=HBM_BYTES_PER_S, rounds=args.rounds,
               iters=args.iters, tuning=args.tuning or "heuristic")
    try:
        import cutlass

        env["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception:
        pass
    with open(os.path.join(args.out, "linear_bench.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print("\n" + HEADER)
    for row in rows:
        print(_line(row))
    failed = [r for r in rows if any(r.get(f"{n}_check", "ok") != "ok" for n in ("kernel", "alt_mma"))]
    timed = [r for r in rows if "kernel_speedup" in r]
    if timed:
        geo = math.exp(sum(math.log(r["kernel_speedup"]) for r in timed) / len(timed))
        print(f"\n{len(rows)} points, {len(failed)} failed checks; geometric-mean speedup over cuBLAS {geo:.2f}x; "
              f"JSON: {os.path.join(args.out, 'linear_bench.json')}")
    return 1 if failed or len(rows) < len(shapes) * len(args.tokens) else 0


class _ListQueue:
    def __init__(self, rows):
        self.rows = rows

    def put(self, row):
        self.rows.append(row)


if __name__ == "__main__":
    sys.exit(main())
