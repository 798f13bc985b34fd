"""Where the router's time goes (its NOTES.md): in-pipeline per-call times of the router, of the same kernel
stopped after the arrival (every CTA's fence and ticket, the last ones' wait, no selection) and after the GEMV,
of linear's own GEMV at [E, K] with fp32 out, and of the standard; 8 distinct gate weights per graph (together
beyond the L2), at T = 1, 16, 64.   python -m model.kimi_k3.specialized.moe_route.probe
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kernels.timing import time_pipeline
from model.kimi_k3.ops.moe_route import moe_route_standard

from ..linear import linear_cute
from . import moe_route_cute, route_config

E, K, TOP_K, SETS = 896, 7168, 16, 8


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(E, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(SETS)]
    biases = [torch.randn(E, device="cuda") * 0.02 for _ in range(SETS)]
    for t in (1, 16, 64):
        x = torch.randn(t, K, device="cuda", dtype=torch.bfloat16)
        logits = torch.empty(t, E, device="cuda", dtype=torch.float32)
        stages = {stage: replace(route_config(t, E, K, TOP_K), stop_after=stage) for stage in ("arrive", "gemv")}
        runs = {
            "router": [lambda w=w, b=b: moe_route_cute(x, w, b, TOP_K, True, 2.5) for w, b in zip(weights, biases)],
            **{f"router to {stage}": [lambda w=w, b=b, cfg=cfg: moe_route_cute(x, w, b, TOP_K, True, 2.5, config=cfg)
                                      for w, b in zip(weights, biases)] for stage, cfg in stages.items()},
            "linear's GEMV": [lambda w=w: linear_cute(x, w, out=logits) for w in weights],
            "standard": [lambda w=w, b=b: moe_route_standard(x, w, b, TOP_K, True, 2.5)
                         for w, b in zip(weights, biases)],
        }
        for name, fns in runs.items():
            for fn in fns:  # compile and warm outside the capture
                fn()
            r = time_pipeline(fns, iters=30)
            print(f"T={t:3d} {name:18s} {r.median_us:8.2f} us  (iqr {r.iqr_us:.2f})", flush=True)


if __name__ == "__main__":
    main()
