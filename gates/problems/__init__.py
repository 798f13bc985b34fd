"""Ops as problems, gpu-mode reference-kernels style: one module `gates/problems/<op>.py` per contracted op.

A problem module defines, each small and separate:
    SHAPE_KEYS: tuple[str, ...]                the contract `shapes` keys its inputs are built from
    reference(*args)                            the ground truth: the op's reference entry point
    generate_input(point, seed, dist) -> Case   seeded inputs for one envelope point, one distribution
    check(name, got, expected, tolerance)       the checker -> compare.TensorCheck (usually compare.check_tensor)
    cost(point) -> Cost                         bytes the op must move and FLOPs it must do: the op's own cost
                                                model (`OP.cost_of`) applied to the point's inputs
and, for ops that update state in place across decode steps,
    next_input(case, seed, dist) -> Case        the next step's fresh inputs, the same weights, the state args
                                                of `case` passed through (the harness carries the state)
Problems are core code: candidates never see them, and the seed that draws checked inputs stays in the gate.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from kernels.contract import BenchPoint, Contract
from kernels.sources import REPO_ROOT
from model.kimi_k3.ops.op import Cost

# Inputs a shortcut can't fit: normal, heavy-tailed (Student-t, 2 degrees of freedom), large magnitude, and a
# batch mixing all three row by row with every fourth row zero (well- and ill-conditioned sequences in one step, and
# the rows a serving engine pads a batch with, a fresh sequence's state: a norm or a division without its guard
# makes NaN there and nowhere else).
DISTRIBUTIONS = ("normal", "heavy_tailed", "large", "mixed")
MIXED_PARTS = ("normal", "heavy_tailed", "large", "zero")
LARGE_SCALE = 64.0
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def relative(path: Path) -> str:
    """A problem file's path as the repository names it (for messages)."""
    return str(path.relative_to(REPO_ROOT))


class ProblemError(Exception):
    """A missing or malformed problem, or a contract it cannot serve; names the file."""


class UnsupportedPoint(ProblemError):
    """The problem cannot build inputs for this envelope point (the contract claims more than it checks)."""


@dataclass(frozen=True)
class Point:
    """One point of a contract's envelope: batch, speculative tokens, rank-local shapes, activation dtype."""

    batch: int
    spec_tokens: int
    shape: tuple[tuple[str, int], ...]
    dtype: str

    def __getitem__(self, key: str) -> int:
        for k, v in self.shape:
            if k == key:
                return v
        raise KeyError(key)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in TORCH_DTYPES:
            raise UnsupportedPoint(f"activation dtype {self.dtype} has no random-input generator")
        return TORCH_DTYPES[self.dtype]

    @property
    def label(self) -> str:
        return f"batch {self.batch} · {self.series}"

    @property
    def series(self) -> str:
        """Everything but the batch: the curve this point belongs to in a plot over batch sizes."""
        parts = ([f"spec {self.spec_tokens}"] if self.spec_tokens else []) + [f"{k} {v}" for k, v in self.shape]
        return " · ".join(parts + [self.dtype])


@dataclass(frozen=True)
class Case:
    """Positional arguments of one call, in the reference's order; `state` indexes the args updated in place."""

    args: tuple
    state: tuple[int, ...] = ()


@dataclass(frozen=True)
class Problem:
    op: str
    source: Path
    shape_keys: tuple[str, ...]
    reference: Callable
    generate_input: Callable[[Point, int, str], Case]
    check: Callable
    cost: Callable[[Point], Cost]
    next_input: Callable[[Case, int, str], Case] | None = field(default=None)

    @property
    def stateful(self) -> bool:
        return self.next_input is not None


def load_problem(op: str) -> Problem:
    path = Path(__file__).with_name(f"{op}.py")
    if not path.is_file():
        raise ProblemError(f"no problem for op {op!r}: write {relative(path)} (reference, generate_input, check, cost)")
    module: ModuleType = importlib.import_module(f"{__name__}.{op}")
    required = ("SHAPE_KEYS", "reference", "generate_input", "check", "cost")
    missing = [name for name in required if not hasattr(module, name)]
    if missing:
        raise ProblemError(f"{relative(path)}: missing {', '.join(missing)}")
    return Problem(op=op, source=path, shape_keys=tuple(module.SHAPE_KEYS), reference=module.reference,
                   generate_input=module.generate_input, check=module.check, cost=module.cost,
                   next_input=getattr(module, "next_input", None))


def _require_shapes(contract: Contract, problem: Problem) -> None:
    missing = [k for k in problem.shape_keys if k not in contract.shapes]
    if missing:
        raise ProblemError(f"contract shapes lacks {', '.join(missing)} (the {contract.op} problem "
                           f"{relative(problem.source)} builds its inputs from {', '.join(problem.shape_keys)})")


DRAWS_PER_SHAPE = 2  # seeded (batch, spec_tokens) draws inside the ranges, per shape combination


def _shape_combos(contract: Contract, problem: Problem, rng: random.Random) -> tuple[list[tuple], list[tuple]]:
    """(corners, interior): every combination of each shape key's smallest and largest value, and one combination
    per value strictly between them (that key at that value, every other key drawn from its listed values), so each
    value the contract admits runs in every gate run, not only the edges."""
    _require_shapes(contract, problem)
    keys = problem.shape_keys
    values = {k: sorted(set(contract.shapes[k])) for k in keys}
    corners = list(itertools.product(*[sorted({v[0], v[-1]}) for v in (values[k] for k in keys)]))
    interior = [tuple(v if other == k else rng.choice(values[other]) for other in keys)
                for k in keys for v in values[k][1:-1]]
    return [tuple(zip(keys, c)) for c in corners], [tuple(zip(keys, c)) for c in dict.fromkeys(interior)]


def stratified(lo: int, hi: int, n: int, rng: random.Random) -> list[int]:
    """`n` integers drawn across [lo, hi]: the range cut into n equal strata, one uniform draw in each, in a random
    order (so every part of a range is reached, whichever shapes the draws land on)."""
    if lo > hi or n <= 0:
        return []
    edges = [lo + round(i * (hi - lo + 1) / n) for i in range(n + 1)]
    # a range narrower than n leaves some strata empty: those draw from the whole range
    draws = [rng.randint(a, b - 1) if b > a else rng.randint(lo, hi) for a, b in zip(edges, edges[1:])]
    rng.shuffle(draws)
    return draws


def envelope_points(contract: Contract, problem: Problem, seed: int) -> list[Point]:
    """The points the numerics gate checks. Each corner shape runs at both batch edges and both speculative-token
    edges (where tiles run short, masks kick in and off-by-ones live); every shape combination, corners and interior
    values alike, also runs at DRAWS_PER_SHAPE (batch, spec_tokens) pairs drawn from `seed` (the gate's secret one):
    batches stratified across the whole range over all shapes together, speculative tokens uniform in theirs. A
    kernel wrong at an interior value the contract admits cannot count on the gate looking only at the ends."""
    rng = random.Random(seed)
    corners, interior = _shape_combos(contract, problem, rng)
    b, s = contract.batch, contract.spec_tokens
    edges = [(batch, spec) for batch in sorted({b.min, b.max}) for spec in sorted({s.min, s.max})]
    # corner shapes hold both batch edges already: their draws come from inside the range
    to_corners = [c for c in corners for _ in range(DRAWS_PER_SHAPE)]
    to_interior = [c for c in interior for _ in range(DRAWS_PER_SHAPE)]
    drawn = (list(zip(to_corners, stratified(b.min + 1, b.max - 1, len(to_corners), rng)))
             + list(zip(to_interior, stratified(b.min, b.max, len(to_interior), rng))))
    points = []
    for shape in corners + interior:
        pairs = ((edges if shape in corners else [])
                 + [(batch, rng.randint(s.min, s.max)) for where, batch in drawn if where == shape])
        points += [Point(batch, spec, shape, contract.dtypes.activations) for batch, spec in dict.fromkeys(pairs)]
    return points


SWEEP_MAX = 128  # batches the sweep calls: every one of a range up to this wide, a stratified draw of a wider one


def batch_sweep(contract: Contract, problem: Problem, points: list[Point], seed: int) -> list[Point]:
    """Every batch the contract admits, at its cheapest shape (each shape key's smallest value, a corner that
    `envelope_points` checks too), speculative tokens drawn per batch from `seed`, less what `points` already
    check: a kernel wrong at one batch of its range (one entry of a config table, a tile's tail at one size)
    cannot count on the draws missing it. A range wider than SWEEP_MAX is swept by a stratified draw of that many."""
    _require_shapes(contract, problem)
    rng = random.Random(seed)
    shape = tuple((k, min(contract.shapes[k])) for k in problem.shape_keys)
    b, s = contract.batch, contract.spec_tokens
    batches = (range(b.min, b.max + 1) if b.max - b.min < SWEEP_MAX
               else sorted(set(stratified(b.min, b.max, SWEEP_MAX, rng))))
    checked = set(points)
    sweep = [Point(batch, rng.randint(s.min, s.max), shape, contract.dtypes.activations) for batch in batches]
    return [p for p in sweep if p not in checked]


def drawn_points(contract: Contract, problem: Problem, seed: int, n: int) -> list[Point]:
    """`n` points the contract admits besides its benchmark points, drawn from `seed` (the gate's secret one) among
    the points `envelope_points` would check with it: the benchmarks time these too, so a kernel tuned only where
    the contract says it is timed (a config table with entries at the listed batches alone) is slow in a gate run,
    not first in serving. Fewer when the envelope holds fewer."""
    listed = {bench_point(contract, problem, bp) for bp in contract.benchmark.points}
    pool = [p for p in envelope_points(contract, problem, seed) if p not in listed]
    return random.Random(seed).sample(pool, min(n, len(pool)))


def coverage(contract: Contract, problem: Problem, points: list[Point]) -> dict:
    """What `points` exercise of each dimension of the contract's envelope: the values of each range (batch,
    speculative tokens) and of each listed shape, beside what the contract admits. The report lists it; the
    numerics audit holds a PASSED gate to every listed shape value."""
    return {"batch": {"admitted": [contract.batch.min, contract.batch.max],
                      "exercised": sorted({p.batch for p in points})},
            "spec_tokens": {"admitted": [contract.spec_tokens.min, contract.spec_tokens.max],
                            "exercised": sorted({p.spec_tokens for p in points})},
            "shapes": {k: {"admitted": sorted(set(contract.shapes[k])), "exercised": sorted({p[k] for p in points})}
                       for k in problem.shape_keys}}


def bench_point(contract: Contract, problem: Problem, point: BenchPoint) -> Point:
    """A contract benchmark point; shape keys it leaves out take the contract's first value."""
    _require_shapes(contract, problem)
    shape = tuple((k, point.shape.get(k, contract.shapes[k][0])) for k in problem.shape_keys)
    return Point(point.batch, point.spec_tokens, shape, contract.dtypes.activations)


def part_distribution(dist: str, i: int) -> str:
    """The distribution of part i of a draw: for "mixed", MIXED_PARTS in turn (`sample`'s rows, a cache's slots)."""
    return MIXED_PARTS[i % len(MIXED_PARTS)] if dist == "mixed" else dist


def sample(shape: tuple[int, ...], dist: str, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random values of `dist` (one of DISTRIBUTIONS) rounded to `dtype`, drawn in fp32 on CPU."""
    if dist == "mixed":
        rows = [sample(shape[1:], part_distribution(dist, i), gen, torch.float32) for i in range(shape[0])]
        return torch.stack(rows).to(dtype) if rows else torch.empty(shape, dtype=dtype)
    if dist == "zero":  # a part of "mixed" only
        return torch.zeros(shape, dtype=dtype)
    if dist == "heavy_tailed":
        return student_t2(shape, gen).to(dtype)
    if dist not in ("normal", "large"):
        raise ValueError(f"unknown distribution {dist!r}; one of {DISTRIBUTIONS}")
    x = draw(shape, gen, "normal")
    return (x.mul_(LARGE_SCALE) if dist == "large" else x).to(dtype)


DRAW_CHUNK = 1 << 22  # values a host thread draws at once, for inputs larger than one chunk


def draw(shape: tuple[int, ...], gen: torch.Generator, law: str = "normal") -> torch.Tensor:
    """fp32 standard normal or uniform [0, 1) values, a function of `gen`'s state alone. One generator is one host
    thread (torch draws serially), so an input larger than DRAW_CHUNK (a 32K-token cache is ~10^9 values) is drawn
    in chunks, each by a generator seeded from `gen`, on every core at once; smaller ones come from `gen` itself."""
    out = torch.empty(shape)
    fill = {"normal": torch.Tensor.normal_, "uniform": torch.Tensor.uniform_}[law]
    if out.numel() <= DRAW_CHUNK:
        return fill(out, generator=gen)
    chunks = out.view(-1).split(DRAW_CHUNK)
    seeds = torch.randint(2**62, (len(chunks),), generator=gen).tolist()
    with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:  # torch lets go of the GIL
        list(pool.map(lambda chunk, seed: fill(chunk, generator=torch.Generator().manual_seed(seed)), chunks, seeds))
    return out


HEAVY_TAIL_MAX = 200.0  # |value| bound of the heavy-tailed draws (see student_t2)


def student_t2(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Student-t with 2 degrees of freedom by its inverse CDF, (2u - 1) / sqrt(2u(1 - u)) = (u - 1/2) / sqrt(u(1 -
    u) / 2): one uniform draw a value (the 32K-token MLA caches are ~10^9 values, drawn on the host; z / sqrt(chi2 /
    2) took three normal draws and twice the passes). u is kept where |t| <= HEAVY_TAIL_MAX (1.25e-5 of each tail
    sits at the bound): the old draw's clamped chi2 gave its extremes the same reach (~190 in 10^9 values), which
    the contracts' tolerances were set on."""
    edge = 1 / (2 * HEAVY_TAIL_MAX**2 + 1)  # there |t| = HEAVY_TAIL_MAX - 1 / (2 HEAVY_TAIL_MAX)
    u = draw(shape, gen, "uniform").clamp_(edge, 1 - edge)
    spread = torch.rsqrt_((1 - u).mul_(u).mul_(0.5))
    return u.sub_(0.5).mul_(spread)


def seed_for(master: int, *labels: object) -> int:
    """A trial's seed, derived from the gate's secret master seed and what the trial is."""
    digest = hashlib.sha256(repr((master, *labels)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)

