"""Graded comparison of a candidate's tensor against the reference's (vLLM `tests/kernels/utils.py` style).

Error is measured in tolerance units, |got - ref| / (atol * scale + rtol * |ref|), all in float64, where scale is
the reference's RMS where that exceeds 1: atol is meant for unit-scale data, and large-magnitude inputs make
rounding errors near zero (cancellation) grow with the data, not with the element. A tensor passes when
  - shape and dtype match;
  - no element is NaN/inf where the reference is finite (NaN never passes);
  - at least `min_close_fraction` of the elements are within one unit;
  - the largest error is at most `max_units` units and the mean at most MEAN_UNITS units;
  - the relative norm error ||got - ref|| / ||ref|| is at most `max_rel_l2`;
  - the error's systematic part is at most SYSTEMATIC_SHARE of `max_rel_l2`, or its signs within SYSTEMATIC_SIGMAS
    of a fair coin's.
The systematic part is the least-squares fit of the signed error on the reference and a constant, a * ref + b, as a
share of ||ref||: a scale or an offset folded slightly off (a constant rounded, a decay one percent high) moves every
element the same way and compounds over a network's layers, while a per-element tolerance and a norm bound admit
it up to their full width. Rounding and summation order leave errors that barely correlate with the values. The
fit is a projection, so it never exceeds the relative norm error itself: a result whose whole error is within
SYSTEMATIC_SHARE of the norm bound can never fail it (every kernel's committed bundle is: the closest, KDA's outputs
over a trajectory, 1.85e-4 against 2.5e-4). The sign test (systematic_fit) keeps an output with rounding noise
near the norm bound from failing by chance.
The largest error is also given in units in the last place of the output's dtype (`max_ulps`, not judged): a bf16
result one rounding away from the float64 reference reads 0.5, a summation order's drift a few.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from kernels.contract import Tolerance
from kernels.trees import digest  # noqa: F401 - the checks' bitwise identity, shared with the production replay

MEAN_UNITS = 0.25
SYSTEMATIC_SHARE = 1 / 8
SYSTEMATIC_SIGMAS = 5.0
SHOW_MISMATCHES = 5
# Tensors this large are compared on the judge's GPU when it has one: on a CPU, comparing a 96-head, batch-64 KDA
# state (104 M elements, about ten float64 passes of 830 MB) took 29 s with 2 cores, and numerics makes dozens.
GPU_ELEMENTS = 1 << 22


class TensorCheck(BaseModel):
    """How one tensor (an output, or a state updated in place) compares with the reference."""

    model_config = ConfigDict(extra="forbid")

    name: str
    passed: bool
    problems: list[str] = Field(default_factory=list)
    numel: int = 0
    close_fraction: float = 0.0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    max_units: float = 0.0
    mean_units: float = 0.0
    max_ulps: float | None = Field(default=None, description="the largest error in units in the last place of the "
                                   "output's dtype at the reference's value (floating outputs)")
    rel_l2: float = 0.0
    systematic: float = Field(default=0.0, description="the least-squares fit of the error on a * reference + b, "
                              "as a share of the reference's norm: error that tracks the values, not rounding")
    systematic_sigmas: float = Field(default=0.0, description="how lopsided the error's signs are against the "
                                     "reference's and zero (a sign test, in standard deviations)")
    atol_scale: float = Field(default=1.0, description="atol was multiplied by this: max(1, RMS of the reference)")
    nonfinite: int = Field(default=0, description="elements NaN/inf where the reference is finite")
    mismatches: list[str] = Field(default_factory=list, description="the elements with the largest errors")


def _mismatched_kind(name: str, got: torch.Tensor, ref: torch.Tensor) -> TensorCheck | None:
    """The failed check of a tensor of another shape or dtype than the reference's, or None: every check's first."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return TensorCheck(name=name, passed=False, problems=[
            f"{name}: got {got.dtype} {tuple(got.shape)}, expected {ref.dtype} {tuple(ref.shape)}"])
    return None


def _mismatches(name: str, g: torch.Tensor, r: torch.Tensor, flat: torch.Tensor) -> list[str]:
    """`name[i, j] = got, expected ref` for the elements at flat indices `flat` of g and r (one shape)."""
    return [f"{name}[{', '.join(str(int(i)) for i in idx)}] = {g[idx].item():.6g}, expected {r[idx].item():.6g}"
            for idx in zip(*torch.unravel_index(flat, g.shape))]


def ulps(diff: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`diff` in units in the last place of `dtype` at the values `ref` (float64 in and out): the spacing of
    dtype's numbers around |ref|, and below its smallest normal number the subnormals' spacing."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(ref.abs().clamp_min(info.tiny))  # |ref| = m 2^exponent, m in [0.5, 1)
    return diff / torch.ldexp(torch.full_like(ref, info.eps), exponent - 1)


def systematic_fit(error: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The least-squares fit a * ref + b of `error` (float64, finite elements of one shape) as a share of ||ref||: the
    part of the error a scale and an offset explain, at most ||error|| / ||ref||. And how lopsided the error's signs
    are, in standard deviations of a sign test: against the centred reference's (a scale) and against zero (an
    offset), each over the elements with an error. Signs, not magnitudes: rounding grows with the values and heavy
    tails put the weight on a few elements, which a test on magnitudes reads as a bias, while a scale or offset
    folded off moves nearly every element the same way, whatever its size."""
    ref, error = ref.reshape(-1), error.reshape(-1)
    ref_sq = float(ref.square().sum())
    if ref_sq == 0.0:
        return 0.0, 0.0  # a zero reference: the norm error is absolute there, and judged as such
    # Fit on the orthogonal pair (1, ref - mean(ref)): well conditioned however much the mean dominates.
    n, mean = ref.numel(), float(ref.mean())
    centred = ref - mean
    centred_sq, offset_sum = float(centred.square().sum()), float(error.sum())
    fitted_sq = offset_sum * offset_sum / n
    if centred_sq > 1e-24 * ref_sq:  # else a constant reference: ref and 1 span one direction
        fitted_sq += float((error * centred).sum()) ** 2 / centred_sq
    sign = error.sign()
    with_error = max(int(sign.count_nonzero()), 1)
    lopsided = max(abs(float(sign.sum())), abs(float((sign * centred.sign()).sum()))) / with_error ** 0.5
    return (fitted_sq / ref_sq) ** 0.5, lopsided


def check_tensor(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> TensorCheck:
    if (kind := _mismatched_kind(name, got, ref)) is not None:
        return kind
    device = "cuda" if got.numel() >= GPU_ELEMENTS and torch.cuda.is_available() else "cpu"
    g, r = got.detach().to(device).double(), ref.detach().to(device).double()
    if g.numel() == 0:
        return TensorCheck(name=name, passed=True, close_fraction=1.0)
    ref_finite = torch.isfinite(r)
    nonfinite = int((~torch.isfinite(g) & ref_finite).sum())
    zero = torch.zeros((), dtype=torch.float64, device=device)
    signed = (g - r).where(ref_finite, zero)
    diff = signed.abs()
    diff = diff.nan_to_num(nan=float("inf"))  # a NaN where the reference is finite is an infinite error
    r_finite = r.where(ref_finite, zero)
    ref_norm = float(r_finite.norm())
    scale = max(1.0, ref_norm / r.numel() ** 0.5)
    units = diff / (tol.atol * scale + tol.rtol * r_finite.abs())
    result = TensorCheck(
        name=name, passed=True, numel=g.numel(), close_fraction=float((units <= 1.0).double().mean()),
        max_abs=float(diff.max()), mean_abs=float(diff.mean()), max_units=float(units.max()),
        mean_units=float(units.mean()), rel_l2=float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm()),
        atol_scale=scale, nonfinite=nonfinite,
        max_ulps=float(ulps(diff, r_finite, got.dtype).max()) if got.dtype.is_floating_point else None)
    if not nonfinite:
        result.systematic, result.systematic_sigmas = systematic_fit(signed, r_finite)
    problems = []
    if nonfinite:
        problems.append(f"{name}: {nonfinite} NaN/inf elements where the reference is finite")
    if result.close_fraction < tol.min_close_fraction:
        problems.append(f"{name}: {result.close_fraction:.6%} of elements within tolerance "
                        f"(need {tol.min_close_fraction:.6%})")
    if result.max_units > tol.max_units:
        problems.append(f"{name}: max error {result.max_abs:.3g} = {result.max_units:.3g} tolerance units "
                        f"(limit {tol.max_units:g})")
    if result.mean_units > MEAN_UNITS:
        problems.append(f"{name}: mean error {result.mean_abs:.3g} = {result.mean_units:.3g} tolerance units "
                        f"(limit {MEAN_UNITS:g})")
    if result.rel_l2 > tol.max_rel_l2:
        problems.append(f"{name}: relative norm error {result.rel_l2:.3g} > {tol.max_rel_l2:g}")
    if result.systematic > SYSTEMATIC_SHARE * tol.max_rel_l2 and result.systematic_sigmas > SYSTEMATIC_SIGMAS:
        problems.append(f"{name}: systematic error {result.systematic:.3g} of the reference's norm (a scale or offset "
                        f"off: the error's signs {result.systematic_sigmas:.3g} sigmas lopsided) > "
                        f"{SYSTEMATIC_SHARE * tol.max_rel_l2:g}, {SYSTEMATIC_SHARE:g} of max_rel_l2")
    if problems:
        worst = units.reshape(-1).topk(min(SHOW_MISMATCHES, units.numel())).indices
        result.mismatches = _mismatches(name, g, r, worst)
    result.passed = not problems
    result.problems = problems
    return result


def check_exact(name: str, got: torch.Tensor, ref: torch.Tensor) -> TensorCheck:
    """Equal element for element (NaN where the reference has NaN): for an output with one right answer, such as
    a bf16 add that the model keeps as its residual stream, where any tolerance would admit a wrong stream."""
    if (kind := _mismatched_kind(name, got, ref)) is not None:
        return kind
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    if g.numel() == 0:
        return TensorCheck(name=name, passed=True, close_fraction=1.0)
    differ = (g != r) & ~(g.isnan() & r.isnan())
    wrong = int(differ.sum())
    diff = (g - r).abs().where(differ, torch.zeros((), dtype=torch.float64)).nan_to_num(nan=float("inf"))
    ref_norm = float(r.nan_to_num().norm())
    result = TensorCheck(name=name, passed=not wrong, numel=g.numel(), close_fraction=1 - wrong / g.numel(),
                         max_abs=float(diff.max()), mean_abs=float(diff.mean()),
                         rel_l2=float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm()))
    if wrong:
        result.problems = [f"{name}: {wrong} of {g.numel()} elements differ from the reference, which is exact here"]
        where = differ.reshape(-1).nonzero().reshape(-1)[:SHOW_MISMATCHES]
        result.mismatches = _mismatches(name, g, r, where)
    return result
