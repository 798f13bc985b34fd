"""mla_decode: the CuTe DSL kernel (model/kimi_k3/specialized/mla_decode).

CPU: argument checks, the split plan, the paged cache's addressing (row t of sequence b is kv_cache[block_table[b,
t // P], t % P]), compiling both paths for sm_90a without a GPU (registers, spills, PTX instruction counts, every
cache load addressed through a block-table load), and an emulation of each path's arithmetic (tiles, butterflies,
online softmax, split partials, merge; the mma path's hi + lo bf16 query and bf16 p) in its order, reading its rows
through the pages, against an fp64 reference: page sizes 16 to 128 and a slot per sequence, pages in a random order,
spare and poisoned pages. GPU (marked), both paths: against the reference over batches, lengths, head counts and page
sizes, CUDA-graph replay with changed lengths and block tables, determinism, the gate problem's points.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from gates.problems import DISTRIBUTIONS, ProblemError, bench_point, load_problem
from gates.problems.mla_decode import page_pool
from kernels.contract import load_contract
from kernels.cute import ptx_instruction_counts
from model.kimi_k3.ops import mla_dcp
from model.kimi_k3.ops.mla_decode import mla_decode, page_index, paged_rows, table_rows
from model.kimi_k3.ops.registry import import_entry_point, registry_problems
from model.kimi_k3.specialized import mla_decode as mk
from model.kimi_k3.specialized.mla_decode.kernel import (
    DSL,
    MERGE_COLS,
    MERGE_SEQS,
    MERGE_UNROLL,
    MMA_K,
    MMA_N,
    PATHS,
    SCORE_PARTS,
    TILE,
    VEC,
    MlaConfig,
    c_fragment_position,
    merge_vsplit,
    p_ldmatrix_row,
    q_fragment_position,
    score_ldmatrix_row,
    split_plan,
)

CONTRACT_FILE = Path(__file__).resolve().parents[2] / "contracts" / "mla_decode.yaml"
CONTRACT = load_contract(CONTRACT_FILE)
DEVICE = "cuda"
N, C, R, V = 128, 512, 64, 128
SCALE = 192 ** -0.5
needs_dsl = pytest.mark.skipif(DSL.error is not None, reason=f"CuTe DSL unavailable: {DSL.error}")


def make_inputs(b: int, h: int, max_len: int, lengths: list[int], page_size: int | None = None, seed: int = 0,
                device: str = "cpu"):
    """Random bf16 inputs over a cache of `page_size` rows a page (None: max_len, a slot per sequence and a block
    table [B, 1]) laid out as the gate problem's (`page_pool`: each sequence's pages in a random order, never
    shared, spare pages, table entries past its used blocks on a spare page or past the pool). Every row but the
    sequences' valid ones is NaN: the rest of each last page and the spare pages, so that reading one into the
    softmax would show."""
    g = torch.Generator().manual_seed(seed)
    page_size = page_size or max_len
    lengths = torch.tensor(lengths, dtype=torch.int64)
    pages, table = page_pool(lengths, max_len, page_size, g)
    kv = torch.full((pages, page_size, C + R), float("nan"), dtype=torch.bfloat16)
    for i, n in enumerate(lengths.tolist()):
        kv[page_index(table[i], torch.arange(n), page_size, pages)] = torch.randn(n, C + R, generator=g).to(
            torch.bfloat16)
    args = (torch.randn(b, h, N, generator=g).to(torch.bfloat16), torch.randn(b, h, R, generator=g).to(torch.bfloat16),
            kv, table, lengths, (torch.randn(h, N, C, generator=g) / N ** 0.5).to(torch.bfloat16),
            (torch.randn(h, V, C, generator=g) / C ** 0.5).to(torch.bfloat16), SCALE)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def reference64(q_nope, q_pe, kv, block_table, lengths, w_uk, w_uv, scale) -> torch.Tensor:
    """The op's math in fp64 (the masked softmax over each sequence's valid rows only, found through its pages)."""
    out = []
    for i in range(q_nope.shape[0]):
        ent = paged_rows(kv, block_table[i], torch.arange(int(lengths[i]), device=kv.device)).double()
        q_lat = torch.einsum("hn,hnc->hc", q_nope[i].double(), w_uk.double())
        query = torch.cat([q_lat, q_pe[i].double()], dim=-1)
        p = torch.softmax(query @ ent.T * scale, dim=-1)
        out.append(torch.einsum("hc,hvc->hv", p @ ent[:, :C], w_uv.double()))
    return torch.stack(out)


def butterfly_sum(x: torch.Tensor) -> torch.Tensor:
    """shuffle_sync_bfly sums over the last dim (32 lanes), offsets 16, 8, 4, 2, 1: every lane ends with the sum."""
    lanes = torch.arange(32)
    for off in (16, 8, 4, 2, 1):
        x = x + x[..., lanes ^ off]
    return x


def butterfly_max(x: torch.Tensor) -> torch.Tensor:
    lanes = torch.arange(32)
    for off in (16, 8, 4, 2, 1):
        x = torch.maximum(x, x[..., lanes ^ off])
    return x


def scores_fma(query: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
    """The fma path's unscaled scores [H, T], fp32: lane l's FMAs over its bf16 pairs l + 32 j (j ascending, element
    2p then 2p + 1), then the 5-step butterfly."""
    h, w = query.shape
    lanes = torch.arange(32)
    pairs = lanes[:, None] + 32 * torch.arange(w // 64)[None, :]  # [32, J]: lane l's pairs l + 32 j
    x0, x1 = tile[:, 2 * pairs], tile[:, 2 * pairs + 1]  # [T, 32, J]
    q0, q1 = query[:, 2 * pairs], query[:, 2 * pairs + 1]  # [H, 32, J]
    dots = torch.zeros(h, tile.shape[0], 32)
    for j in range(w // 64):
        dots = dots + q0[:, None, :, j] * x0[None, :, :, j]
        dots = dots + q1[:, None, :, j] * x1[None, :, :, j]
    return butterfly_sum(dots)[..., 0]


def operand_dtype(cfg: MlaConfig) -> torch.dtype:
    """The mma path's MMA operand type: f16 for an e4m3 cache (its tile converted exactly), else bf16."""
    return torch.float16 if cfg.cache == "e4m3" else torch.bfloat16


def query_scale(query: torch.Tensor, cfg: MlaConfig) -> float:
    """The kernel's `query_scale` for one CTA's query [H, W]: 1 (bf16); f16: 2^(13 - floor(log2 max|q|)), 1 for 0."""
    top = float(query.abs().max())
    if cfg.cache != "e4m3" or top == 0:
        return 1.0
    return 2.0 ** min(max(13 - math.floor(math.log2(top)), -126), 127)


def query_hi_lo(query: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The mma path's A operands: hi = q rounded to `dtype`, lo = q - hi rounded (both to nearest even), as fp32."""
    hi = query.to(dtype).float()
    return hi, (query - hi).to(dtype).float()


def scores_mma(query: torch.Tensor, tile: torch.Tensor, parts: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The mma path's unscaled scores [H, T]: per k range (a warp's part) the hi and the lo products accumulated in
    fp32 (the MMAs' order inside a part is the hardware's, fp32 matmuls here); the parts' sums in part order."""
    hi, lo = query_hi_lo(query, dtype)
    width = query.shape[1] // parts
    total = torch.zeros(query.shape[0], tile.shape[0])
    for part in range(parts):
        cols = slice(part * width, (part + 1) * width)
        total = total + (hi[:, cols] @ tile[:, cols].T + lo[:, cols] @ tile[:, cols].T)
    return total


def emulate_partial(query: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor, length: int, start: int, chunk: int,
                    scale: float, cfg: MlaConfig = MlaConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """One `partial` CTA of cfg.path in fp32, the kernel's order: (o [H, C], lse [H]). query [H, W] fp32; the
    sequence's rows are read through its block table `blocks` [max_blocks] (entries clamped into the pool)."""
    h, w = query.shape
    max_len = blocks.shape[0] * kv.shape[1]
    length = min(max(length, 0), max_len)
    stop = min(start + chunk, length)
    rows = max(stop - start, 0)
    m = torch.full((h,), -math.inf)
    total = torch.zeros(h)
    acc = torch.zeros(h, C)
    for it in range(-(-rows // TILE)):
        base = start + it * TILE
        idx = torch.clamp(base + torch.arange(TILE), max=stop - 1)  # clamped rows: finite, probability 0
        tile = paged_rows(kv, blocks, idx).float()  # [T, W]; e4m3 and bf16 are exact in fp32 (and e4m3 in f16)
        if cfg.path == "mma":
            qscale = query_scale(query, cfg)
            raw = scores_mma(query * qscale, tile, cfg.score_parts, operand_dtype(cfg))
            score_scale = torch.tensor(scale, dtype=torch.float32) / qscale
        else:
            raw, score_scale = scores_fma(query, tile), scale
        s = torch.where((base + torch.arange(TILE) < stop)[None, :], raw * score_scale, torch.tensor(-math.inf))
        m_new = torch.maximum(m, butterfly_max(s)[:, 0])
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        total = total * alpha + butterfly_sum(p)[:, 0]  # l sums the fp32 p on both paths
        m = m_new
        acc = acc * alpha[:, None]
        if cfg.path == "mma":  # P rounded to the operand type, fp32 accumulation (hardware order: matmul here)
            acc = acc + p.to(operand_dtype(cfg)).float() @ tile[:, :C]
        else:
            for t in range(TILE):
                acc = acc + p[:, t : t + 1] * tile[t, :C][None, :]
    inv = torch.where(total > 0, 1.0 / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(total))
    lse = torch.where(total > 0, m + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.tensor(-math.inf))
    return acc * inv[:, None], lse


def emulate_merge(parts: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """`merge` for one (b, h): parts [S, C], lses [S]; splits in ascending order."""
    top = lses.max()
    top = top if top > -math.inf else torch.tensor(0.0)
    out, total = torch.zeros(parts.shape[1]), torch.tensor(0.0)
    for s in range(lses.shape[0]):
        wgt = torch.exp(lses[s] - top)
        total = total + wgt
        out = out + wgt * parts[s]
    return out / (total if total > 0 else 1.0)


def emulate(q_nope, q_pe, kv, block_table, lengths, w_uk, w_uv, scale, num_sms=132, cfg=MlaConfig()):
    """The entry point with the kernel's launches emulated: out [B, H, V] fp32, and the partials' lses."""
    b, h = q_nope.shape[:2]
    splits, chunk = split_plan(b, block_table.shape[1] * kv.shape[1], num_sms, cfg)
    query = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope.float(), w_uk.float()), q_pe.float()], dim=-1)
    latent = torch.zeros(b, h, C)
    all_lse = torch.zeros(b, splits, h)
    for i in range(b):
        parts = [emulate_partial(query[i], kv, block_table[i], int(lengths[i]), s * chunk, chunk, scale, cfg)
                 for s in range(splits)]
        ps, ls = torch.stack([p for p, _ in parts]), torch.stack([lse for _, lse in parts])  # [S, H, C], [S, H]
        all_lse[i] = ls
        for hh in range(h):
            latent[i, hh] = emulate_merge(ps[:, hh], ls[:, hh])
        merged, _ = mla_dcp.merge(ps.unsqueeze(1), ls.unsqueeze(1))  # the module the kernel follows
        torch.testing.assert_close(latent[i], merged[0], rtol=1e-6, atol=1e-6 * max(1.0, float(ps.abs().max())))
    return torch.einsum("bhc,hvc->bhv", latent, w_uv.float()), all_lse


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = CONTRACT.tolerance
    assert torch.isfinite(got).all()
    err = (got.double() - want.double()).abs()
    assert (err <= tol.atol + tol.rtol * want.double().abs()).double().mean() >= tol.min_close_fraction
    assert err.norm() / want.double().norm() <= tol.max_rel_l2


# --- contract and arguments --------------------------------------------------------------------------------------


def test_contract_names_this_kernel():
    assert CONTRACT.implementation == "model.kimi_k3.specialized.mla_decode:mla_decode_cute"
    assert registry_problems(CONTRACT, str(CONTRACT_FILE), imports=False) == []


def _valid(**over):
    args = list(make_inputs(2, 12, 64, [1, 64], page_size=16))
    names = ["q_nope", "q_pe", "kv_cache", "block_table", "lengths", "w_uk", "w_uv", "scale"]
    for k, val in over.items():
        args[names.index(k)] = val
    return args


def test_check_args_accepts_valid_cpu_inputs_up_to_the_device_check():
    with pytest.raises(ValueError, match="CUDA tensors on one device"):
        mk.check_args(*_valid())
    with pytest.raises(ValueError, match="CUDA tensors on one device"):  # int64 tables too (converted on launch)
        mk.check_args(*_valid(block_table=_valid()[3].long()))


def model_views(args):
    """The call as the model makes it (model/kimi_k3/mla.py): q_nope and q_pe split from one [B, H, N + R]
    projection, W_UK and W_UV sliced from one kv_b_proj [H, N + V, C]; all four strided views."""
    q_nope, q_pe, kv, block_table, lengths, w_uk, w_uv, scale = args
    q = torch.cat([q_nope, q_pe], dim=-1)
    kv_b = torch.cat([w_uk, w_uv], dim=1)
    views = (*q.split([N, R], dim=-1), kv, block_table, lengths, kv_b[:, :N], kv_b[:, N:], scale)
    assert not any(v.is_contiguous() for i, v in enumerate(views) if i in (0, 1, 5, 6))
    return views


def test_check_args_accepts_the_models_strided_views():
    """The model's queries and weights are views; the kernel reads only the cache, slots and lengths by address
    (the first H200 layer bench found every specialized call falling back on `must be contiguous`)."""
    with pytest.raises(ValueError, match="CUDA tensors on one device"):
        mk.check_args(*model_views(_valid()))


@pytest.mark.parametrize("over, message", [
    (dict(q_nope=torch.zeros(2, 12, N)), "must be bf16"),
    (dict(kv_cache=torch.zeros(3, 64, C + R, dtype=torch.float16)), "must be torch.bfloat16"),
    (dict(block_table=torch.zeros(2, 4)), "block_table must be int32 or int64"),
    (dict(lengths=torch.tensor([1, 2], dtype=torch.int32)), "lengths must be int64"),
    (dict(scale=0.0), "positive"),
    (dict(scale=torch.tensor(0.1)), "positive"),
    (dict(q_pe=torch.zeros(2, 12, R, 1, dtype=torch.bfloat16)), r"\[B, H, \*\]"),
    (dict(block_table=torch.zeros(2, dtype=torch.int32)), r"block_table \(2,\) must be \[B, max_blocks\]"),
    (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), "at least one block"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), r"lengths \(2,\) must be \[B\]"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32), lengths=torch.ones(3, dtype=torch.int64)),
     "must match q_nope's B=2"),
    (dict(lengths=torch.zeros(2, 1, dtype=torch.int64)), r"must be \[B\]"),
    (dict(w_uv=torch.zeros(11, V, C, dtype=torch.bfloat16)), "w_uv"),
    (dict(kv_cache=torch.zeros(3, 64, C + 2 * R, dtype=torch.bfloat16)), "wide"),
    (dict(kv_cache=torch.zeros(3, 0, C + R, dtype=torch.bfloat16)), "at least one page and row"),
    (dict(kv_cache=torch.zeros(0, 16, C + R, dtype=torch.bfloat16)), "at least one page and row"),
    (dict(kv_cache=torch.zeros(64, C + R, dtype=torch.bfloat16)), r"\[pages, P, C \+ R\]"),
    (dict(kv_cache=torch.zeros(3, 128, C + R, dtype=torch.bfloat16)[:, ::2]), "contiguous"),
    (dict(block_table=torch.zeros(2, 8, dtype=torch.int32)[:, ::2]), "contiguous"),
])
def test_check_args_refuses(over, message):
    with pytest.raises(ValueError, match=message) as err:
        mk.check_args(*_valid(**over))
    assert "\n" not in str(err.value)


def test_check_args_refuses_envelope():
    b, h = 65, 12
    args = make_inputs(b, h, 1, [1] * b)
    with pytest.raises(ValueError, match="at most 64"):
        mk.check_args(*args)
    args = make_inputs(1, 17, 1, [1])
    with pytest.raises(ValueError, match="at most 16"):
        mk.check_args(*args)
    q_nope, q_pe, kv, table, lengths, w_uk, w_uv, scale = make_inputs(1, 12, 1, [1])
    with pytest.raises(ValueError, match="mapping"):  # C = 192: not 8 warps' n-tiles and whole 128-column merges
        mk.check_args(q_nope, q_pe[..., :R], kv[..., : 192 + R].contiguous(), table, lengths,
                      w_uk[..., :192].contiguous(), w_uv[..., :192].contiguous(), scale)


def test_check_args_bounds_a_page_and_a_sequence_not_the_whole_pool():
    """A page's base is 64-bit in the kernel: a pool past 2^31 elements is fine; a page past 2^31 elements (the
    offsets inside it are 32-bit) is not, nor a sequence of 2^31 rows (row numbers are 32-bit)."""
    q_nope, q_pe, _, table, lengths, w_uk, w_uv, scale = make_inputs(1, 12, 1, [1])
    many = torch.empty(2**31 // (C + R) + 1, 1, C + R, dtype=torch.bfloat16, device="meta")  # many one-row pages
    with pytest.raises(ValueError, match="CUDA tensors"):  # passes every check before the device's
        mk.check_args(q_nope, q_pe, many, table, lengths, w_uk, w_uv, scale)
    big = torch.empty(1, 2**31 // (C + R) + 1, C + R, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"a page of kv_cache .* 2\^31"):
        mk.check_args(q_nope, q_pe, big, table, lengths, w_uk, w_uv, scale)
    wide = torch.zeros(1, 2**31 // 16, dtype=torch.int32, device="meta")
    small = torch.empty(1, 16, C + R, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"row numbers need < 2\^31"):
        mk.check_args(q_nope, q_pe, small, wide, lengths, w_uk, w_uv, scale)


# --- the paged cache's addressing ----------------------------------------------------------------------------------


def test_page_index_is_the_ops_definition():
    """Row t of sequence b is kv_cache[block_table[b, t // P], t % P], written out with Python ints; an entry outside
    the pool is clamped into it (as the kernel clamps); the references' and the standards' whole-page gather
    (`table_rows`) gives the same rows."""
    g = torch.Generator().manual_seed(4)
    pages, page_size, blocks = 7, 3, 4
    kv = torch.randn(pages, page_size, 5, generator=g)
    table = torch.tensor([[5, 0, 6, 2], [1, 3, -4, 9]], dtype=torch.int32)
    rows = paged_rows(kv, table, torch.arange(blocks * page_size))
    for b in range(2):
        for t in range(blocks * page_size):
            page = min(max(int(table[b, t // page_size]), 0), pages - 1)
            assert torch.equal(rows[b, t], kv[page, t % page_size])
    assert torch.equal(paged_rows(kv, table[1], torch.tensor([4, 0])), rows[1, [4, 0]])  # one sequence's table
    gathered, positions = table_rows(kv, table)
    assert torch.equal(gathered, rows) and torch.equal(positions, torch.arange(blocks * page_size))


def test_the_slot_form_is_a_page_per_sequence():
    """A cache of one slot of L rows per sequence is the paged op at P = L with block_table = slots[:, None]: the
    reference equals the attention over kv_cache[slots] written directly."""
    q_nope, q_pe, kv, table, lengths, w_uk, w_uv, scale = make_inputs(3, 6, 40, [40, 1, 17], seed=8)
    assert table.shape == (3, 1) and kv.shape[1] == 40
    entries = torch.nan_to_num(kv[table[:, 0].long()].float())  # [B, L, W]: the slots' rows, padding made finite
    valid = torch.arange(40) < lengths[:, None]
    q_lat = torch.einsum("bhn,hnc->bhc", q_nope.float(), w_uk.float())
    scores = torch.cat([q_lat, q_pe.float()], -1) @ entries.transpose(1, 2) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None], -math.inf), -1)
    want = torch.einsum("bhc,hvc->bhv", probs @ entries[..., :C], w_uv.float())
    clean = torch.nan_to_num(kv)
    torch.testing.assert_close(mla_decode(q_nope, q_pe, clean, table, lengths, w_uk, w_uv, scale), want)


@pytest.mark.parametrize("page_size", [16, 64, None])
def test_the_inputs_are_paged_out_of_order_and_poisoned(page_size):
    """The layout every test below runs on (the gate problem's `page_pool`): each sequence's used pages are its
    own, not in order; every other row is NaN (the rest of the last page, the spare pages); table entries past the
    used blocks point at a spare page or one past the pool."""
    lengths = [130, 1, 64, 200]
    _, _, kv, table, lens, *_ = make_inputs(4, 2, 200, lengths, page_size=page_size, seed=3)
    p = page_size or 200
    used = [-(-n // p) for n in lengths]
    owned = [table[i, :u].tolist() for i, u in enumerate(used)]
    flat = [page for pages in owned for page in pages]
    assert len(set(flat)) == len(flat) == kv.shape[0] - 2  # never shared; two spare pages
    assert all(pages != list(range(pages[0], pages[0] + len(pages))) for pages in owned if len(pages) > 1)
    assert table.dtype == torch.int32 and table.shape == (4, -(-200 // p))
    for i, n in enumerate(lengths):
        assert torch.isfinite(paged_rows(kv, table[i], torch.arange(n)).float()).all()
        last = owned[i][-1]
        assert torch.isnan(kv[last, (n - 1) % p + 1:].float()).all()  # past the length on its last page
        beyond = table[i, used[i]:].tolist()
        assert all(e == kv.shape[0] or e not in flat for e in beyond)  # a spare page, or one past the pool
    spare = sorted(set(range(kv.shape[0])) - set(flat))
    assert torch.isnan(kv[spare].float()).all()


# --- the split plan ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 2, 4, 16, 33, 64])
@pytest.mark.parametrize("max_len", [1, 17, 31, 32, 33, 128, 1000, 1024, 4096, 8192, 32768, 131072])
def test_split_plan_covers_every_row_once(b, max_len):
    cfg = MlaConfig()
    splits, chunk = split_plan(b, max_len, 132, cfg)
    assert chunk % TILE == 0 and chunk >= TILE
    assert splits * chunk >= max_len and (splits - 1) * chunk < max_len  # every split starts inside the cache
    assert splits == 1 or chunk >= cfg.min_split_rows
    slots = cfg.ctas_per_sm * 132
    waves = -(-b * splits // slots)
    assert waves == 1 or b * splits >= 0.9 * waves * slots  # a second wave only when the waves are nearly full


def test_merge_vsplit_spreads_the_absorption_over_the_gpu():
    """At batch 1 a head's 128 output columns go to 8 CTAs (96 CTAs for 12 heads instead of 12, each streaming 16 KB
    of W_UV instead of 128 KB); from about two CTAs an SM on, one CTA a (head, group) again; never more CTAs than
    column blocks of 16."""
    assert [merge_vsplit(b, 12, 128, 512) for b in (1, 4, 16, 64)] == [8, 8, 6, 2]
    assert merge_vsplit(1, 6, 128, 512) == 8 and merge_vsplit(64, 6, 128, 512) == 3
    assert merge_vsplit(256, 12, 128, 512) == 1 and merge_vsplit(1, 12, 8, 512) == 1


def test_split_plan_values():
    """Whole waves of 264 CTAs (2 a SM): one wave of 4 x 64 sequences, not two of 5 x 64 (the second a fifth full,
    the old plan's); at batch 1 the merge's per-split cost stops the count at 128 for 32K rows."""
    assert split_plan(1, 1024) == (8, 128)  # min_split_rows caps the count
    assert split_plan(1, 4096) == (32, 128)
    assert split_plan(1, 32768) == (128, 256)
    assert split_plan(1, 131072) == (256, 512)
    assert split_plan(16, 8192) == (16, 512)  # 256 CTAs: one wave
    assert split_plan(16, 32768) == (16, 2048)
    assert split_plan(64, 4096) == (4, 1024)
    assert split_plan(64, 32768) == (4, 8192)
    assert split_plan(64, 1) == (1, 32)
    assert split_plan(64, 32768, 132, MlaConfig(ctas_per_sm=1)) == (2, 16384)  # 128 of 132 slots
    with pytest.raises(ValueError):
        split_plan(0, 10)


# --- compile for sm_90a without a GPU --------------------------------------------------------------------------------


def test_compile_keys_cover_the_contract():
    keys = mk.compile_keys(CONTRACT)
    assert [(h, c, r) for _, h, c, r in keys] == [(6, 512, 64), (12, 512, 64)]


def test_the_split_knobs_are_not_part_of_the_code():
    tuned = MlaConfig(ctas_per_sm=8, min_split_rows=256)
    assert tuned.code == MlaConfig() and MlaConfig(path="fma", ctas_per_sm=4).code == MlaConfig(path="fma")
    assert split_plan(64, 4096, 132, tuned) != split_plan(64, 4096, 132, MlaConfig())  # they still split


def test_config_paths():
    with pytest.raises(ValueError, match="path"):
        MlaConfig(path="wgmma")
    MlaConfig(path="mma").check(12, C, R)
    assert MlaConfig(path="fma").threads == 256 and MlaConfig().threads == 128  # each path's own
    with pytest.raises(ValueError, match="whole k-steps"):  # 4 score parts of whole k-steps
        MlaConfig(path="mma").check(12, C, 32)
    with pytest.raises(ValueError, match="stages"):
        MlaConfig(stages=1)
    assert MlaConfig().path == "mma"  # faster than fma at every point measured on the H200 (NOTES.md, run 3)


def ptx_entry(ptx: str, name: str) -> str:
    """The PTX of the one kernel whose entry name contains `name` (`partial` or `merge`), from its `.entry` to the
    next kernel's: one launch's instructions counted apart from the other's."""
    starts = [m.start() for m in re.finditer(r"\.entry\s+\w+", ptx)] + [len(ptx)]
    found = [ptx[a:b] for a, b in zip(starts, starts[1:]) if name in ptx[a:ptx.find("(", a)]]
    assert len(found) == 1, f"{len(found)} PTX entries are named like {name!r}"
    return found[0]


def lane_divergent_shuffles(ptx: str) -> list[str]:
    """Full-warp `shfl.sync` (member mask -1) reached only by the lanes a branch on the lane id let through: every
    lane named in the mask must execute it, so the others never arrive and the warp hangs. Lane ids are tracked
    from %laneid and from %tid.x & 31 through the registers and predicates computed from them."""
    lane_regs, lane_preds, open_labels, found = set(), set(), set(), []
    for line in ptx.splitlines():
        text = line.strip()
        if text.endswith(":") and text[:-1] in open_labels:
            open_labels.discard(text[:-1])
            continue
        parts = re.split(r"[\s,;{}\[\]]+", text)
        op, dst, srcs = parts[0], parts[1] if len(parts) > 1 else "", parts[2:]
        if "%laneid" in srcs or (op.startswith(("and.", "rem.")) and "%tid.x" in srcs and "31" in srcs):
            lane_regs.add(dst)
        elif op.startswith(("mov.", "and.", "rem.", "cvt.", "setp.")) and lane_regs.intersection(srcs):
            (lane_preds if op.startswith("setp.") else lane_regs).add(dst)
        elif op.startswith("@") and len(parts) > 2 and parts[1] == "bra" and op.lstrip("@!") in lane_preds:
            open_labels.add(parts[2])
        elif op.startswith("shfl.sync") and open_labels and text.rstrip(";").endswith("-1"):
            found.append(text)
    return found


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One PTX instruction: its line number, opcode, the registers it writes and reads, and its global address
    register (the first [...] of a load, the source [...] of a cp.async; None elsewhere)."""

    line: int
    op: str
    writes: frozenset
    reads: frozenset
    address: str | None


def ptx_instructions(ptx: str) -> list[Instruction]:
    out = []
    for number, raw in enumerate(ptx.splitlines()):
        text = re.sub(r"^@!?%\w+\s+", "", raw.strip().rstrip(";"))
        if not text or text.startswith((".", "//", "$", "{", "}")):
            continue
        op, _, rest = text.partition(" ")
        first, _, others = rest.strip().partition(",")
        if first.startswith("["):  # a store or a copy: every operand is read
            writes, reads = frozenset(), frozenset(re.findall(r"%[\w.]+", rest))
        else:
            writes, reads = frozenset(re.findall(r"%[\w.]+", first)), frozenset(re.findall(r"%[\w.]+", others))
        brackets = re.findall(r"\[\s*(%\w+)", rest)
        address = (brackets[-1] if op.startswith("cp.async") else brackets[0]) if brackets and (
            op.startswith(("ld.global", "cp.async"))) else None
        out.append(Instruction(number, op, writes, reads, address))
    return out


def derived_registers(instructions: list[Instruction], seeds: set[str]) -> set[str]:
    """The registers computed from `seeds` by arithmetic (not through a load: an address, not the data at it), to a
    fixpoint (a loop carries values back to its top through movs)."""
    found, grown = set(seeds), True
    while grown:
        grown = False
        for ins in instructions:
            if not ins.op.startswith("ld.") and ins.reads & found and not ins.writes <= found:
                found |= ins.writes
                grown = True
    return found


@dataclasses.dataclass(frozen=True)
class CacheReads:
    """How one kernel's PTX reads the cache: its loads and cp.async copies whose global address is computed from the
    cache pointer (`partial`'s parameter 1), those of them whose address is also computed from a value loaded from
    the block table (parameter 2), those block-table loads, and the (label line, back-edge line) of every loop."""

    cache_loads: list[Instruction]
    paged: list[Instruction]
    table_loads: list[Instruction]
    loops: list[tuple[int, int]]

    def loop_around(self, line: int) -> tuple[int, int]:
        """The innermost loop holding `line`."""
        return min((loop for loop in self.loops if loop[0] < line < loop[1]), key=lambda loop: loop[1] - loop[0])


def cache_reads(ptx: str) -> CacheReads:
    instructions = ptx_instructions(ptx)

    def pointer(index: int) -> str:
        (reg,) = re.findall(rf"ld\.param\.b64\s+(%\w+), \[\w+_param_{index}\];", ptx)
        return reg

    cache, table = (derived_registers(instructions, {pointer(i)}) for i in (1, 2))
    table_loads = [ins for ins in instructions if ins.op.startswith("ld.global") and ins.address in table]
    pages = derived_registers(instructions, {reg for ins in table_loads for reg in ins.writes})
    cache_loads = [ins for ins in instructions if ins.address in cache]
    lines = ptx.splitlines()
    labels = {line.strip()[:-1]: n for n, line in enumerate(lines) if re.fullmatch(r"\$\w+:", line.strip())}
    loops = [(labels[m.group(1)], n) for n, line in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", line)) and labels.get(m.group(1), n) < n]
    return CacheReads(cache_loads, [ins for ins in cache_loads if ins.address in pages], table_loads, loops)


def path_keys(path):
    return [(dataclasses.replace(cfg, path=path), h, c, r) for cfg, h, c, r in mk.compile_keys(CONTRACT)]


@needs_dsl
@pytest.mark.parametrize("key", path_keys("fma") + path_keys("mma"), ids=lambda k: f"{k[0].path}-H{k[1]}")
def test_compiles_for_sm90a_without_spills(key):
    """No spills, no stack; ctas_per_sm CTAs fit a SM, by registers (the fma path's 256 threads <= 128 registers;
    the mma path's 128 threads, whose query fragments live in registers, <= 255) and by shared memory."""
    rep = mk.compile(key, "sm_90a")
    names = sorted(k.name for k in rep.kernels)
    assert len(names) == 2 and any("partial" in n for n in names) and any("merge" in n for n in names)
    cfg, h, c, r = key
    assert rep.ok(max_registers=65536 // (cfg.threads * cfg.ctas_per_sm) - 1), \
        [(k.name, k.registers, k.spill_bytes, k.stack_frame_bytes) for k in rep.kernels]
    assert cfg.smem_bytes(h, c, r) <= 227 * 1024 // cfg.ctas_per_sm


@needs_dsl
@pytest.mark.parametrize("key", path_keys("mma"), ids=lambda k: f"H{k[1]}")
def test_mma_path_ptx(key):
    """The mma path's tile loop is one copy of its body (a dynamic loop): per warp and tile, the score MMAs (hi and
    lo of the 4 n-tiles for each of the warp's k-steps), the P.V MMAs (2 k-steps per n-tile), their ldmatrix.x4,
    and the cp.async copies of the tile S - 1 ahead (the first S - 1 tiles' and the query's before the loop), one
    commit group each; the query's fragments are registers (no shared-memory operand reloads in the loop); nothing
    in local memory."""
    cfg, h, c, r = key
    rep = mk.compile(key, "sm_90a")
    counts = ptx_instruction_counts(ptx_entry(rep.ptx, "partial"), {
        "mma": r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b",
        "ldmatrix": r"\bldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16\b",
        "ldmatrix.trans": r"\bldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16\b",
        "cp.async": r"\bcp\.async\.cg\.shared\.global(?:\.\w+)* \[",
        "commit": r"\bcp\.async\.commit_group\b", "wait": r"\bcp\.async\.wait_group\b",
        "bar.sync": r"\bbar(?:rier)?\.sync\b", "local": r"\b(?:ld|st)\.local\b"})
    w = c + r
    steps = w // MMA_K // SCORE_PARTS  # k-steps of a warp's score part
    n_tiles = c // MMA_N // cfg.warps  # P.V n-tiles a warp
    assert counts["mma"] == 2 * (TILE // MMA_N) * steps + (TILE // MMA_K) * n_tiles  # 72 + 32 at 4 warps
    assert counts["ldmatrix"] == 2 * steps + TILE // MMA_K  # B of two n-tiles each; P's two k-steps
    assert counts["ldmatrix.trans"] == n_tiles
    copies = TILE * w // VEC // cfg.threads  # a thread's 16-byte copies of a tile
    query = -(-h * c // 4 // cfg.threads)  # its copies of q_lat (fp32; q_pe's R columns arrive by plain loads)
    assert counts["cp.async"] == cfg.stages * copies + query
    assert counts["commit"] == cfg.stages + 1 and counts["wait"] == 2
    assert counts["bar.sync"] == 1 + 3 + 1 and counts["local"] == 0


@needs_dsl
@pytest.mark.parametrize("key", path_keys("fma") + path_keys("mma"), ids=lambda k: f"{k[0].path}-H{k[1]}")
def test_every_cache_read_goes_through_the_block_table(key):
    """`partial` reads the cache through the pages: every load or cp.async from the cache pointer (fma: a thread's
    tile loads; mma: its copies of the first tile and of the tile a stage ahead) has its address computed from a
    value loaded from the block table, and the tile loop itself loads from the block table (fma: the page of the
    tile's rows; mma: of the next tile's, one tile early), so every tile's rows find their own page (a slot read
    once before the loop would not)."""
    cfg = key[0]
    reads = cache_reads(ptx_entry(mk.compile(key, "sm_90a").ptx, "partial"))
    per_tile = (C + R) // VEC // (32 * cfg.warps // TILE)  # a thread's loads or copies of a tile
    assert len(reads.cache_loads) == per_tile * (1 if cfg.path == "fma" else cfg.stages)
    assert reads.paged == reads.cache_loads
    start, end = reads.loop_around(reads.cache_loads[-1].line)
    assert any(start < load.line < end for load in reads.table_loads)


def test_the_cache_read_finder_tells_paged_loads_from_others():
    """The PTX analysis above on hand-written kernels: a load whose address comes from a block-table entry loaded
    in the loop is paged; one from the cache pointer plus the loop counter is not."""
    def kernel(offset: str) -> str:
        return f"""
	ld.param.b64 	%rd1, [k_param_1];
	ld.param.b64 	%rd2, [k_param_2];
	mov.b32 	%r1, 0;
$L__BB0_1:
	mul.wide.s32 	%rd3, %r1, 4;
	add.s64 	%rd4, %rd2, %rd3;
	ld.global.b32 	%r2, [%rd4];
	mul.wide.s32 	%rd5, {offset}, 1152;
	add.s64 	%rd6, %rd1, %rd5;
	cp.async.cg.shared.global [%r9], [%rd6], 16, 16;
	add.s32 	%r1, %r1, 1;
	@%p1 bra 	$L__BB0_1;
"""
    paged, slotted = cache_reads(kernel("%r2")), cache_reads(kernel("%r1"))
    assert len(paged.cache_loads) == len(paged.paged) == 1 and len(paged.table_loads) == 1
    assert paged.loop_around(paged.cache_loads[0].line)[0] < paged.table_loads[0].line
    assert len(slotted.cache_loads) == 1 and slotted.paged == []


@needs_dsl
def test_merge_keeps_splits_in_flight():
    """`merge`'s loop over the splits is unrolled: MERGE_UNROLL splits' partial loads in one body (at batch 1 a
    sequence has ~128 splits: one load round trip after another would cost ~30 µs), each a thread's MERGE_COLS
    columns in one 16-byte load (4 scalar loads a split left 75% of the sectors fetched unused: ncu); two barriers
    (the weights' maximum, the weights, then the latent in shared memory before the next sequence or the
    absorption), once in a loop over the CTA's sequences; nothing in local memory."""
    rep = mk.compile(mk.compile_keys(CONTRACT)[-1], "sm_90a")
    counts = ptx_instruction_counts(ptx_entry(rep.ptx, "merge"), {
        "partial loads": r"\bld\.global(?:\.[\w:]+)*\.v4\.[bf]32\b", "bar.sync": r"\bbar(?:rier)?\.sync\b",
        "local": r"\b(?:ld|st)\.local\b"})
    assert MERGE_COLS == 4 and counts["partial loads"] >= MERGE_UNROLL, counts
    assert counts["bar.sync"] == 3 and counts["local"] == 0, counts


@needs_dsl
def test_merge_absorbs_the_output():
    """`merge` writes out = latent W_UV^T in fp32 and no latent: W_UV read in 16-byte pieces of 8 bf16 (two a loop
    iteration, unrolled twice), each piece's 8 products FMA'd into every one of the CTA's MERGE_SEQS sequences' sums
    (the branch keeps the ones past the batch out), the latent read back from shared memory in 16-byte loads; no
    bf16 store (the old parts), no spill."""
    rep = mk.compile(mk.compile_keys(CONTRACT)[-1], "sm_90a")
    merge = ptx_entry(rep.ptx, "merge")
    counts = ptx_instruction_counts(merge, {
        "bf16 stores": r"\bst\.global\.b16\b", "fp32 stores": r"\bst\.global\.(?:b|f)32\b",
        "latent reads": r"\bld\.shared\.v4\.(?:b|f)32\b", "fma": r"\bfma\.rn\.f32\b",
        "local": r"\b(?:ld|st)\.local\b"})
    pieces = 2 * 2  # pieces a loop body (two chains) x the unroll
    assert counts["bf16 stores"] == 0 and counts["local"] == 0, counts
    assert counts["fp32 stores"] >= MERGE_SEQS, counts  # one a sequence (the partials' loop stores none)
    assert counts["latent reads"] >= pieces * MERGE_SEQS * 2, counts  # 8 fp32 of a sequence's latent: two v4
    assert counts["fma"] >= pieces * MERGE_SEQS * 8, counts
    assert all(k.spill_bytes == 0 and k.stack_frame_bytes == 0 for k in rep.kernels)


@needs_dsl
@pytest.mark.parametrize("path", PATHS)
def test_no_shuffle_waits_for_lanes_a_branch_left_out(path):
    """Both launches' warp shuffles run with the whole warp (cute.arch.warp_idx() is such a shuffle: under
    `if lane == 0` it hung `merge` on its first GPU run)."""
    key = path_keys(path)[-1]
    ptx = mk.compile(key, "sm_90a").ptx
    for name in ("partial", "merge"):
        assert lane_divergent_shuffles(ptx_entry(ptx, name)) == [], name


def test_the_divergent_shuffle_finder_finds_one():
    """The PTX `merge` had when it hung: warp_idx()'s shuffle inside `if lane_idx() == 0`."""
    ptx = """
	mov.u32 	%r34, %laneid;
	setp.ne.b32 	%p15, %r34, 0;
	@%p15 bra 	$L__BB1_5;
	shr.u32 	%r35, %r2, 5;
	shfl.sync.idx.b32 	%r36, %r35, 0, 31, -1;
	st.shared.b32 	[%r38+4096], %r7;
$L__BB1_5:
	shfl.sync.bfly.b32 	%r20, %r160, 16, 31, -1;
"""
    assert lane_divergent_shuffles(ptx) == ["shfl.sync.idx.b32 	%r36, %r35, 0, 31, -1;"]


# --- the mma path's fragment maps through models of ldmatrix and mma.sync (PTX ISA layouts) ---------------------------


def ldmatrix_x4(mem: torch.Tensor, rows_cols: list[tuple[int, int]], trans: bool) -> list[list[tuple]]:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16: lane l gives the address of row l % 8 of matrix l // 8 (8 elements
    from (row, col) of mem); register i of lane (g, t) = matrix i's (row g, columns 2t, 2t + 1), or with .trans
    its (rows 2t, 2t + 1, column g), as (low, high) halves."""
    mats = [torch.stack([mem[r, c : c + 8] for r, c in rows_cols[8 * i : 8 * i + 8]]) for i in range(4)]
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        if trans:
            out.append([(m[2 * t, g], m[2 * t + 1, g]) for m in mats])
        else:
            out.append([(m[g, 2 * t], m[g, 2 * t + 1]) for m in mats])
    return out


def mma_m16n8k16(a: list, b: list, c: torch.Tensor) -> torch.Tensor:
    """mma.sync.aligned.m16n8k16.row.col: a[lane] 4 (low, high) pairs, b[lane] 2, c [32, 4] -> d [32, 4]. A: word j
    of lane (g, t) is row g + 8 (j % 2), columns 2t + 8 (j // 2), + 1; B: word i is rows 2t + 8 i, + 1, column g;
    C: value v is row g + 8 (v // 2), column 2t + v % 2."""
    A, B, C = torch.zeros(16, 16, dtype=c.dtype), torch.zeros(16, 8, dtype=c.dtype), torch.zeros(16, 8, dtype=c.dtype)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            A[g + 8 * (j % 2), 2 * t + 8 * (j // 2)], A[g + 8 * (j % 2), 2 * t + 8 * (j // 2) + 1] = a[lane][j]
        for i in range(2):
            B[2 * t + 8 * i, g], B[2 * t + 8 * i + 1, g] = b[lane][i]
        for v in range(4):
            C[g + 8 * (v // 2), 2 * t + v % 2] = c[lane, v]
    D = A @ B + C
    return torch.tensor([[D[lane // 4 + 8 * (v // 2), 2 * (lane % 4) + v % 2] for v in range(4)] for lane in range(32)],
                        dtype=c.dtype)


def test_mma_score_fragments_compute_q_kv():
    """partial_mma's score step with its maps (q_fragment_position, score_ldmatrix_row, c_fragment_position), every
    warp (its k range over all the tile's rows), on integers (exact): the parts' sums are Q KV^T for the 12 heads, 0
    past them, and every (part, head, row) is written by exactly one lane."""
    h, w, cfg = 12, C + R, MlaConfig(path="mma")
    steps = w // MMA_K // SCORE_PARTS
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-4, 5, (16, w), generator=g).double()
    q[h:] = 0
    tile = torch.randint(-4, 5, (TILE, w), generator=g).double()
    scores = torch.zeros(SCORE_PARTS, 16, TILE, dtype=torch.float64)
    written = torch.zeros(SCORE_PARTS, 16, TILE, dtype=torch.int64)
    for warp in range(cfg.warps):
        accs = [torch.zeros(32, 4, dtype=torch.float64) for _ in range(TILE // MMA_N)]
        for ks in range(warp * steps, (warp + 1) * steps):
            a = [[(q[hd, col], q[hd, col + 1]) for hd, col in (q_fragment_position(lane, ks, j) for j in range(4))]
                 for lane in range(32)]
            for pair in range(TILE // 16):
                kvb = ldmatrix_x4(tile, [score_ldmatrix_row(lane, ks, pair) for lane in range(32)], trans=False)
                for half in range(2):
                    nt = 2 * pair + half
                    accs[nt] = mma_m16n8k16(a, [kvb[lane][2 * half : 2 * half + 2] for lane in range(32)], accs[nt])
        for nt in range(TILE // MMA_N):
            for lane in range(32):
                for v in range(4):
                    head, col = c_fragment_position(lane, v)
                    scores[warp, head, 8 * nt + col] = accs[nt][lane, v]
                    written[warp, head, 8 * nt + col] += 1
    assert cfg.warps == SCORE_PARTS and torch.equal(written, torch.ones_like(written))
    assert torch.equal(scores.sum(0), q @ tile.T)


def test_mma_pv_fragments_compute_p_kv():
    """partial_mma's P.V step with its maps (p_ldmatrix_row, the transposed row addresses: lane l -> tile row l,
    c_fragment_position), every warp, on integers: P KV[:, :C]."""
    cfg = MlaConfig(path="mma")
    n_tiles = C // MMA_N // cfg.warps
    g = torch.Generator().manual_seed(2)
    p = torch.randint(-4, 5, (16, TILE), generator=g).double()
    tile = torch.randint(-4, 5, (TILE, C + R), generator=g).double()
    out = torch.zeros(16, C, dtype=torch.float64)
    p_rows = [p_ldmatrix_row(lane) for lane in range(32)]
    for warp in range(cfg.warps):
        col0 = warp * n_tiles * MMA_N
        pa = [ldmatrix_x4(p, [(r, c + ks * MMA_K) for r, c in p_rows], trans=False) for ks in range(TILE // MMA_K)]
        for j in range(n_tiles):
            vb = ldmatrix_x4(tile, [(lane, col0 + j * MMA_N) for lane in range(32)], trans=True)
            acc = torch.zeros(32, 4, dtype=torch.float64)
            for ks in range(TILE // MMA_K):
                acc = mma_m16n8k16(pa[ks], [vb[lane][2 * ks : 2 * ks + 2] for lane in range(32)], acc)
            for lane in range(32):
                for v in range(4):
                    head, col = c_fragment_position(lane, v)
                    out[head, col0 + j * MMA_N + col] = acc[lane, v]
    assert torch.equal(out, p @ tile[:, :C])


# --- the kernel's arithmetic, emulated -------------------------------------------------------------------------------


PAGE_SIZES = [16, 32, 64, 128, None]  # vLLM's block sizes (a tile spans two pages at 16); None: a slot per sequence


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p or '=L'}")
@pytest.mark.parametrize("b, h, max_len, lengths, num_sms", [
    (1, 12, 1, [1], 132),  # one row
    (3, 6, 17, [1, 17, 5], 132),  # a length shorter than a tile; clamped rows
    (4, 12, 300, [1, 300, 40, 129], 132),  # several splits (128 rows), empty ones for the short sequences
    (2, 6, 300, [300, 31], 1),  # one split, several tiles (online softmax across tiles)
    (2, 12, 97, [33, 97], 132),  # a tile boundary inside a split
])
def test_emulation_matches_fp64_reference(b, h, max_len, lengths, num_sms, page_size, path):
    """Every row through its page (make_inputs: pages out of order, lengths ending mid-page, NaN in the rest of
    the last page, in the spare pages and behind the table's unused entries)."""
    args = make_inputs(b, h, max_len, lengths, page_size=page_size, seed=b + h + max_len)
    got, lses = emulate(*args, num_sms=num_sms, cfg=MlaConfig(path=path))
    want = reference64(*args)
    close(got, want)
    splits, chunk = split_plan(b, args[3].shape[1] * args[2].shape[1], num_sms)  # the table's rows: blocks x P
    for i, n in enumerate(lengths):  # empty splits report -inf, the others a finite lse
        for s in range(splits):
            assert torch.isfinite(lses[i, s]).all() == (s * chunk < n)


@pytest.mark.parametrize("h", [12, 6])
@pytest.mark.parametrize("b", [1, 3])
def test_mma_emulation_matches_fp64_reference(b, h):
    """The mma path's arithmetic (hi + lo bf16 query, bf16 p, fp32 accumulation) within the contract at lengths 1,
    17 and 1024 (one split, a partial tile, eight 128-row splits of four tiles)."""
    lengths = [1024, 17, 1][:b] if b > 1 else [1024]
    args = make_inputs(b, h, 1024, lengths, page_size=16, seed=10 * b + h)
    got, _ = emulate(*args, cfg=MlaConfig(path="mma"))
    close(got, reference64(*args))


def test_fma_emulation_agrees_with_the_fp32_reference():
    args = make_inputs(2, 12, 200, [200, 7], page_size=64, seed=3)
    got, _ = emulate(*args, cfg=MlaConfig(path="fma"))
    clean = list(args)
    clean[2] = torch.nan_to_num(args[2])  # the reference masks after scoring: padding must be finite there
    torch.testing.assert_close(got, mla_decode(*clean), rtol=1e-4, atol=1e-4)


def test_emulated_empty_sequence_gives_zero_not_nan():
    q_nope, q_pe, kv, table, _, w_uk, w_uv, scale = make_inputs(1, 6, 64, [64], page_size=16)
    query = torch.cat([torch.einsum("hn,hnc->hc", q_nope[0].float(), w_uk.float()), q_pe[0].float()], dim=-1)
    o, lse = emulate_partial(query, kv, table[0], 0, 0, 64, scale)
    assert (o == 0).all() and (lse == -math.inf).all()
    assert (emulate_merge(o[None, :1].expand(2, 1, C)[:, 0], torch.full((2,), -math.inf)) == 0).all()


# --- GPU --------------------------------------------------------------------------------------------------------------


def _gpu_inputs(b, h, max_len, seed, page_size=16):
    """make_inputs on the GPU, lengths drawn in [1, max_len] with one at 1 and one at max_len; pages of 16 rows
    (vLLM's default block size, the smallest contracted: a tile's rows lie on two pages) unless said."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (b,), generator=g).tolist()
    lengths[0] = 1
    lengths[-1] = max_len
    return make_inputs(b, h, max_len, lengths, page_size=page_size, seed=seed, device=DEVICE)


def _cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("h", [12, 6])
@pytest.mark.parametrize("max_len", [1, 17, 1024, 8192])
@pytest.mark.parametrize("b", [1, 4, 16, 64])
def test_gpu_matches_reference(b, h, max_len, path):
    args = _gpu_inputs(b, h, max_len, seed=b * 7 + max_len + h)
    got = mk.mla_decode_cute(*args, config=MlaConfig(path=path))
    assert got.shape == (b, h, V) and got.dtype == torch.float32
    close(got.cpu(), reference64(*_cpu(args)))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p or '=L'}")
def test_gpu_page_sizes(page_size, path):
    """Every page size of the emulation's, a slot per sequence included, at lengths ending mid-page; an int64 block
    table gives the int32 one's result."""
    args = _gpu_inputs(16, 12, 1000, seed=21, page_size=page_size)
    cfg = MlaConfig(path=path)
    got = mk.mla_decode_cute(*args, config=cfg)
    close(got.cpu(), reference64(*_cpu(args)))
    wide = list(args)
    wide[3] = args[3].long()
    assert torch.equal(mk.mla_decode_cute(*wide, config=cfg), got)


@pytest.mark.gpu
def test_gpu_model_views_match_reference():
    """The model's call (strided q_nope, q_pe, W_UK, W_UV views) gives the reference's result, with no copy asked of
    the caller."""
    args = model_views(_gpu_inputs(4, 12, 1024, seed=5))
    close(mk.mla_decode_cute(*args).cpu(), reference64(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args]))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_deterministic(path):
    args = _gpu_inputs(16, 12, 1024, seed=5)
    cfg = MlaConfig(path=path)
    first = mk.mla_decode_cute(*args, config=cfg)
    for _ in range(3):
        assert torch.equal(mk.mla_decode_cute(*args, config=cfg), first)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_gpu_cuda_graph_replay_with_changed_lengths_and_pages(path):
    """One capture replayed with new lengths and block tables (each sequence takes the next one's pages): the split
    plan depends on B and the table's width only. Every sequence owns a whole context of pages; NaN past each new
    length."""
    b, h, max_len, page_size = 4, 12, 1024, 64
    args = list(make_inputs(b, h, max_len, [max_len] * b, page_size=page_size, seed=11, device=DEVICE))
    kv, table, lengths = args[2], args[3], args[4]
    clean = kv.clone()
    cfg = mk.prepare(h, config=MlaConfig(path=path))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mk.mla_decode_cute(*args, config=cfg)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.mla_decode_cute(*args, config=cfg)
    for new in ([1, 2, 3, 4], [1024, 1, 500, 77], [33, 33, 1024, 1]):
        lengths.copy_(torch.tensor(new, dtype=torch.int64))
        table.copy_(table.roll(1, 0))
        kv.copy_(clean)
        for i, n in enumerate(new):
            kv[page_index(table[i], torch.arange(n, max_len, device=DEVICE), page_size, kv.shape[0])] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        close(out.cpu(), reference64(*_cpu(args)))


def _to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("path, dist, point_index", [("fma", "mixed", 1)] + [
    ("mma", dist, index) for dist in DISTRIBUTIONS for index in (0, 1)])
def test_emulation_passes_the_problem_checker_on_a_problem_case(path, dist, point_index):
    """The kernel's arithmetic on the gate problem's input (ragged lengths, poison past them; 1000 rows, B = 2); for
    the mma path at every distribution and both head counts: a bf16 query alone fails heavy-tailed and large
    inputs (NOTES.md), its hi + lo split must not."""
    try:
        problem = load_problem("mla_decode")
    except ProblemError as e:
        pytest.skip(f"the gate has no problem for mla_decode yet: {e}")
    point = bench_point(CONTRACT, problem, CONTRACT.benchmark.points[point_index])
    case = problem.generate_input(type(point)(2, 0, point.shape, point.dtype), 7, dist)
    got, _ = emulate(*case.args, cfg=MlaConfig(path=path))
    result = problem.check("out", got, problem.reference(*case.args), CONTRACT.tolerance)
    assert result.passed, result.problems


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("point", CONTRACT.benchmark.points,
                         ids=lambda p: "-".join([f"batch{p.batch}", *(f"{k}{v}" for k, v in p.shape.items())]))
def test_matches_reference(point, dist, path):
    try:
        problem = load_problem("mla_decode")
    except ProblemError as e:
        pytest.skip(f"the gate has no problem for mla_decode yet: {e}")
    case = problem.generate_input(bench_point(CONTRACT, problem, point), 0, dist)
    kernel = import_entry_point(CONTRACT.implementation)
    got = kernel(*_to(case.args, DEVICE), config=MlaConfig(path=path))
    result = problem.check("out", got, problem.reference(*_to(case.args, DEVICE)), CONTRACT.tolerance)
    assert result.passed, result.problems
