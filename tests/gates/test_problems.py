"""Problems: envelope points from a contract, seeded inputs from several distributions, costs from shapes."""

import pytest
import torch

from gates.problems import (
    DISTRIBUTIONS,
    Point,
    ProblemError,
    UnsupportedPoint,
    bench_point,
    coverage,
    envelope_points,
    load_problem,
    sample,
    stratified,
)
from kernels.roofline import floor
from tests.gates.fixtures.helpers import kda_contract

KDA = load_problem("kda_decode")
SMALL = Point(5, 0, (("heads", 2), ("head_dim", 16)), "bf16")


@pytest.mark.parametrize("lo, hi, n", [(1, 64, 10), (2, 7, 2), (1, 1, 3), (2, 3, 5), (5, 4, 2)])
def test_stratified_draws_reach_every_part_of_a_range(lo, hi, n):
    import random

    draws = stratified(lo, hi, n, random.Random(0))
    assert len(draws) == (n if lo <= hi else 0) and all(lo <= d <= hi for d in draws)
    if hi - lo + 1 >= n:  # one draw in each n-th of the range
        edges = [lo + round(i * (hi - lo + 1) / n) for i in range(n + 1)]
        assert all(a <= d < b for d, a, b in zip(sorted(draws), edges, edges[1:]))


def test_envelope_points_cover_every_shape_value_and_draw_batches_inside_the_range():
    contract = kda_contract(shapes={"heads": [96, 6, 12, 24, 48], "head_dim": [128]}, batch={"min": 1, "max": 64})
    points = envelope_points(contract, KDA, seed=5)
    assert {p["heads"] for p in points} == {6, 12, 24, 48, 96}
    assert {p.batch for p in points if p["heads"] in (6, 96)} >= {1, 64}  # the corners keep both batch edges
    inside = {p.batch for p in points} - {1, 64}
    assert len(inside) >= 8 and min(inside) < 16 and max(inside) > 48
    assert points != envelope_points(contract, KDA, seed=6)  # the secret seed picks them
    covered = coverage(contract, KDA, points)
    assert covered["shapes"]["heads"] == {"admitted": [6, 12, 24, 48, 96], "exercised": [6, 12, 24, 48, 96]}
    assert covered["batch"]["admitted"] == [1, 64] and covered["batch"]["exercised"][0] == 1
    assert bench_point(contract, KDA, contract.benchmark.points[1]) == Point(8, 0, (("heads", 96), ("head_dim", 128)),
                                                                             "bf16")


def test_missing_shape_key_names_the_problem_file():
    with pytest.raises(ProblemError, match=r"lacks head_dim .*gates/problems/kda_decode.py"):
        envelope_points(kda_contract(shapes={"heads": [2]}), KDA, seed=0)


def test_missing_problem_says_which_file_to_write():
    with pytest.raises(ProblemError, match=r"no problem for op 'rope_fused': write gates/problems/rope_fused.py"):
        load_problem("rope_fused")


def test_inputs_are_seeded_and_distinct():
    a, b = KDA.generate_input(SMALL, 1, "normal"), KDA.generate_input(SMALL, 1, "normal")
    c = KDA.generate_input(SMALL, 2, "normal")
    assert torch.equal(a.args[0], b.args[0]) and not torch.equal(a.args[0], c.args[0])
    assert a.state == (1, 2)
    assert a.args[2].shape[0] > SMALL.batch  # spare cache slots: a write to the wrong slot shows


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_reference_is_finite_on_every_distribution(dist):
    case = KDA.generate_input(Point(8, 0, (("heads", 2), ("head_dim", 16)), "bf16"), 3, dist)
    assert torch.isfinite(KDA.reference(*case.args).float()).all()


def test_distributions_differ():
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    normal, heavy, large = (sample((100_000,), d, gen(), torch.float32) for d in ("normal", "heavy_tailed", "large"))
    assert heavy.abs().max() > 10 * normal.abs().max()
    assert large.std() == pytest.approx(64, rel=0.05)
    mixed = sample((8, 1000), "mixed", gen(), torch.float32)
    assert mixed[2].std() > 10 * mixed[0].std()  # rows cycle normal, heavy-tailed, large, zero
    assert [bool(row.any()) for row in mixed] == [True, True, True, False] * 2


def test_heavy_tailed_is_student_t_with_two_degrees_of_freedom():
    """Its quantiles are t2's, F^-1(p) = (2p - 1) / sqrt(2p(1 - p)), and it is symmetric and bounded (the reach the
    contracts' tolerances were set on)."""
    from gates.problems import HEAVY_TAIL_MAX

    x = sample((400_000,), "heavy_tailed", torch.Generator().manual_seed(1), torch.float32).double()
    assert float(x.abs().max()) <= HEAVY_TAIL_MAX and abs(float(x.median())) < 0.01
    for p in (0.6, 0.75, 0.9, 0.99, 0.999):
        want = (2 * p - 1) / (2 * p * (1 - p)) ** 0.5
        assert float(torch.quantile(x[:100_000], p)) == pytest.approx(want, rel=0.05 if p < 0.99 else 0.15)


def test_decode_problem_refuses_speculative_points():
    with pytest.raises(UnsupportedPoint, match="spec_tokens 3"):
        KDA.generate_input(Point(1, 3, SMALL.shape, "bf16"), 0, "normal")


def test_next_step_keeps_weights_and_state():
    case = KDA.generate_input(SMALL, 1, "normal")
    step = KDA.next_input(case, 2, "normal")
    assert step.args[1] is case.args[1] and step.args[4] is case.args[4]
    assert not torch.equal(step.args[0], case.args[0])


def test_cost_grows_with_batch_and_is_dominated_by_the_state():
    point = lambda b: Point(b, 0, (("heads", 12), ("head_dim", 128)), "bf16")  # noqa: E731
    c1, c2, c64 = (KDA.cost(point(b)) for b in (1, 2, 64))
    state_per_seq = 2 * 12 * 128 * 128 * 4  # fp32 state read and written
    assert c2.bytes - c1.bytes > state_per_seq
    assert state_per_seq * 64 / c64.bytes > 0.9
    assert floor(c64.bytes, c64.flops, "sm_90").bound == "memory"


def test_linear_problem_draws_strided_and_contiguous_activations():
    from gates.problems import Point, load_problem

    problem = load_problem("linear")
    point = Point(3, 1, (("out_features", 48), ("in_features", 64)), "bf16")
    x, w = problem.generate_input(point, 1, "heavy_tailed").args
    assert x.shape == (6, 64) and x.stride(0) > 64 and w.shape == (48, 64)
    x, _ = problem.generate_input(point, 2, "normal").args
    assert x.is_contiguous()
    assert problem.cost(point).bytes == 48 * 64 * 2 + 6 * 64 * 2 + 6 * 48 * 2
