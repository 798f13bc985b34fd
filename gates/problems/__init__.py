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
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from kernels.contract import BenchPoint, Contract
from model.kimi_k3.ops.op import Cost

# Inputs a shortcut can't fit: normal, heavy-tailed (Student-t, 2 degrees of freedom), large magnitude, and a
# batch mixing all three row by row (well- and ill-conditioned sequences in one step).
DISTRIBUTIONS = ("normal", "heavy_tailed", "large", "mixed")
LARGE_SCALE = 64.0
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def relative(path: Path) -> str:
    """A problem file's path as the repository names it (for messages)."""
    return str(path.relative_to(Path(__file__).resolve().parents[2]))


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


def batch_sizes(lo: int, hi: int) -> list[int]:
    """Both edges of the batch range and an odd size between them (awkward for tiles and vector widths)."""
    mid = (lo + hi) // 2 | 1
    return sorted({lo, hi} | ({mid} if lo < mid < hi else set()))


def _require_shapes(contract: Contract, problem: Problem) -> None:
    missing = [k for k in problem.shape_keys if k not in contract.shapes]
    if missing:
        raise ProblemError(f"contract shapes lacks {', '.join(missing)} (the {contract.op} problem "
                           f"{relative(problem.source)} builds its inputs from {', '.join(problem.shape_keys)})")


def _shape_values(contract: Contract, problem: Problem) -> list[tuple[tuple[str, int], ...]]:
    """Every combination of each shape's smallest and largest value (both, where a contract lists two)."""
    _require_shapes(contract, problem)
    edges = [sorted({min(contract.shapes[k]), max(contract.shapes[k])}) for k in problem.shape_keys]
    return [tuple(zip(problem.shape_keys, combo)) for combo in itertools.product(*edges)]


def envelope_points(contract: Contract, problem: Problem) -> list[Point]:
    """The points the numerics gate checks: batch edges and an odd batch between them, both spec-token edges,
    each shape's edges: where tiles run short, masks kick in and off-by-ones live."""
    specs = sorted({contract.spec_tokens.min, contract.spec_tokens.max})
    shapes = _shape_values(contract, problem)
    return [Point(b, s, shape, contract.dtypes.activations)
            for shape in shapes for s in specs for b in batch_sizes(contract.batch.min, contract.batch.max)]


def bench_point(contract: Contract, problem: Problem, point: BenchPoint) -> Point:
    """A contract benchmark point; shape keys it leaves out take the contract's first value."""
    _require_shapes(contract, problem)
    shape = tuple((k, point.shape.get(k, contract.shapes[k][0])) for k in problem.shape_keys)
    return Point(point.batch, point.spec_tokens, shape, contract.dtypes.activations)


def sample(shape: tuple[int, ...], dist: str, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random values of `dist` (one of DISTRIBUTIONS) rounded to `dtype`, drawn in fp32 on CPU."""
    if dist == "mixed":
        rows = [sample(shape[1:], DISTRIBUTIONS[i % 3], gen, torch.float32) for i in range(shape[0])]
        return torch.stack(rows).to(dtype) if rows else torch.empty(shape, dtype=dtype)
    x = torch.randn(shape, generator=gen)
    if dist == "heavy_tailed":  # Student-t, 2 dof: z / sqrt(chi2_2 / 2)
        chi2 = torch.randn((2, *shape), generator=gen).square().sum(0)
        x = x / torch.sqrt(chi2 / 2).clamp_min(1e-3)
    elif dist == "large":
        x = x * LARGE_SCALE
    elif dist != "normal":
        raise ValueError(f"unknown distribution {dist!r}; one of {DISTRIBUTIONS}")
    return x.to(dtype)


def seed_for(master: int, *labels: object) -> int:
    """A trial's seed, derived from the gate's secret master seed and what the trial is."""
    digest = hashlib.sha256(repr((master, *labels)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)

