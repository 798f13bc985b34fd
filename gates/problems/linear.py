"""One bf16 projection of a decode layer (SPEC.md §9 lists them per rank): y = x W^T.

    y = linear(x, weight)        # x [T, in_features], weight [out_features, in_features] -> [T, out_features]

Shapes from the contract: `out_features` and `in_features` (a contract lists the projections its kernel serves).
A verify step projects every draft position, so a point with speculative tokens has T = batch * (1 + spec_tokens)
rows. Weights are drawn like trained ones (std 1/sqrt(in_features)); the activations follow the distribution, and
every other input set reads x as a column slice of a wider buffer (a row stride larger than the row, as a
projection of a packed activation sees it).
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point, sample
from model.kimi_k3.ops.linear import OP, linear

SHAPE_KEYS = ("out_features", "in_features")
STRIDE_PAD = 64  # extra columns of the wider buffer a strided x is sliced from

reference = linear
check = check_tensor


def generate_input(point: Point, seed: int, dist: str) -> Case:
    dtype, n, k = point.torch_dtype, point["out_features"], point["in_features"]
    tokens = point.batch * (1 + point.spec_tokens)
    gen = torch.Generator().manual_seed(seed)
    strided = seed % 2 == 1
    x = sample((tokens, k + STRIDE_PAD if strided else k), dist, gen, dtype)[:, :k]
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    return Case(args=(x, weight))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
