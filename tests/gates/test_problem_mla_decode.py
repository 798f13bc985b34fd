"""The MLA decode problem: a paged cache laid out to catch a kernel that reads the wrong rows, its float64 reference,
its cost, and the contract's page sizes in the gate's envelope."""

import pytest
import torch

from gates.problems import DISTRIBUTIONS, Point, envelope_points, load_problem
from gates.problems.mla_decode import CONTEXTS, POISON, SPARE_PAGES
from kernels.contract import load_contract
from model.kimi_k3.ops.mla_decode import mla_decode, paged_rows

PROBLEM = load_problem("mla_decode")


def small(page_size: int, batch: int = 4) -> Point:
    return Point(batch, 0, (("heads", 2), ("kv_lora_rank", 32), ("rope_dim", 32), ("page_size", page_size)), "bf16")


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_each_sequence_owns_its_pages_out_of_order_and_every_other_row_is_poison(dist, page_size):
    seed = 4
    _, _, kv, table, lengths, *_ = PROBLEM.generate_input(small(page_size), seed, dist).args
    context = CONTEXTS[0] if dist == "normal" else CONTEXTS[seed % len(CONTEXTS)]
    assert table.dtype == torch.int32 and table.shape == (4, -(-context // page_size))
    used = ((lengths + page_size - 1) // page_size).tolist()
    owned = [table[i, :n].tolist() for i, n in enumerate(used)]
    flat = [page for pages in owned for page in pages]
    assert len(set(flat)) == len(flat) == kv.shape[0] - SPARE_PAGES
    assert all(pages != list(range(pages[0], pages[0] + len(pages))) for pages in owned if len(pages) > 1)
    valid = torch.zeros(kv.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        t = torch.arange(n)
        valid[table[i, t // page_size].long(), t % page_size] = True
        beyond = table[i, used[i]:].tolist()
        assert all(e == kv.shape[0] or e not in flat for e in beyond)  # a spare page, or one past the pool
        assert torch.isfinite(paged_rows(kv, table[i], t).float()).all()
    assert (kv[~valid] == POISON).all() and not (kv[valid] == POISON).all(-1).any()


@pytest.mark.parametrize("page_size", [16, 64])
def test_the_reference_is_the_op_in_float64(page_size):
    args = PROBLEM.generate_input(small(page_size), 5, "normal").args
    want = PROBLEM.reference(*args)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(mla_decode(*args), want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


def test_the_cost_counts_the_valid_rows_and_their_table_entries():
    point = small(16)
    q_nope, q_pe, kv, table, lengths, w_uk, w_uv, scale = PROBLEM.generate_input(point, 0, "normal").args
    at_64 = PROBLEM.cost(small(64))
    entries = int(((lengths + 15) // 16).sum()) - int(((lengths + 63) // 64).sum())  # table entries read
    assert PROBLEM.cost(point).bytes - at_64.bytes == 4 * entries and PROBLEM.cost(point).flops == at_64.flops


@pytest.mark.parametrize("op", ["mla_decode", "mla_decode_fp8"])
def test_the_gate_checks_every_contracted_page_size(op):
    contract = load_contract(f"contracts/{op}.yaml")
    problem = load_problem(op)
    assert {16, 64} <= set(contract.shapes["page_size"])
    points = envelope_points(contract, problem, seed=1)
    assert {p["page_size"] for p in points} == set(contract.shapes["page_size"])
