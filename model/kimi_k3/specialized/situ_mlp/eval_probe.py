"""Probe: the gate's sampling eval over situ_mlp implementations, two of them correct by construction
(gates/evals/probe.py says how).

Gate 2 failed sampling's mean KL at T = 1 (0.00955 against 1.5 x the standard path's 0.00542). The standard rounds as
the reference does (cuBLAS and the reference's own SiTU; at one token cuBLAS and the reference's fp32 GEMM sum alike),
the kernel's GEMV sums K in another order. Candidates: `kernel` (the contract's implementation), `split_k` (the
reference with each product's K summed in two halves: the same fp32 math, another rounding of each sum) and `float64`
(the MLP in float64, rounded once). NOTES.md has what it found (gate 3: all three at the standard's distance, so the
op keeps the plain yardstick; results/gate3/).

    python -m model.kimi_k3.specialized.situ_mlp.eval_probe OUT.json [kernel split_k float64]   # repo root, a GPU
"""
import sys
from pathlib import Path

import torch

from gates.evals.probe import probe
from model.kimi_k3.ops.situ_mlp import situ
from model.kimi_k3.specialized.situ_mlp import situ_mlp_cute


def linear_split_k(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32 with K summed as two halves, rounded to x's dtype once."""
    h = x.shape[-1] // 2
    xf, wf = x.float(), w.float()
    return (xf[..., :h] @ wf[:, :h].T + xf[..., h:] @ wf[:, h:].T).to(x.dtype)


def split_k(x, gate_up, down, beta, beta_lin, **_):
    a, b = linear_split_k(x, gate_up).chunk(2, dim=-1)
    return linear_split_k(situ(a, b, beta, beta_lin), down)


def float64(x, gate_up, down, beta, beta_lin, **_):
    """The MLP in float64 with no intermediate rounding, rounded once to x's dtype."""
    a, b = (x.double() @ gate_up.double().T).chunk(2, dim=-1)
    h = beta * torch.tanh(a / beta) * torch.sigmoid(a) * (beta_lin * torch.tanh(b / beta_lin))
    return (h @ down.double().T).to(x.dtype)


VARIANTS = {"kernel": situ_mlp_cute, "split_k": split_k, "float64": float64}

if __name__ == "__main__":
    probe("situ_mlp", VARIANTS, Path(sys.argv[1]), sys.argv[2:])
