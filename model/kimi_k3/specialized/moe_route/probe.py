"""Where the router's time goes (its NOTES.md): in-pipeline per-call times of the router, of the same kernel
stopped after the arrival (every CTA's fence and ticket, the last ones' wait, no selection) and after the GEMV,
of linear's own GEMV at [E, K] with fp32 out, and of the standard; then of a TP rank's local form
(`moe_route_local_cute`) at E_local 112 and 56 (TP8, TP16) beside torch's `local_candidates`; 8 distinct gate
weights per graph (together beyond the L2), at T = 1, 16, 64. `--top-k 1 4 16` adds the router at other k (the
selection's cost a round: the difference over the rounds), `--tokens` other token counts. "router" is the kernel
as the router calls it (every shortcut on: RouteConfig.lean_arrival, prefetch_bias, branchless_sigmoid; NOTES.md
sessions 31-33); the rows "plain +flag" time the kernel without them ("plain") and with each on its own, in the
same process.

    python -m model.kimi_k3.specialized.moe_route.probe [--tokens 1 16 64] [--top-k 1 4 16]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from kernels.timing import time_pipeline
from model.kimi_k3.ops.moe_route import moe_route_standard
from model.kimi_k3.ops.moe_route_tp import local_candidates

from ..linear import linear_cute
from . import moe_route_cute, moe_route_local_cute, route_config
from .kernel import SHORTCUTS

E, K, TOP_K, SETS = 896, 7168, 16, 8
LOCAL_EXPERTS = (112, 56)  # E / 8, E / 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--top-k", type=int, nargs="+", default=[], help="the router also at these k")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(E, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(SETS)]
    biases = [torch.randn(E, device="cuda") * 0.02 for _ in range(SETS)]
    sets = list(zip(weights, biases))
    for t in args.tokens:
        x = torch.randn(t, K, device="cuda", dtype=torch.bfloat16)
        logits = torch.empty(t, E, device="cuda", dtype=torch.float32)
        stages = {stage: replace(route_config(t, E, K, TOP_K), stop_after=stage) for stage in ("arrive", "gemv")}
        plain = route_config(t, E, K, TOP_K, shortcuts=False)
        shortcuts = {"": plain, **{f" +{name}": replace(plain, **{name: True}) for name in SHORTCUTS},
                     " to arrive": replace(plain, stop_after="arrive")}
        runs = {
            "router": [lambda w=w, b=b: moe_route_cute(x, w, b, TOP_K, True, 2.5) for w, b in sets],
            **{f"router to {stage}": [lambda w=w, b=b, cfg=cfg: moe_route_cute(x, w, b, TOP_K, True, 2.5, config=cfg)
                                      for w, b in sets] for stage, cfg in stages.items()},
            **{f"plain{name}": [lambda w=w, b=b, cfg=cfg: moe_route_cute(x, w, b, TOP_K, True, 2.5, config=cfg)
                                for w, b in sets] for name, cfg in shortcuts.items()},
            "linear's GEMV": [lambda w=w: linear_cute(x, w, out=logits) for w in weights],
            "standard": [lambda w=w, b=b: moe_route_standard(x, w, b, TOP_K, True, 2.5) for w, b in sets],
        }
        for k in args.top_k:
            runs[f"router k={k}"] = [lambda w=w, b=b, k=k: moe_route_cute(x, w, b, k, True, 2.5) for w, b in sets]
        for n in LOCAL_EXPERTS:  # the last rank's slice (any rank's costs the same)
            local = [(w[E - n:].contiguous(), b[E - n:].contiguous()) for w, b in sets]
            runs[f"local E={n}"] = [lambda w=w, b=b: moe_route_local_cute(x, w, b, TOP_K, E - n) for w, b in local]
            runs[f"local E={n} torch"] = [lambda w=w, b=b: local_candidates(x, w, b, TOP_K, E - n) for w, b in local]
        for name, fns in runs.items():
            for fn in fns:  # compile and warm outside the capture
                fn()
            r = time_pipeline(fns, iters=30)
            print(f"T={t:3d} {name:32s} {r.median_us:8.2f} us  (iqr {r.iqr_us:.2f})", flush=True)


if __name__ == "__main__":
    main()
