"""Time kernel variants (v_split, smem carveout) across batch sizes; pick the heuristic from this.

    python -m model.kimi_k3.specialized.kda_decode.explore --heads 12 --batches 1 4 16 64 --json out.json

Also times a one-kernel graph (a 4-byte fill) with the same method: the floor of the measurement itself
(graph launch + events) on this machine.
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv=None):
    from kernels.timing import time_op
    from model.kimi_k3.ops.kda import kda_decode
    from model.kimi_k3.specialized.kda_decode.inputs import make_case
    from model.kimi_k3.specialized.kda_decode.kernel import bytes_moved, kda_decode_cute

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[12])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--carveouts", type=int, nargs="+", default=[100])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    tiny = torch.zeros(1, device="cuda")
    empty = time_op(lambda: tiny.fill_(1.0), iters=a.iters)
    print(f"one-kernel graph (fill of 4 B), cold L2: {empty.median_us:.2f} us (IQR {empty.iqr_us:.2f})")
    warm_empty = time_op(lambda: tiny.fill_(1.0), iters=a.iters, flush="none")
    print(f"one-kernel graph, warm: {warm_empty.median_us:.2f} us")
    rows = [dict(kind="empty", us=empty.median_us, warm_us=warm_empty.median_us)]
    for heads in a.heads:
        for batch in a.batches:
            floor_us = bytes_moved(heads, batch) / 4.3e12 * 1e6
            line = [f"H={heads:3d} B={batch:3d} floor {floor_us:6.2f} |"]
            for split, car, chunk in [(sp, ca, ck) for sp in a.splits for ca in a.carveouts for ck in a.chunks]:
                if chunk and chunk >= 16 // split:
                    continue
                if True:
                    tuning = dict(v_split=split, smem_carveout=car, chunk_rows=chunk)
                    case = make_case(heads, batch, device="cuda", seed=batch, exact_gemm=True)
                    ref_case = case.clone_caches()
                    ref = kda_decode(*ref_case.args())
                    out = kda_decode_cute(*case.args(), tuning=tuning)
                    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                    serr = ((case.ssm_state - ref_case.ssm_state).norm() / ref_case.ssm_state.norm()).item()
                    args = case.args()
                    r = time_op(lambda: kda_decode_cute(*args, tuning=tuning), iters=a.iters)
                    rows.append(dict(kind="variant", heads=heads, batch=batch, v_split=split, carveout=car, chunk_rows=chunk,
                                     us=r.median_us, iqr_us=r.iqr_us, out_rel=err, state_rel=serr,
                                     floor_us=floor_us))
                    line.append(f"s{split}k{chunk}c{car}: {r.median_us:6.2f}{'' if err < 1e-2 and serr < 1e-4 else ' BAD'}")
            print(" ".join(line), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
