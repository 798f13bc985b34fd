"""KDA decode step (SPEC.md §3): one token per sequence, after the input projection.

    out = kda_decode(proj, conv_state, ssm_state, slots, w)       # conv_state, ssm_state updated in place

Shapes from the contract: `heads` (rank-local H) and `head_dim` (K = V; also the decay gate's rank R, as in
the model). Small shapes (heads 2, head dim 16) keep CPU CI fast; the contract's real shapes (12 or 6 heads
of 128 at TP8/TP16) run on the GPU. The caches hold two more slots than the batch uses, so a write to the
wrong slot shows. Weights are drawn like trained ones; activations and states follow the distribution.

This module is the op's one input generator: the gate draws through `generate_input`, the kernel's tests, bench and
exploration scripts through `make_case` (slot patterns, index dtypes, strided projections, the exact-GEMM inputs
whose f_b product and conv sums are exact in any summation order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point, UnsupportedPoint, sample
from model.kimi_k3.ops.kda import KDAColumns, KDAWeights
from model.kimi_k3.ops.kda_decode import OP, kda_decode

SHAPE_KEYS = ("heads", "head_dim")
SPARE_SLOTS = 2

reference = kda_decode
check = check_tensor


@dataclass
class KDACase:
    proj: torch.Tensor
    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    slots: torch.Tensor
    w: KDAWeights
    cols: KDAColumns

    def clone_caches(self) -> "KDACase":
        return KDACase(self.proj, self.conv_state.clone(), self.ssm_state.clone(), self.slots, self.w, self.cols)

    def args(self):
        return self.proj, self.conv_state, self.ssm_state, self.slots, self.w


def _dyadic(shape, levels: int, scale: float, gen, device, dtype):
    """Small integers times a power of two: products and sums of these are exact in fp32."""
    x = torch.randint(-levels, levels + 1, shape, generator=gen, device="cpu").float() * scale
    return x.to(device=device, dtype=dtype)


def make_weights(heads: int, head_dim: int = 128, rank: int = 128, conv_width: int = 4, device="cpu",
                 seed: int = 0, exact_gemm: bool = False) -> KDAWeights:
    gen = torch.Generator().manual_seed(seed)
    p = heads * head_dim
    if exact_gemm:
        f_b = _dyadic((p, rank), 3, 1 / 32, gen, device, torch.bfloat16)
    else:
        f_b = (torch.randn(p, rank, generator=gen) / math.sqrt(rank)).to(device=device, dtype=torch.bfloat16)
    if exact_gemm:  # dyadic conv taps too: the 4-term window sum is then exact in any order
        conv_weight = _dyadic((3 * p, conv_width), 4, 1 / 8, gen, device, torch.float32)
    else:
        conv_weight = (torch.randn(3 * p, conv_width, generator=gen) * 0.5).to(device)
    return KDAWeights(
        conv_weight=conv_weight,
        f_b=f_b,
        A_log=torch.log(torch.empty(heads).uniform_(1, 16, generator=gen)).to(device),
        dt_bias=(torch.randn(p, generator=gen) * 0.5).to(device),
        o_norm=(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device),
        lower_bound=-5.0,
        norm_eps=1e-5,
    )


def make_proj(cols: KDAColumns, batch: int, device="cpu", seed: int = 0, dist: str = "normal",
              exact_gemm: bool = False, stride: int | None = None) -> torch.Tensor:
    """proj [B, W] bf16: q|k|v|g|f_a|beta drawn from `dist` (one of DISTRIBUTIONS), zero pad. exact_gemm makes the
    f_a columns dyadic so the f_b product is exact in any summation order (with make_weights(exact_gemm=True)),
    and the conv inputs short (4 significant bits) so the conv sums are too. `stride` > W gives a row stride
    wider than the row (a column slice of a wider buffer)."""
    gen = torch.Generator().manual_seed(seed)
    width = stride or cols.width
    x = sample((batch, width), dist, gen, torch.float32)
    if exact_gemm:
        x[:, cols.f_a] = torch.randint(-4, 5, (batch, cols.rank), generator=gen).float() / 8
        x[:, cols.qkv] = (x[:, cols.qkv] * 8).round() / 8
    x[:, cols.beta.stop:] = 0
    return x.to(device=device, dtype=torch.bfloat16)


def make_slots(batch: int, num_slots: int, pattern: str, device="cpu", seed: int = 0,
               dtype=torch.int64) -> torch.Tensor:
    """'contiguous': slots 0..B-1; 'offset': a contiguous run not starting at 0; 'scattered': distinct random
    slots in a larger cache, in random order."""
    gen = torch.Generator().manual_seed(seed)
    if pattern == "contiguous":
        s = torch.arange(batch)
    elif pattern == "offset":
        s = torch.arange(batch) + (num_slots - batch)
    elif pattern == "scattered":
        s = torch.randperm(num_slots, generator=gen)[:batch]
    else:
        raise ValueError(f"pattern {pattern!r}")
    return s.to(device=device, dtype=dtype)


def make_case(heads: int, batch: int, *, num_slots: int | None = None, slot_pattern: str = "scattered",
              device="cpu", seed: int = 0, dist: str = "normal", exact_gemm: bool = False,
              slot_dtype=torch.int64, head_dim: int = 128, rank: int = 128, conv_width: int = 4,
              proj_stride: int | None = None) -> KDACase:
    cols = KDAColumns(heads=heads, head_dim=head_dim, rank=rank)
    num_slots = num_slots or 2 * batch + 3
    gen = torch.Generator().manual_seed(seed + 1)
    w = make_weights(heads, head_dim, rank, conv_width, device, seed, exact_gemm)
    conv_state = sample((num_slots, 3 * cols.p, conv_width), dist, gen, torch.float32)
    if exact_gemm:
        conv_state = (conv_state * 8).round() / 8
    conv_state = conv_state.to(device=device, dtype=torch.bfloat16)
    ssm_state = (sample((num_slots, heads, head_dim, head_dim), dist, gen, torch.float32) * 0.1).to(device)
    slots = make_slots(batch, num_slots, slot_pattern, device, seed, slot_dtype)
    proj = make_proj(cols, batch, device, seed + 2, dist, exact_gemm, proj_stride)
    return KDACase(proj, conv_state, ssm_state, slots, w, cols)


def generate_input(point: Point, seed: int, dist: str) -> Case:
    if point.spec_tokens:
        raise UnsupportedPoint(f"kda_decode takes one token per sequence; spec_tokens {point.spec_tokens} "
                               "belongs to a verify op")
    if point.torch_dtype != torch.bfloat16:
        raise UnsupportedPoint(f"kda_decode's inputs are bf16 activations, not {point.dtype}")
    k = point["head_dim"]
    case = make_case(point["heads"], point.batch, num_slots=point.batch + SPARE_SLOTS, seed=seed, dist=dist,
                     head_dim=k, rank=k)
    return Case(args=case.args(), state=(1, 2))


def next_input(case: Case, seed: int, dist: str) -> Case:
    proj, conv_state, ssm_state, slots, w = case.args
    fresh = make_proj(KDAColumns.of(ssm_state, w), proj.shape[0], proj.device, seed, dist)
    return Case(args=(fresh, conv_state, ssm_state, slots, w), state=case.state)


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
