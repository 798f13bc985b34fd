"""The TP-split router (model/kimi_k3/ops/moe_route_tp.py) over real gloo groups at TP2 and TP4 against the
single-rank reference: identical ids (near ties included) and weights, on every rank."""

from __future__ import annotations

import pytest
import torch

from model.kimi_k3.distributed import run_tp
from model.kimi_k3.ops.moe_route import moe_route
from model.kimi_k3.ops.moe_route_tp import local_rows, moe_route_tp, top_k_lowest_id
from model.kimi_k3.parallel import TP

EXPERTS, HIDDEN, TOP_K, TOKENS = 896, 256, 16, 12
TIMEOUT_S = 120  # a broken collective fails the test instead of hanging it
NEAR_TIE_STEPS = (-2, -1, 1, 2)  # where a token's (k+1)-th key lands next to its k-th, in units of 2^-24


def router_inputs(seed: int, near_ties: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] bf16, gate_w [E, H] bf16, bias [E] fp32; with near_ties, token t's (k+1)-th key is moved a step of
    NEAR_TIE_STEPS from its k-th, never onto it (each on its own pair of experts, so the ties do not disturb each
    other)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    w = (torch.randn(EXPERTS, HIDDEN, generator=gen) * HIDDEN**-0.5).bfloat16()
    bias = torch.randn(EXPERTS, generator=gen) * 0.02
    if near_ties:
        touched: set[int] = set()
        for t in range(TOKENS):
            keys = (torch.sigmoid(x.float() @ w.float().t()) + bias)[t]  # as the reference sums: the whole batch
            order = keys.argsort(descending=True)
            kth, nxt = int(order[TOP_K - 1]), int(order[TOP_K])
            if {kth, nxt} & touched:
                continue
            bias[nxt] += float(keys[kth] - keys[nxt]) + NEAR_TIE_STEPS[t % 4] * 2.0**-24
            keys = (torch.sigmoid(x.float() @ w.float().t()) + bias)[t]
            while keys[nxt] == keys[kth]:  # an exact tie is the tie-break rule's, which torch.topk leaves open
                bias[nxt] += NEAR_TIE_STEPS[t % 4] * 2.0**-24
                keys = (torch.sigmoid(x.float() @ w.float().t()) + bias)[t]
            touched |= {kth, nxt}
    return x, w, bias


def _rank(tp: TP, device, x, w, bias, top_k):
    rows = local_rows(w.shape[0], tp)
    got = moe_route_tp(x, w[rows], bias[rows], top_k, True, 2.5, tp)
    everyone = [torch.empty_like(got[0]) for _ in range(tp.size)]
    torch.distributed.all_gather(everyone, got[0], group=tp.group)
    return got, all(torch.equal(e, got[0]) for e in everyone)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("near_ties", [False, True])
def test_tp_split_matches_single_rank(size, near_ties):
    x, w, bias = router_inputs(size, near_ties)
    (ids, weights), same_on_every_rank = run_tp(_rank, size, x, w, bias, TOP_K, timeout=TIMEOUT_S)
    ref_ids, ref_weights = moe_route(x, w, bias, TOP_K, True, 2.5)
    assert same_on_every_rank
    assert torch.equal(ids, ref_ids), (ids != ref_ids).nonzero().tolist()
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


def test_near_ties_are_planted():
    x, w, bias = router_inputs(0, near_ties=True)
    keys = torch.sigmoid(x.float() @ w.float().t()) + bias
    top = keys.topk(TOP_K + 1).values
    gaps = (top[:, TOP_K - 1] - top[:, TOP_K]).abs()
    assert int(((gaps > 0) & (gaps <= 4 * 2.0**-24)).sum()) >= TOKENS // 2


@pytest.mark.parametrize("size", [2, 4])
def test_exact_ties_go_to_the_lower_id_across_ranks(size):
    """Expert e's twin on the last rank has e's row and bias: equal keys everywhere; both levels keep the lower id,
    so the split form equals the single-rank selection with that explicit rule."""
    x, w, bias = router_inputs(size + 10, near_ties=False)
    keys = torch.sigmoid(x.float() @ w.float().t()) + bias
    order = keys[0].argsort(descending=True)
    # The first twin joins the top k and pushes order[k - 1] out: the k-th is then order[k - 2], which the second
    # twin ties.
    for src, dst in ((int(order[3]), EXPERTS - 2), (int(order[TOP_K - 2]), EXPERTS - 1)):
        w[dst], bias[dst] = w[src], bias[src]
    (ids, _), _ = run_tp(_rank, size, x, w, bias, TOP_K, timeout=TIMEOUT_S)
    keys = torch.sigmoid(x.float() @ w.float().t()) + bias
    expected = top_k_lowest_id(keys, torch.arange(EXPERTS).expand_as(keys), TOP_K)
    assert torch.equal(ids, expected)
    assert int(order[TOP_K - 2]) in ids[0].tolist() and EXPERTS - 1 not in ids[0].tolist()


def test_top_k_lowest_id_orders_equal_keys_by_id():
    keys = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1]])
    ids = torch.tensor([[7, 3, 2, 9, 0]])
    assert top_k_lowest_id(keys, ids, 4).tolist() == [[1, 3, 2, 0]]


def test_refusals():
    tp = TP()
    x, w, bias = router_inputs(0, near_ties=False)
    with pytest.raises(ValueError, match="do not split"):
        local_rows(EXPERTS, TP(0, 3))
    with pytest.raises(ValueError, match="does not match"):
        moe_route_tp(x, w, bias[:-1], TOP_K, True, 1.0, tp)
    with pytest.raises(ValueError, match="at least top_k"):
        moe_route_tp(x, w[:8], bias[:8], TOP_K, True, 1.0, tp)


def test_the_reference_gives_equal_keys_to_the_lower_id():
    """Five experts tied at the top: the reference keeps them in id order, as the kernel and the TP form do."""
    gate_w = torch.zeros(32, 8)
    gate_w[[3, 9, 17, 21, 30], 0] = 1.0
    ids, _ = moe_route(torch.ones(1, 8), gate_w, torch.zeros(32), 4, True, 1.0)
    assert ids.tolist() == [[3, 9, 17, 21]]
