"""KDA decode step (spec §3): one token per sequence, after the input projection.

    out = kda_decode(proj, conv_state, ssm_state, slots, w)       # conv_state, ssm_state updated in place

Shapes from the contract: `heads` (rank-local H) and `head_dim` (K = V; also the decay gate's rank R, as in
the model). Small shapes (heads 2, head dim 16) keep CPU CI fast; the contract's real shapes (12 or 6 heads
of 128 at TP8/TP16) run on the GPU. The caches hold two more slots than the batch uses, so a write to the
wrong slot shows. Weights are drawn like trained ones; activations and states follow the distribution.
"""

from __future__ import annotations

import torch

from gates.compare import check_tensor
from gates.problems import Case, Cost, Point, UnsupportedPoint, sample
from model.kimi_k3.ops.kda import KDAColumns, KDAWeights
from model.kimi_k3.ops.kda_decode import OP, kda_decode

SHAPE_KEYS = ("heads", "head_dim")
CONV_WIDTH = 4  # short_conv_kernel_size
SPARE_SLOTS = 2
LOWER_BOUND = -5.0
NORM_EPS = 1e-5

reference = kda_decode
check = check_tensor


def _columns(point: Point) -> KDAColumns:
    return KDAColumns(heads=point["heads"], head_dim=point["head_dim"], rank=point["head_dim"])


def _proj(cols: KDAColumns, batch: int, dist: str, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    proj = sample((batch, cols.width), dist, gen, dtype)
    proj[:, cols.beta.stop:] = 0  # the packed projection's zero padding
    return proj


def generate_input(point: Point, seed: int, dist: str) -> Case:
    if point.spec_tokens:
        raise UnsupportedPoint(f"kda_decode takes one token per sequence; spec_tokens {point.spec_tokens} "
                               "belongs to a verify op")
    dtype, cols, b = point.torch_dtype, _columns(point), point.batch
    h, k, p = cols.heads, cols.head_dim, cols.p
    gen = torch.Generator().manual_seed(seed)
    slots_total = b + SPARE_SLOTS
    w = KDAWeights(
        conv_weight=torch.randn(3 * p, CONV_WIDTH, generator=gen) * 0.5,
        f_b=(torch.randn(p, cols.rank, generator=gen) * cols.rank**-0.5).to(dtype),
        A_log=torch.empty(h).uniform_(1.0, 16.0, generator=gen).log(),
        dt_bias=torch.randn(p, generator=gen) * 0.5,
        o_norm=1 + 0.1 * torch.randn(k, generator=gen),
        lower_bound=LOWER_BOUND, norm_eps=NORM_EPS)
    proj = _proj(cols, b, dist, gen, dtype)
    conv_state = sample((slots_total, 3 * p, CONV_WIDTH), dist, gen, dtype)
    ssm_state = sample((slots_total, h, k, k), dist, gen, torch.float32)
    slots = torch.randperm(slots_total, generator=gen)[:b]
    return Case(args=(proj, conv_state, ssm_state, slots, w), state=(1, 2))


def next_input(case: Case, seed: int, dist: str) -> Case:
    proj, conv_state, ssm_state, slots, w = case.args
    cols = KDAColumns.of(ssm_state, w)
    fresh = _proj(cols, proj.shape[0], dist, torch.Generator().manual_seed(seed), proj.dtype)
    return Case(args=(fresh, conv_state, ssm_state, slots, w), state=case.state)


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
