"""A dense SiTU MLP's rank-local part (SPEC.md §5 step 12, §6): the shared experts and dense layer 0's MLP.

    y = situ_mlp(x, gate_up, down, beta, beta_lin)      # x [T, D], gate_up [2I, D], down [D, I] -> [T, D]

Shapes from the contract: `intermediate` (I, rank-local) and `hidden` (D). A verify step runs every draft position,
so a point with speculative tokens has T = batch * (1 + spec_tokens) tokens. Weights are drawn like trained ones (std
1 / sqrt(fan-in)), so the gate's pre-activations are of order one and SiTU's tanh and sigmoid are exercised across
their range; the activations follow the distribution; beta and beta_lin are K3's.
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point, sample
from model.kimi_k3.config import preset
from model.kimi_k3.ops.situ_mlp import OP, situ_mlp

SHAPE_KEYS = ("intermediate", "hidden")
K3 = preset("k3")
BETAS = (K3.activation_situ_beta, K3.activation_situ_linear_beta)

reference = situ_mlp
check = check_tensor


def generate_input(point: Point, seed: int, dist: str) -> Case:
    dtype, i, d = point.torch_dtype, point["intermediate"], point["hidden"]
    tokens = point.batch * (1 + point.spec_tokens)
    gen = torch.Generator().manual_seed(seed)
    x = sample((tokens, d), dist, gen, dtype)
    gate_up = (torch.randn(2 * i, d, generator=gen) * d**-0.5).to(dtype)
    down = (torch.randn(d, i, generator=gen) * i**-0.5).to(dtype)
    return Case(args=(x, gate_up, down, *BETAS))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
