"""Probe: the gate's sampling eval over attn_res implementations, two of them correct by construction
(gates/evals/probe.py says how).

The CuTe kernel's first gate failed sampling's KL (0.237 against 1.5 x the standard path's 0.122). Is that the
kernel, or does any implementation that rounds unlike the reference fail? Candidates: `kernel` (the CuTe kernel),
`reversed` (the reference over the sources in reverse order: the same fp32 math, another rounding of the mix) and
`float64` (the mix computed in float64, rounded once: the evals gate's `gates/evals/exact.py`). NOTES.md has what it
found (results/gate1/).

    python -m model.kimi_k3.specialized.attn_res.eval_probe OUT.json [float64 kernel reversed]   # repo root, a GPU
"""
import sys
from pathlib import Path

from gates.evals.exact import attn_res_exact
from gates.evals.probe import probe
from model.kimi_k3.ops.attn_res import attn_res
from model.kimi_k3.specialized.attn_res import attn_res_cute


def reversed_order(sources, norm_w, proj_w, eps, **_):
    return attn_res(list(reversed(sources)), norm_w, proj_w, eps)


VARIANTS = {"kernel": attn_res_cute, "reversed": reversed_order, "float64": attn_res_exact}

if __name__ == "__main__":
    probe("attn_res", VARIANTS, Path(sys.argv[1]), sys.argv[2:])
