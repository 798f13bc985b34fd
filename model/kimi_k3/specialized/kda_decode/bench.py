"""Benchmark: standard (FLA + cuBLAS) vs specialized (CuTe DSL) KDA decode step, side by side.

Same process, same method for both: each op captured in a CUDA graph, L2 flushed (2x L2 written) before
every timed replay, CUDA events around the replay; median and IQR over `--iters` replays; host wall
time of replay + device synchronize; kernels per call counted with torch.profiler; the roofline floor
from the bytes the step must move (kernels.roofline, measured H200 bandwidth unless --measure-bw).
Outputs are checked against the reference before timing and re-checked after (fresh inputs).

    python -m model.kimi_k3.specialized.kda_decode.bench                 # 12 heads, batch 1/4/16/64
    python -m model.kimi_k3.specialized.kda_decode.bench --heads 6 12 96 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

# The step's arithmetic runs on fp32 CUDA cores, not tensor cores: its compute term uses that rate (H200).
FP32_FLOPS_PER_S = 60e12


def step_floor(heads, batch, info):
    """The step's roofline floor on `info`'s arch (kernels.roofline): the op's cost model (bytes and FLOPs of a
    shape-only case) with its bytes at the memory bandwidth, its FLOPs at the fp32 CUDA-core rate."""
    from gates.problems.kda_decode import make_case
    from kernels.roofline import floor
    from model.kimi_k3.ops.kda_decode import cost

    c = cost(*make_case(heads, batch, device="meta").args())
    return floor(c.bytes, c.flops, info, flops_per_s=FP32_FLOPS_PER_S)


def check_against_reference(impl, heads, batch, seed, exact_gemm=False):
    """Output and state relative L2 errors against the reference on one seeded case, and whether the conv
    windows are equal."""
    from gates.problems.kda_decode import make_case
    from model.kimi_k3.ops.kda_decode import kda_decode

    case = make_case(heads, batch, device="cuda", seed=seed, exact_gemm=exact_gemm)
    ref_case = case.clone_caches()
    ref = kda_decode(*ref_case.args())
    out = impl(*case.args())
    torch.cuda.synchronize()
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    srel = ((case.ssm_state - ref_case.ssm_state).double().norm() / ref_case.ssm_state.double().norm()).item()
    return rel, srel, bool(torch.equal(case.conv_state, ref_case.conv_state))


def run(heads_list, batches, iters, flush, measure_bw, check=True, tuning=None):
    from gates.problems.kda_decode import make_case
    from kernels.arch import detect, with_measured_bandwidth
    from kernels.timing import count_kernels, time_op
    from model.kimi_k3.ops.kda_decode_standard import kda_decode_standard, standard_available
    from model.kimi_k3.specialized.kda_decode import available, kda_decode_cute
    from model.kimi_k3.specialized.kda_decode.kernel import default_v_split

    info = detect()
    if measure_bw:
        info = with_measured_bandwidth(info)
    std_ok, std_why = standard_available()
    spec_ok, spec_why = available()
    impls = {}
    if std_ok:
        impls["standard"] = kda_decode_standard
    else:
        print(f"standard unavailable: {std_why}", file=sys.stderr)
    if spec_ok:
        impls["specialized"] = (lambda *a: kda_decode_cute(*a, tuning=tuning)) if tuning else kda_decode_cute
    else:
        print(f"specialized unavailable: {spec_why}", file=sys.stderr)
    rows = []
    for heads in heads_list:
        for batch in batches:
            row = dict(heads=heads, batch=batch, v_split=default_v_split(heads, batch))
            f = step_floor(heads, batch, info)
            row["floor_us"] = f.floor_us
            row["bytes"] = f.bytes_moved
            for name, impl in impls.items():
                if check:
                    rel, srel, conv_eq = check_against_reference(impl, heads, batch, seed=heads * 1000 + batch)
                    (row[f"{name}_out_rel_l2"], row[f"{name}_state_rel_l2"],
                     row[f"{name}_conv_equal"]) = rel, srel, conv_eq
                case = make_case(heads, batch, device="cuda", seed=heads + batch)
                args = case.args()
                r = time_op(lambda: impl(*args), iters=iters, flush=flush)
                row[f"{name}_us"] = r.median_us
                row[f"{name}_iqr_us"] = r.iqr_us
                row[f"{name}_host_us"] = r.host_median_us
                row[f"{name}_kernels"] = count_kernels(lambda: impl(*args))
                row[f"{name}_frac_floor"] = f.fraction(r.median_us)
                if check:  # outputs produced while timing: re-check on fresh inputs
                    rel2, _, _ = check_against_reference(impl, heads, batch, seed=heads * 1000 + batch + 1)
                    row[f"{name}_recheck_rel_l2"] = rel2
            if "standard_us" in row and "specialized_us" in row:
                row["speedup"] = row["standard_us"] / row["specialized_us"]
            rows.append(row)
            _print_row(row)
    env = dict(device=info.device_name, arch=info.arch, sm_count=info.sm_count, l2_bytes=info.l2_bytes,
               mem_bw_Bps=info.mem_bw_Bps, bw_measured=info.measured, torch=torch.__version__,
               cuda=torch.version.cuda, python=platform.python_version(), flush=flush, iters=iters,
               tuning=tuning or "default")
    try:
        import cutlass

        env["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except Exception:
        pass
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass
    return dict(env=env, rows=rows)


_HEADER = (f"{'H':>3} {'B':>3} | {'standard us':>16} {'k':>3} | {'specialized us':>16} {'k':>2} | "
           f"{'speedup':>7} | {'floor us':>8} {'spec/floor':>10} | {'host std/spec us':>16} | {'err out/state':>17}")


def _print_row(row):
    def t(name):
        if f"{name}_us" not in row:
            return f"{'-':>16}", "-"
        return f"{row[name + '_us']:8.2f} ±{row[name + '_iqr_us']:5.2f}", row[f"{name}_kernels"]

    (s, sk), (c, ck) = t("standard"), t("specialized")
    sp = f"{row['speedup']:6.2f}x" if "speedup" in row else f"{'-':>7}"
    host = f"{row.get('standard_host_us') or float('nan'):7.1f}/{row.get('specialized_host_us') or float('nan'):7.1f}"
    err = (f"{row.get('specialized_out_rel_l2', float('nan')):.1e}/"
           f"{row.get('specialized_state_rel_l2', float('nan')):.1e}")
    frac = row.get("specialized_frac_floor", row.get("standard_frac_floor", float("nan")))
    if "specialized_us" not in row:
        err = f"{row.get('standard_out_rel_l2', float('nan')):.1e}/{row.get('standard_state_rel_l2', float('nan')):.1e}"
    print(f"{row['heads']:>3} {row['batch']:>3} | {s:>16} {sk!s:>3} | {c:>16} {ck!s:>2} | {sp:>7} | "
          f"{row['floor_us']:8.2f} {frac:9.0%} | {host:>16} | {err:>17}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[12])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--flush", choices=["l2", "none"], default="l2")
    ap.add_argument("--measure-bw", action="store_true", help="measure copy bandwidth instead of 4.3 TB/s")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--tuning", help="specialized config overrides, e.g. chunk_rows=4,v_split=1")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench needs a CUDA GPU")
    print(_HEADER)
    tuning = {k: int(v) for k, v in (kv.split("=") for kv in a.tuning.split(","))} if a.tuning else None
    res = run(a.heads, a.batches, a.iters, a.flush, a.measure_bw, check=not a.no_check, tuning=tuning)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
