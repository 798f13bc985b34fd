"""Block AttnRes mix (SPEC.md §2): a softmax over m sources (earlier block sums and the running partial) per token.

    out = attn_res(sources, norm_w, proj_w, eps)       # sources: m tensors [T, D]; out [T, D]

Shapes from the contract: `sources` (m) and `hidden` (D). A verify step scores every draft position, so a
point with speculative tokens has T = batch * (1 + spec_tokens) tokens. Sources follow the distribution; the
weights are drawn so the scores are of order one and the softmax mixes rather than picks.
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point, sample
from model.kimi_k3.ops.attn_res import OP, attn_res

SHAPE_KEYS = ("sources", "hidden")
EPS = 1e-5  # rms_norm_eps of the K3 config

reference = attn_res
check = check_tensor


def _tokens(point: Point) -> int:
    return point.batch * (1 + point.spec_tokens)


def generate_input(point: Point, seed: int, dist: str) -> Case:
    dtype, m, d, t = point.torch_dtype, point["sources"], point["hidden"], _tokens(point)
    gen = torch.Generator().manual_seed(seed)
    sources = [sample((t, d), dist, gen, dtype) for _ in range(m)]
    norm_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    proj_w = (torch.randn(1, d, generator=gen) * d**-0.5).to(dtype)
    return Case(args=(sources, norm_w, proj_w, EPS))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
