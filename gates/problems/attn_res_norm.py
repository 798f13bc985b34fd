"""A sublayer's input: the Block AttnRes mix, then the sublayer's RMSNorm (SPEC.md §2), with the running partial
sum's add where the layer has one.

    y = attn_res_norm(sources, norm_w, proj_w, eps, out_w, out_eps)                   # partial_terms 1
    y, summed = attn_res_norm(sources, norm_w, proj_w, eps, out_w, out_eps, addend)   # partial_terms 2

attn_res's inputs (gates/problems/attn_res.py: shapes, tokens, distributions, score scale), a norm weight drawn
around one, as a trained model's are, and (shape key `partial_terms` 2) an addend [T, D] of the sources'
distribution.
The check: y within the contract's tolerance; the sum (`out[1]`) exactly, since a bf16 add has one right answer and
the layer carries it on as its residual stream.
"""

from __future__ import annotations

import torch

from gates.core.compare import TensorCheck, check_exact, check_tensor
from gates.problems import Case, Cost, Point, sample
from gates.problems import attn_res as mix_problem
from model.kimi_k3.ops.attn_res_norm import OP, attn_res_norm

SHAPE_KEYS = (*mix_problem.SHAPE_KEYS, "partial_terms")
EPS = mix_problem.EPS  # rms_norm_eps of the K3 config, for both the scores and the norm
SUM = "out[1]"  # the partial sum's name among the outputs (kernels/trees.py's leaves)

reference = attn_res_norm


def check(name: str, got: torch.Tensor, expected: torch.Tensor, tolerance) -> TensorCheck:
    return check_exact(name, got, expected) if name == SUM else check_tensor(name, got, expected, tolerance)


def generate_input(point: Point, seed: int, dist: str) -> Case:
    sources, norm_w, proj_w, eps = mix_problem.generate_input(point, seed, dist).args
    gen = torch.Generator().manual_seed(seed + 1)
    out_w = (1 + 0.1 * torch.randn(point["hidden"], generator=gen)).to(point.torch_dtype)
    addend = sample(sources[-1].shape, dist, gen, point.torch_dtype) if point["partial_terms"] == 2 else None
    return Case(args=(sources, norm_w, proj_w, eps, out_w, EPS, addend))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
