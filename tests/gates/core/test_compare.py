"""Graded comparison: fraction within tolerance, max and mean error in tolerance units, relative norm, its
systematic part, NaN."""

import pytest
import torch

from gates.core.compare import SYSTEMATIC_SHARE, SYSTEMATIC_SIGMAS, check_exact, check_tensor, digest, systematic_fit
from kernels.contract import Tolerance

TOL = Tolerance(atol=1e-3, rtol=0.0, max_rel_l2=1e-2, min_close_fraction=0.999)


def _ref(n=10_000):
    return torch.linspace(-1, 1, n)  # RMS below 1: atol applies unscaled


@pytest.mark.parametrize("name, perturb, passed, problem", [
    ("identical", lambda x: x, True, None),
    ("one element 2 units off", lambda x: x.index_add(0, torch.tensor([7]), torch.tensor([2e-3])), True, None),
    ("one element 4 units off", lambda x: x.index_add(0, torch.tensor([7]), torch.tensor([4e-3])), False, "max error"),
    ("all within, but half a unit on average", lambda x: x + 5e-4, False, "mean error"),
    ("one in a hundred off", lambda x: torch.where(torch.arange(x.numel()) % 100 == 0, x + 2e-3, x), False,
     "within tolerance"),
    ("a NaN", lambda x: x.index_fill(0, torch.tensor([3]), float("nan")), False, "NaN/inf"),
])
def test_graded(name, perturb, passed, problem):
    ref = _ref()
    check = check_tensor("out", perturb(ref.clone()), ref, TOL)
    assert check.passed is passed, check.problems
    if problem:
        assert any(problem in p for p in check.problems), check.problems
        assert check.mismatches and check.mismatches[0].startswith("out[")


def test_nan_is_counted_and_located():
    ref = _ref(16)
    got = ref.clone()
    got[5] = float("nan")
    check = check_tensor("out", got, ref, TOL)
    assert check.nonfinite == 1 and check.mismatches[0].startswith("out[5] = nan")


def test_atol_scales_with_large_data():
    """Cancellation near zero in data of magnitude 64 leaves errors of 64x the unit-scale rounding."""
    ref = _ref() * 64
    got = ref + 2e-3 * torch.sign(torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)))
    check = check_tensor("out", got, ref, TOL)
    assert check.passed and check.atol_scale == pytest.approx(64 / 3**0.5, rel=1e-3)
    assert not check_tensor("out", _ref() + 2e-3, _ref(), TOL).passed  # the same error at unit scale


def test_relative_norm_bound():
    ref = _ref()
    check = check_tensor("out", ref * 1.02, ref, Tolerance(atol=1.0, rtol=0.0, max_rel_l2=1e-2))
    assert not check.passed and check.rel_l2 == pytest.approx(0.02, rel=1e-6)


# The fixture contract's tolerance (and linear's and the MoE's rtol): a 0.3 % scale is a fifth of a unit there.
TOL_RTOL = Tolerance(atol=1e-3, rtol=1.6e-2, max_rel_l2=1e-2, min_close_fraction=0.999)


@pytest.mark.parametrize("name, perturb", [
    ("every element 0.3 % high", lambda x: x * 1.003),
    ("every element 0.8 atol high", lambda x: x + 8e-4),
    ("a scale and an offset together", lambda x: x * 0.999 - 5e-4),
])
def test_a_systematic_error_inside_every_other_bound_fails(name, perturb):
    ref = _ref()
    check = check_tensor("out", perturb(ref.clone()).float(), ref, TOL_RTOL)
    assert [p for p in check.problems if "systematic error" not in p] == []
    assert not check.passed and check.systematic > SYSTEMATIC_SHARE * TOL_RTOL.max_rel_l2


@pytest.mark.parametrize("seed", range(4))
def test_rounding_sized_noise_near_the_norm_bound_is_not_systematic(seed):
    """Independent relative noise at 90 % of max_rel_l2 (ten times a bf16 rounding): its fit on the reference and a
    constant is about rel_l2 / sqrt(n), far under the bound, though the norm error is close to its own."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(4096, generator=gen, dtype=torch.float64)
    noise = torch.randn(4096, generator=gen, dtype=torch.float64)
    got = ref + ref.abs() * noise * (0.9e-2 / float((ref * noise).norm() / ref.norm()))
    check = check_tensor("out", got, ref, Tolerance(atol=1e-3, rtol=0.1, max_rel_l2=1e-2))
    assert check.passed, check.problems
    assert check.rel_l2 == pytest.approx(0.9e-2) and check.systematic < 0.5 * SYSTEMATIC_SHARE * 1e-2
    assert check.systematic_sigmas < SYSTEMATIC_SIGMAS


@pytest.mark.parametrize("seed", range(16))
def test_a_few_elements_of_noise_past_the_share_are_not_called_systematic(seed):
    """32 elements (a batch-1 output at two heads) of heavy-tailed values with relative noise at the norm bound:
    the fit alone passes the share in most seeds (1733 of 2000), but the signs are not lopsided."""
    torch.manual_seed(seed)
    ref = torch.distributions.StudentT(2.0).sample((32,)).double()
    got = ref * (1 + 0.9e-2 * torch.randn(32, dtype=torch.float64))
    check = check_tensor("out", got, ref, Tolerance(atol=1e-3, rtol=0.1, max_rel_l2=1e-2))
    assert not any("systematic" in p for p in check.problems), check.problems


@pytest.mark.parametrize("seed", range(8))
def test_the_systematic_part_never_exceeds_the_norm_error(seed):
    """A projection: so a result whose whole error is inside SYSTEMATIC_SHARE of the norm bound cannot fail it."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(257, generator=gen, dtype=torch.float64) * 10 ** (seed - 4) + seed
    error = torch.randn(257, generator=gen, dtype=torch.float64) + (seed % 3) * ref - seed
    assert systematic_fit(error, ref)[0] <= float(error.norm() / ref.norm()) * (1 + 1e-12)
    assert systematic_fit(0.01 * ref - 0.02 * ref.mean(), ref)[0] == pytest.approx(float(
        (0.01 * ref - 0.02 * ref.mean()).norm() / ref.norm()), rel=1e-9)  # an error in the span is all systematic


@pytest.mark.parametrize("ref", [torch.zeros(8, dtype=torch.float64), torch.full((8,), 0.1, dtype=torch.float64)])
def test_systematic_error_of_a_zero_or_constant_reference(ref):
    assert systematic_fit(torch.full_like(ref, 1e-3), ref)[0] == (0.0 if not ref.any() else pytest.approx(1e-2))


@pytest.mark.parametrize("got", [torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16),
                                 torch.zeros(2, 2, dtype=torch.float64)])
def test_shape_and_dtype_first(got):
    check = check_tensor("out", got, torch.zeros(2, 2), TOL)
    assert not check.passed and "expected torch.float32 (2, 2)" in check.problems[0]


def test_digest_is_bitwise_identity():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert digest(a) == digest(a.clone())
    assert digest(a) != digest(torch.tensor([-0.0, float("nan"), 1.0]))  # equal as numbers, not as bits
    assert digest(a) != digest(a.double()) and digest(a) != digest(a.reshape(3, 1))
    assert digest(torch.ones(2, 3).t()) == digest(torch.ones(3, 2))  # layout is not content


def test_max_units_comes_from_the_tolerance():
    ref = _ref()
    got = ref.index_add(0, torch.tensor([7]), torch.tensor([5e-3]))  # one element 5 units off
    assert "(limit 3)" in check_tensor("out", got, ref, TOL).problems[0]
    assert check_tensor("out", got, ref, TOL.model_copy(update={"max_units": 10.0})).passed


@pytest.mark.gpu
def test_large_tensors_judged_on_the_gpu_as_on_the_cpu(monkeypatch):
    """Past GPU_ELEMENTS the comparison runs on the GPU: the same verdict, counts and worst elements as on the CPU."""
    import gates.core.compare as compare

    ref = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    got = ref + 1e-4 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    got[12345] += 0.5
    on_gpu = check_tensor("state", got, ref, TOL)
    monkeypatch.setattr(compare, "GPU_ELEMENTS", 1 << 40)
    on_cpu = check_tensor("state", got, ref, TOL)
    assert not on_gpu.passed and on_gpu.mismatches == on_cpu.mismatches and on_gpu.problems == on_cpu.problems
    assert on_gpu.close_fraction == on_cpu.close_fraction
    assert on_gpu.max_units == pytest.approx(on_cpu.max_units, rel=1e-12)
    assert on_gpu.rel_l2 == pytest.approx(on_cpu.rel_l2, rel=1e-9)


def test_exact_check_admits_no_rounding_step():
    """An exact output (a bf16 add the model carries on): equal passes, NaN where the reference has NaN passes, one
    element a few bf16 steps off (what a tolerance admits) fails naming how many and where, a shape or dtype change
    fails first."""
    ref = torch.linspace(-4, 4, 96).to(torch.bfloat16).reshape(8, 12)
    assert check_exact("out[1]", ref.clone(), ref).passed
    with_nan = ref.clone()
    with_nan[2, 3] = float("nan")
    assert check_exact("out[1]", with_nan.clone(), with_nan).passed
    assert not check_exact("out[1]", with_nan, ref).passed
    off = ref.clone()
    off[5, 7] += 2**-5  # 4 bf16 steps at its 1.66
    result = check_exact("out[1]", off, ref)
    assert not result.passed and result.problems == [
        "out[1]: 1 of 96 elements differ from the reference, which is exact here"]
    assert result.mismatches[0].startswith("out[1][5, 7] = ")
    assert check_tensor("out[1]", off, ref, Tolerance(atol=1e-2, rtol=1.6e-2, max_rel_l2=1e-2,
                                                      min_close_fraction=0.99)).passed  # what a tolerance admits
    assert "expected torch.bfloat16 (8, 12)" in check_exact("out[1]", ref.float(), ref).problems[0]


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16),
                                         (torch.float32, torch.int32)])
def test_the_largest_error_in_ulps_of_the_output_dtype(dtype, bits):
    """One element one step of the dtype away from the reference (its bit pattern plus one), in several binades:
    1 ULP wherever it is (at 3.0 a step is twice that at 1.0); integer outputs have none."""
    ref = torch.tensor([1.0, 3.0, -0.1, 6e4 if dtype is torch.float16 else 1e20], dtype=dtype)
    for i in range(ref.numel()):
        got = ref.clone()
        got[i:i + 1] = (ref[i:i + 1].view(bits) + 1).view(dtype)
        assert check_tensor("out", got, ref, TOL).max_ulps == pytest.approx(1.0)
    assert check_tensor("out", ref, ref, TOL).max_ulps == 0.0
    assert check_tensor("ids", torch.arange(4), torch.arange(4), TOL).max_ulps is None
