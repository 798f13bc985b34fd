"""Which config of the tensor-core pair is fastest, and where the standard stands (NOTES.md): in-pipeline per-call times
of moe_experts_cute with the default config (the register ring; `tokens_first`: the grids' tiles outer, an expert's
tile read for several tokens at once, the repeats served by the L2; 8 `down` warps of 2 slots) and with one change
each: the tiles inner (session 12's default), 4 `down` warps of 4 slots (session 13's); of the default config's first
launch alone (`up`: w13 and SiTU) and of the standard, at K3's shape (896 experts, latent 3584, top-16, I = 384 at
TP8 and 256 at TP16), T = 1, 4, 16 by default; 8 distinct expert sets per graph (together far beyond the L2), routed
as the gate routes (gates/problems/moe_experts.py `routing`: each later token reuses a quarter of its experts from
earlier tokens). Each whole call is first checked against the reference on one set. The floor is the distinct
experts' bytes over 4.3 TB/s. (The CUDA-core paths, slower at every point, were timed in sessions 10-11: NOTES.md.)

    python -m model.kimi_k3.specialized.moe_experts.probe [--tokens 1 8 16] [--inter 384]

`--check-only` runs the default config once per (I, T) after the check and times nothing: under a profiler, each
launch is one of that point's (ncu -k regex:"up|down" ... --check-only --tokens 1 8 16).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from gates.problems.moe_experts import SCALINGS, routing
from kernels.timing import time_pipeline
from model.kimi_k3.ops.moe_experts import moe_experts
from model.kimi_k3.ops.moe_experts_standard import moe_experts_standard

from . import config_for, moe_experts_cute

E, L, K, SETS = 896, 3584, 16, 8
BETA, BETA_LIN = 4.0, 25.0
HBM_BYTES_PER_S = 4.3e12
UP_ONLY = "default, up only"  # the default config's first launch alone (y unwritten: timed, not checked)


def random_experts(inter: int, gen: torch.Generator):
    """Valid MXFP4 experts from random codes and scales near 2^-8 (quantizing 2 GB of bf16 per set would
    dominate the probe)."""
    def pair(rows: int, cols: int):
        codes = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, device="cuda", dtype=torch.uint8)
        return codes, torch.randint(117, 121, (E, rows, cols // 32), generator=gen, device="cuda",
                                    dtype=torch.uint8)
    return pair(2 * inter, L), pair(L, inter)


def main(tokens: list[int], inters: list[int], check_only: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for inter in inters:
        sets = [random_experts(inter, gen) for _ in range(SETS)]
        for t in tokens:
            z = torch.randn(t, L, device="cuda", dtype=torch.bfloat16, generator=gen)
            ids, weights = (x.cuda() for x in routing(t, E, K, torch.Generator().manual_seed(t), SCALINGS[0]))
            distinct = ids.unique().numel()
            floor_us = distinct * 3 * inter * L * 17 / 32 / HBM_BYTES_PER_S * 1e6  # codes + scales per weight
            want = moe_experts(z, ids, weights, *sets[0], BETA, BETA_LIN)
            print(f"I={inter} T={t:2d}: {distinct} distinct experts, floor {floor_us:.2f} us", flush=True)
            if check_only:
                got = moe_experts_cute(z, ids, weights, *sets[0], BETA, BETA_LIN)
                torch.cuda.synchronize()
                print(f"  default, once  rel_l2 {((got - want).norm() / want.norm()).item():.2e}", flush=True)
                continue
            default = config_for(t, inter)
            changes = {"tiles first": {"tokens_first": False},  # session 12's default
                       # half the warps a `down` CTA, 4 slots each, all in flight (session 13's default)
                       "down_warps 4": {"down_warps": 4, "down_stages": 4}}
            configs = {"default": default} | {name: replace(default, **fields) for name, fields in changes.items()}
            configs[UP_ONLY] = replace(default, stop_after="up")
            runs = {name: [lambda w13=w13, w2=w2, cfg=cfg: moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN,
                                                                           config=cfg) for w13, w2 in sets]
                    for name, cfg in configs.items()}
            runs["standard"] = [lambda w13=w13, w2=w2: moe_experts_standard(z, ids, weights, w13, w2, BETA, BETA_LIN)
                                for w13, w2 in sets]
            for name, fns in runs.items():
                got = [fn() for fn in fns][0]  # compiles and warms outside the capture
                check = "" if name == UP_ONLY else \
                    f"  rel_l2 {((got - want).norm() / want.norm()).item():.2e}"
                r = time_pipeline(fns, iters=30)
                print(f"  {name:24s} {r.median_us:8.2f} us  (iqr {r.iqr_us:.2f})  {floor_us / r.median_us:5.1%} "
                      f"of floor{check}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16], help="token counts T (default 1 4 16)")
    parser.add_argument("--inter", type=int, nargs="+", default=[384, 256],
                        help="intermediate dims I (default 384 256: TP8, TP16)")
    parser.add_argument("--check-only", action="store_true",
                        help="run the default config once per point after the check; time nothing (for a profiler)")
    a = parser.parse_args()
    main(a.tokens, a.inter, a.check_only)
