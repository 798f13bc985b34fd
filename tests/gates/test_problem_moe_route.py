"""The moe_route problem (gates/problems/moe_route.py): its planted ties, and a checker that passes the reference,
fails a wrong id, passes a tie swap only within the tie tolerance, and checks each weight with its expert."""

from __future__ import annotations

import pytest
import torch

from gates.problems import Point, load_problem
from gates.problems import moe_route as prob
from kernels.contract import Tolerance

TOL = Tolerance(atol=1e-4, rtol=1e-3, max_rel_l2=1e-4, min_close_fraction=0.99999)
PROBLEM = load_problem("moe_route")


def point(batch: int) -> Point:
    return Point(batch, 0, (("experts", 896), ("top_k", 16), ("hidden", 7168)), "bf16")


@pytest.fixture(scope="module")
def case():
    args = PROBLEM.generate_input(point(6), 11, "normal").args
    ids, weights = PROBLEM.reference(*args)
    return args, ids, weights


def judge(ids, weights, ref_ids, ref_weights):
    return PROBLEM.check("out[0]", ids, ref_ids, TOL), PROBLEM.check("out[1]", weights, ref_weights, TOL)


def swapped(case, token: int, a: int, b: int):
    """The reference's result with the experts at positions a and b of a token exchanged (weights with them)."""
    _, ids, weights = case
    ids, weights = ids.clone(), weights.clone()
    ids[token, [a, b]], weights[token, [a, b]] = ids[token, [b, a]], weights[token, [b, a]]
    return ids, weights


def test_the_reference_passes_itself(case):
    _, ids, weights = case
    c_ids, c_w = judge(ids, weights, ids, weights)
    assert c_ids.passed and c_w.passed and c_ids.close_fraction == 1.0


def test_ties_are_planted(case):
    args, _, _ = case
    keys, _, eps = prob.exact(*args[:3])
    top = keys.sort(dim=-1, descending=True).values
    assert bool((top[0, :16].diff() == 0).any())  # an exact tie inside token 0's top 16
    assert float(top[0, 15] - top[0, 16]) == 0  # and one at its boundary
    near = (top[1:5, 15] - top[1:5, 16]).abs() <= 2 * eps[1:5].max(dim=-1).values
    assert int(near.sum()) >= 3


def test_a_wrong_id_fails(case):
    args, ids, weights = case
    keys = prob.exact(*args[:3])[0]
    bad = ids.clone()
    bad[2, 15] = int(keys[2].argsort(descending=True)[40])  # the 41st: far below the 16th
    c_ids, c_w = judge(bad, weights, ids, weights)
    assert not c_ids.passed and "tie" in c_ids.problems[0] and c_ids.mismatches


def test_an_exact_tie_swap_passes_and_is_reported(case):
    args, ids, weights = case
    keys = prob.exact(*args[:3])[0]
    order = ids[0].tolist()
    tied = [(i, j) for i in range(16) for j in range(i + 1, 16) if keys[0, order[i]] == keys[0, order[j]]]
    got_ids, got_w = swapped(case, 0, *tied[0])
    c_ids, c_w = judge(got_ids, got_w, ids, weights)
    assert c_ids.passed and c_w.passed
    assert c_ids.close_fraction < 1 and len(c_ids.mismatches) == 2


def test_a_near_tie_swap_passes_only_within_the_tie_tolerance(case):
    args, ids, weights = case
    keys, _, eps = prob.exact(*args[:3])
    for t in range(1, 5):
        ranked = keys[t].argsort(descending=True)
        kth, nxt = int(ranked[15]), int(ranked[16])
        if kth not in ids[t].tolist():  # the reference's fp32 keys ordered this near tie the other way
            kth, nxt = nxt, kth
        got_ids, got_w = ids.clone(), weights.clone()
        got_ids[t, ids[t].tolist().index(kth)] = nxt
        got_w[t] = torch.from_numpy(prob.expected_weights(prob._records[prob.digest(ids)], got_ids)[t].numpy())
        within = abs(float(keys[t, kth] - keys[t, nxt])) <= float(eps[t, kth] + eps[t, nxt])
        assert judge(got_ids, got_w, ids, weights)[0].passed == within
        # the 18th instead, which no tie tolerance covers
        got_ids[t, ids[t].tolist().index(kth)] = int(ranked[17])
        assert not judge(got_ids, got_w, ids, weights)[0].passed


def test_weights_must_move_with_their_expert(case):
    args, ids, weights = case
    keys = prob.exact(*args[:3])[0]
    order = ids[0].tolist()
    i, j = next((i, j) for i in range(16) for j in range(i + 1, 16) if keys[0, order[i]] == keys[0, order[j]])
    got_ids, _ = swapped(case, 0, i, j)
    # tied twins have the same score, so use a pair with different scores: swap two distinct experts' weights only
    c_ids, c_w = judge(ids, weights[:, [1, 0] + list(range(2, 16))], ids, weights)
    assert c_ids.passed and not c_w.passed
    c_ids, c_w = judge(got_ids, weights, ids, weights)  # twins: same score, weights unchanged is right
    assert c_ids.passed and c_w.passed


def test_scaling_and_repeats_are_caught(case):
    _, ids, weights = case
    assert not judge(ids, weights * 1.01, ids, weights)[1].passed
    twice = ids.clone()
    twice[3, 1] = twice[3, 0]
    assert "twice" in judge(twice, weights, ids, weights)[0].problems[0]


def test_an_unknown_expected_result_is_an_error():
    result = PROBLEM.check("out[0]", torch.zeros(1, 16, dtype=torch.int64), torch.ones(1, 16, dtype=torch.int64), TOL)
    assert not result.passed and "no record" in result.problems[0]


def test_scalings_alternate_and_cost_counts_the_weight_once():
    assert {PROBLEM.generate_input(point(1), s, "normal").args[5] for s in (0, 1)} == set(prob.SCALINGS)
    assert PROBLEM.cost(point(1)).bytes == 896 * 7168 * 2 + 7168 * 2 + 896 * 4 + 16 * 12
