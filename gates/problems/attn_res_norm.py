"""A sublayer's input: the Block AttnRes mix, then the sublayer's RMSNorm (SPEC.md §2).

    y = attn_res_norm(sources, norm_w, proj_w, eps, out_w, out_eps)   # sources: m tensors [T, D]; y [T, D]

attn_res's inputs (gates/problems/attn_res.py: shapes, tokens, distributions, score scale) and a norm weight drawn
around one, as a trained model's are.
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point
from gates.problems import attn_res as mix_problem
from model.kimi_k3.ops.attn_res_norm import OP, attn_res_norm

SHAPE_KEYS = mix_problem.SHAPE_KEYS
EPS = mix_problem.EPS  # rms_norm_eps of the K3 config, for both the scores and the norm

reference = attn_res_norm
check = check_tensor


def generate_input(point: Point, seed: int, dist: str) -> Case:
    sources, norm_w, proj_w, eps = mix_problem.generate_input(point, seed, dist).args
    gen = torch.Generator().manual_seed(seed + 1)
    out_w = (1 + 0.1 * torch.randn(point["hidden"], generator=gen)).to(point.torch_dtype)
    return Case(args=(sources, norm_w, proj_w, eps, out_w, EPS))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
