"""One-call GPU probe of the library standards: moe_experts (humming), attn_res (torch), rms_norm (FLA).

Installs nothing. For each op and batch: numerics of each standard against the reference at K3 shapes, then
device time under CUDA graphs (kernels.timing: capture_graph + time_graphs, L2 flushed before every replay)
of the standard against the reference composition. The MoE reference (`moe.moe_experts`) synchronizes the
host (`ids.unique().tolist()`) and cannot be captured: it is timed eagerly (kernels.timing.time_eager, few
iterations) and the capturable PyTorch fallback composition is timed under graphs beside it. A failing op or
batch prints its traceback and the probe goes on. A compact table is printed last; everything goes to
DIR/probe_standards.json.

    python -m model.kimi_k3.bench.probe_standards --out DIR                  # TP8 experts, batch 1 16 64
    python -m model.kimi_k3.bench.probe_standards --out DIR --tp 8 16 --batches 1 16 64 512 --flash-attn-res

The case builders (make_mxfp4_experts, make_routing, compare) are shared with tests/ops/test_library_standards.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

K3_EXPERTS = 896
K3_LATENT = 3584
K3_HIDDEN = 7168
K3_TOP_K = 16
K3_BETA, K3_BETA_LIN = 4.0, 25.0
K3_EPS = 1e-5
# rank-local routed-expert intermediate size (padded, real) per TP degree: 3072/8 = 384; 3072/16 = 192 -> 256
K3_INTER = {8: (384, 384), 16: (256, 192)}
ATOL, RTOL, MAX_REL_L2, MIN_CLOSE = 2e-2, 1.6e-2, 1e-2, 0.999
DEVICE = "cuda"  # --dry-run: "cpu" (and small shapes), to exercise the probe's code paths without a GPU


# ---------------------------------------------------------------------------------------------------------
# cases (shared with the tests)
# ---------------------------------------------------------------------------------------------------------

def make_mxfp4_experts(num_experts: int, inter: int, latent: int, *, inter_real: int | None = None, seed: int = 0,
                       device=None, chunk: int = 64, dense: bool = False):
    """Random bf16 expert weights quantized with `mxfp4.quantize` (the checkpoint's format), as the MoE layer
    holds them: w13 = (packed [E, 2I, L/2], scale [E, 2I, L/32]) with rows 0..I-1 = w1 (gate) and I..2I-1 = w3
    (up), w2 = (packed [E, L, I/2], scale [E, L, I/32]). inter_real < inter zero-pads like TP16's 192 -> 256
    (w1/w3 rows and w2 columns past inter_real are zero). Scales: w13 ~ N(0, 1/L), w2 ~ N(0, 1/inter_real).
    dense=True returns the bf16 weights as ((w13,), (w2,)) instead."""
    from model.kimi_k3 import mxfp4

    device = device or DEVICE
    inter_real = inter_real or inter
    g = torch.Generator(device=device).manual_seed(seed)
    bf16, u8 = torch.bfloat16, torch.uint8
    if dense:
        w13 = torch.empty(num_experts, 2 * inter, latent, dtype=bf16, device=device)
        w2 = torch.empty(num_experts, latent, inter, dtype=bf16, device=device)
    else:
        p13 = torch.empty(num_experts, 2 * inter, latent // 2, dtype=u8, device=device)
        s13 = torch.empty(num_experts, 2 * inter, latent // 32, dtype=u8, device=device)
        p2 = torch.empty(num_experts, latent, inter // 2, dtype=u8, device=device)
        s2 = torch.empty(num_experts, latent, inter // 32, dtype=u8, device=device)
    for e0 in range(0, num_experts, chunk):
        ec = min(chunk, num_experts - e0)
        a = torch.randn(ec, 2 * inter, latent, generator=g, device=device) * latent ** -0.5
        a[:, inter_real:inter] = 0
        a[:, inter + inter_real:] = 0
        b = torch.randn(ec, latent, inter, generator=g, device=device) * inter_real ** -0.5
        b[:, :, inter_real:] = 0
        a, b = a.to(bf16), b.to(bf16)
        if dense:
            w13[e0:e0 + ec], w2[e0:e0 + ec] = a, b
            continue
        pk, sc = mxfp4.quantize(a.reshape(-1, latent))
        p13[e0:e0 + ec], s13[e0:e0 + ec] = pk.view(ec, 2 * inter, -1), sc.view(ec, 2 * inter, -1)
        pk, sc = mxfp4.quantize(b.reshape(-1, inter))
        p2[e0:e0 + ec], s2[e0:e0 + ec] = pk.view(ec, latent, -1), sc.view(ec, latent, -1)
        del a, b, pk, sc
    if dense:
        return (w13,), (w2,)
    return (p13, s13), (p2, s2)


def make_routing(tokens: int, num_experts: int, top_k: int, *, seed: int = 0, device=None, hidden: int = 64):
    """(ids int64 [T, k], weights fp32 [T, k]) from the model's sigmoid top-k router on random inputs."""
    from model.kimi_k3.ops.moe_route import moe_route as route

    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device)
    gate = torch.randn(num_experts, hidden, generator=g, device=device)
    return route(x, gate, torch.zeros(num_experts, device=device), top_k, True, 1.0)


def make_z(tokens: int, latent: int, *, seed: int = 0, device=None, dtype=torch.bfloat16):
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed + 7919)
    return torch.randn(tokens, latent, generator=g, device=device).to(dtype)


def make_attn_res_case(m: int, tokens: int, hidden: int, *, seed: int = 0, device=None, dtype=torch.bfloat16):
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    sources = [(torch.randn(tokens, hidden, generator=g, device=device) * (1 + i)).to(dtype) for i in range(m)]
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16)
    proj_w = (torch.randn(1, hidden, generator=g, device=device) * hidden ** -0.5).to(torch.bfloat16)
    return sources, norm_w, proj_w


def make_rms_case(tokens: int, hidden: int, *, seed: int = 0, device=None, dtype=torch.bfloat16):
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g, device=device) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16)
    return x, w


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> dict:
    """Relative L2 error, fraction of elements within atol + rtol|ref|, max |diff|, bitwise equality."""
    o, r = out.double(), ref.double()
    diff = (o - r).abs()
    return {
        "shape_ok": tuple(out.shape) == tuple(ref.shape), "dtype": str(out.dtype).removeprefix("torch."),
        "finite": bool(torch.isfinite(o).all()),
        "rel_l2": float((o - r).norm() / r.norm().clamp_min(1e-30)),
        "close_frac": float((diff <= atol + rtol * r.abs()).double().mean()),
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "ref_max_abs": float(r.abs().max()) if r.numel() else 0.0,
        "equal": bool(torch.equal(out, ref)),
    }


def passes(m: dict, max_rel: float = MAX_REL_L2, min_close: float = MIN_CLOSE) -> bool:
    return m["shape_ok"] and m["finite"] and m["rel_l2"] <= max_rel and m["close_frac"] >= min_close


def fmt(m: dict) -> str:
    return (f"rel_l2 {m['rel_l2']:.2e} close {m['close_frac']:.5f} max|d| {m['max_abs']:.2e} "
            f"(|ref| max {m['ref_max_abs']:.2e}) equal={m['equal']}")


# ---------------------------------------------------------------------------------------------------------
# probe
# ---------------------------------------------------------------------------------------------------------

def _sync():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _wall_time(fn, iters: int) -> dict:
    """--dry-run stand-in for the GPU timers: host wall time of eager calls."""
    import statistics

    fn()
    xs = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e6)
    return {"median_us": statistics.median(xs), "iqr_us": 0.0, "graph": False, "method": "dry-run wall time"}


def _graph_time(fn, iters: int) -> dict:
    """Device time of fn captured in a CUDA graph (kernels.timing.time_graphs, L2 flushed before each replay),
    and whether the graph's output equals an eager call's (bitwise, and its relative L2 distance)."""
    from kernels.timing import capture_graph, time_graphs

    if DEVICE == "cpu":
        return _wall_time(fn, 2)
    held: dict = {}
    g = capture_graph(lambda: held.update(out=fn()))
    out = held["out"]  # the captured call's output, which every replay rewrites
    r = time_graphs([g], iters=iters)
    d = r.as_dict()
    d["graph"] = True
    eager = fn()
    torch.cuda.synchronize()
    if isinstance(out, torch.Tensor):
        c = compare(out, eager)
        d["graph_equals_eager"], d["graph_vs_eager_rel_l2"] = c["equal"], c["rel_l2"]
    return d


def _eager_time(fn, iters: int) -> dict:
    from kernels.timing import time_eager

    if DEVICE == "cpu":
        return _wall_time(fn, 1)
    d = time_eager(fn, iters=iters, warmup=1).as_dict()
    d["graph"] = False
    return d


def _kernels(fn) -> int | None:
    try:
        from kernels.timing import count_kernels

        return count_kernels(fn, warmup=1)
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


class Probe:
    def __init__(self, out_dir: Path, iters: int, ref_iters: int):
        self.out_dir, self.iters, self.ref_iters = out_dir, iters, ref_iters
        self.rows: list[dict] = []
        self.errors: list[dict] = []
        self.info: dict = {}

    def guard(self, what: str, fn):
        t0 = time.time()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - report and go on
            tb = traceback.format_exc()
            print(f"\n!!! {what} FAILED after {time.time() - t0:.1f}s: {type(e).__name__}: {e}\n{tb}", flush=True)
            self.errors.append({"what": what, "error": f"{type(e).__name__}: {e}", "traceback": tb})
            return None

    def row(self, **kw):
        self.rows.append(kw)
        num = kw.get("numerics")
        t = kw.get("timing", {})
        us = f"{t['median_us']:.1f} us" if t else "-"
        print(f"  {kw['op']:<9} {kw['variant']:<22} T={kw['T']:<4} {us:>12}  "
              f"{fmt(num) if num else ''}  ok={kw.get('ok')}", flush=True)

    def save(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "probe_standards.json"
        with open(path, "w") as f:
            json.dump({"info": self.info, "rows": self.rows, "errors": self.errors}, f, indent=1, default=str)
        return path


def probe_moe(p: Probe, tp: int, batches: list[int], fallback_timing: bool):
    from model.kimi_k3.ops import moe_experts_standard as M
    from model.kimi_k3.ops.moe_experts import moe_experts

    inter, inter_real = K3_INTER[tp]
    print(f"\n== moe_experts TP{tp}: E={K3_EXPERTS} I={inter} (real {inter_real}) L={K3_LATENT} k={K3_TOP_K} ==",
          flush=True)
    print(f"   standard: {M.standard_label()}", flush=True)
    t0 = time.time()
    w13, w2 = make_mxfp4_experts(K3_EXPERTS, inter, K3_LATENT, inter_real=inter_real, seed=tp)
    _sync()
    print(f"   experts made in {time.time() - t0:.1f}s", flush=True)
    ok, why = M.standard_available()
    key = f"moe_tp{tp}"
    p.info[key] = {"standard_available": [ok, why], "label": M.standard_label()}
    experts = None
    if ok:
        t0 = time.time()
        experts = p.guard(f"moe TP{tp} humming prepare", lambda: M.prepare(w13, w2))
        _sync()
        p.info[key]["prepare_s"] = time.time() - t0
        if experts is not None:
            p.info[key]["extra_device_bytes"] = experts.extra_bytes
            print(f"   humming prepare (repack) {time.time() - t0:.1f}s, "
                  f"extra device bytes {experts.extra_bytes / 2**30:.3f} GiB",
                  flush=True)
            warm = p.guard(f"moe TP{tp} humming warmup", lambda: experts.warmup(batches, K3_TOP_K))
            p.info[key]["warmup"] = warm
            print(f"   humming warmup (parallel GEMM compile, first calls): {warm}", flush=True)

    for t in batches:
        ids, weights = make_routing(t, K3_EXPERTS, K3_TOP_K, seed=100 + t)
        z = make_z(t, K3_LATENT, seed=t)
        ref = p.guard(f"moe TP{tp} T={t} reference",
                      lambda: moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN))
        ref_time = None
        if ref is not None and p.ref_iters > 0:
            ref_time = p.guard(f"moe TP{tp} T={t} reference timing", lambda: _eager_time(
                lambda: moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN), p.ref_iters))
        if ref is not None:
            p.row(op="moe", variant=f"reference TP{tp}", T=t, timing=ref_time, ok=True)

        variants = []
        if experts is not None:
            for mode in M.SITU_MODES:
                variants.append((f"humming/situ={mode} TP{tp}",
                                 (lambda mode=mode: experts(z, ids, weights, K3_BETA, K3_BETA_LIN, situ=mode))))
        if fallback_timing or experts is None:
            variants.append((f"fallback TP{tp}",
                             lambda: M.moe_experts_fallback(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)))

        for name, fn in variants:
            def one(name=name, fn=fn):
                t0 = time.time()
                out = fn()
                _sync()
                first_s = time.time() - t0
                num = compare(out, ref) if ref is not None else None
                timing = _graph_time(fn, p.iters)
                extra = {"first_call_s": first_s, "eager_repeat_equal": compare(fn(), out)["equal"]}
                if name.startswith("humming"):
                    plan = experts.plan(t, K3_TOP_K)
                    extra["plan"] = {"block13": plan.block13, "block2": plan.block2, "configs": plan.configs}
                    extra["kernels_per_call"] = _kernels(fn)
                spd = (ref_time["median_us"] / timing["median_us"]) if ref_time else None
                p.row(op="moe", variant=name, T=t, timing=timing, numerics=num, ok=(num is None or passes(num)),
                      speedup_vs_reference=spd, **extra)

            p.guard(f"moe {name} T={t}", one)
    M.clear_cache()  # the repacked copy; this TP's checkpoint tensors go with the function's locals


def probe_attn_res(p: Probe, batches: list[int], sources: list[int], flash: bool):
    from model.kimi_k3.ops import attn_res_standard as A
    from model.kimi_k3.ops.attn_res import attn_res

    print(f"\n== attn_res D={K3_HIDDEN}: {A.standard_label()} ==", flush=True)
    p.info["attn_res"] = {"label": A.standard_label(), "flash_attn_res": list(A.flash_attn_res_available())}
    for m in sources:
        for t in batches:
            src, nw, pw = make_attn_res_case(m, t, K3_HIDDEN, seed=m * 1000 + t)

            def one(m=m, t=t, src=src, nw=nw, pw=pw):
                ref_fn = lambda: attn_res(src, nw, pw, K3_EPS)  # noqa: E731
                ref = ref_fn()
                ref_t = _graph_time(ref_fn, p.iters)
                p.row(op="attn_res", variant=f"reference m={m}", T=t, timing=ref_t, ok=True)
                impls = [("standard", lambda: A.attn_res_standard(src, nw, pw, K3_EPS))]
                if flash:
                    impls.append(("flash-attn-res padded", lambda: A.attn_res_flash_padded(src, nw, pw, K3_EPS)))
                for name, fn in impls:
                    def run(name=name, fn=fn):
                        num = compare(fn(), ref)
                        timing = _graph_time(fn, p.iters)
                        p.row(op="attn_res", variant=f"{name} m={m}", T=t, timing=timing, numerics=num,
                              ok=passes(num, max_rel=1e-2, min_close=0.999), kernels_per_call=_kernels(fn),
                              speedup_vs_reference=ref_t["median_us"] / timing["median_us"])

                    p.guard(f"attn_res {name} m={m} T={t}", run)

            p.guard(f"attn_res m={m} T={t}", one)


def probe_rms_norm(p: Probe, batches: list[int], dims: list[int]):
    from model.kimi_k3.ops import rms_norm_standard as R
    from model.kimi_k3.ops.rms_norm import rms_norm

    ok, why = R.standard_available()
    print(f"\n== rms_norm: {R.standard_label()} (available: {ok}, {why}) ==", flush=True)
    p.info["rms_norm"] = {"label": R.standard_label(), "standard_available": [ok, why]}
    for d in dims:
        for t in batches:
            x, w = make_rms_case(t, d, seed=d + t)

            def one(d=d, t=t, x=x, w=w):
                ref_fn = lambda: rms_norm(x, w, K3_EPS)  # noqa: E731
                std_fn = lambda: R.rms_norm_standard(x, w, K3_EPS)  # noqa: E731
                ref = ref_fn()
                num = compare(std_fn(), ref)
                ref_t = _graph_time(ref_fn, p.iters)
                std_t = _graph_time(std_fn, p.iters)
                p.row(op="rms_norm", variant=f"reference D={d}", T=t, timing=ref_t, ok=True)
                p.row(op="rms_norm", variant=f"standard D={d}", T=t, timing=std_t, numerics=num,
                      ok=passes(num, max_rel=4e-3, min_close=0.999), kernels_per_call=_kernels(std_fn),
                      speedup_vs_reference=ref_t["median_us"] / std_t["median_us"])

            p.guard(f"rms_norm D={d} T={t}", one)


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    from importlib import metadata

    for dist in ("triton", "humming-kernels", "fla-core", "flash-attn-res", "cuda-bindings", "packaging", "filelock"):
        try:
            v[dist] = metadata.version(dist)
        except Exception:  # noqa: BLE001
            v[dist] = None
    if torch.cuda.is_available():
        v["device"] = torch.cuda.get_device_name()
        v["capability"] = list(torch.cuda.get_device_capability())
    v["env"] = {k: os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH", "HUMMING_CACHE_DIR", "HUMMING_TMP_DIR",
                                                "HUMMING_COMPILER", "K3_MOE_STANDARD_SITU")}
    return v


def print_table(p: Probe):
    print("\n" + "=" * 124)
    print(f"{'op':<9} {'variant':<26} {'T':>4} {'median us':>10} {'IQR':>8} {'graph':>5} {'g=e':>5} {'x ref':>7} "
          f"{'kern':>5} {'rel_l2':>9} {'close':>8} {'ok':>5}")
    print("-" * 124)
    for r in p.rows:
        t = r.get("timing") or {}
        n = r.get("numerics") or {}
        spd = r.get("speedup_vs_reference")
        print(f"{r['op']:<9} {r['variant']:<26} {r['T']:>4} {t.get('median_us', float('nan')):>10.1f} "
              f"{t.get('iqr_us', float('nan')):>8.1f} {str(t.get('graph', '-')):>5} "
              f"{str(t.get('graph_equals_eager', '-')):>5} {(f'{spd:.2f}x' if spd else '-'):>7} "
              f"{str(r.get('kernels_per_call', '-')):>5} "
              f"{n.get('rel_l2', float('nan')):>9.2e} {n.get('close_frac', float('nan')):>8.5f} {str(r.get('ok')):>5}")
    print("-" * 124)
    print("g=e: the graph replay's output is bitwise equal to an eager call's; x ref: reference time / this time "
          "(the MoE reference is timed eagerly: it syncs the host)")
    bad = [r for r in p.rows if r.get("ok") is False]
    print(f"{len(p.rows)} rows, {len(bad)} numerics failures, {len(p.errors)} errors"
          + "".join(f"\n  ERROR {e['what']}: {e['error']}" for e in p.errors)
          + "".join(f"\n  NUMERICS {r['op']} {r['variant']} T={r['T']}: {fmt(r['numerics'])}" for r in bad))


def _dry_run_shapes():
    global DEVICE, K3_EXPERTS, K3_LATENT, K3_HIDDEN, K3_INTER
    DEVICE, K3_EXPERTS, K3_LATENT, K3_HIDDEN = "cpu", 16, 256, 512
    K3_INTER = {8: (64, 64), 16: (64, 48)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for probe_standards.json")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tp", type=int, nargs="+", default=[8], choices=sorted(K3_INTER))
    ap.add_argument("--ops", nargs="+", default=["moe", "attn_res", "rms_norm"],
                    choices=["moe", "attn_res", "rms_norm"])
    ap.add_argument("--iters", type=int, default=100, help="timed graph replays per measurement")
    ap.add_argument("--ref-iters", type=int, default=3, help="eager timed calls of the (uncapturable) MoE reference")
    ap.add_argument("--attn-sources", type=int, nargs="+", default=[9])
    ap.add_argument("--rms-dims", type=int, nargs="+", default=[K3_HIDDEN, K3_LATENT])
    ap.add_argument("--no-fallback-timing", action="store_true", help="skip the MoE PyTorch fallback")
    ap.add_argument("--flash-attn-res", action="store_true", help="also time flash-attn-res on zero-padded D")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, small shapes, wall-clock timers: checks the probe itself")
    a = ap.parse_args(argv)
    if a.dry_run:
        _dry_run_shapes()
    elif not torch.cuda.is_available():
        sys.exit("probe_standards needs a CUDA GPU (or --dry-run)")
    p = Probe(Path(a.out), a.iters, a.ref_iters)
    p.info["versions"] = _versions()
    p.info["args"] = vars(a)
    print(json.dumps(p.info["versions"], indent=1), flush=True)
    t0 = time.time()
    if "moe" in a.ops:
        for tp in a.tp:
            p.guard(f"moe TP{tp}", lambda tp=tp: probe_moe(p, tp, a.batches, not a.no_fallback_timing))
            p.save()
    if "attn_res" in a.ops:
        p.guard("attn_res", lambda: probe_attn_res(p, a.batches, a.attn_sources, a.flash_attn_res))
        p.save()
    if "rms_norm" in a.ops:
        p.guard("rms_norm", lambda: probe_rms_norm(p, a.batches, a.rms_dims))
    p.info["wall_s"] = time.time() - t0
    path = p.save()
    print_table(p)
    print(f"json: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
