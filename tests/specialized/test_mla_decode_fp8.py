"""MLA decode over an e4m3 latent cache (mla_decode's kernel, MlaConfig(cache="e4m3")) against the float64 reference.

CPU: the config's rules, the entry point's argument checks, the e4m3 kernel compiled for sm_90a (registers, the exact
e4m3 -> f16 conversions, f16 MMAs, 8-byte cache loads through the block table, no local memory, no shuffle behind a
lane branch), and the kernel's arithmetic emulated in torch (tests/specialized/test_mla_decode.py's emulation with the
f16 operands and the query's power-of-two scaling, its rows read through the pages) within the contract's tolerance
on every distribution of the problem, at both contracted page sizes. GPU (H200): the kernel against the reference at
every benchmark point and distribution.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from gates.problems import DISTRIBUTIONS, Point, bench_point, load_problem
from kernels.contract import load_contract
from kernels.cute import ptx_instruction_counts
from model.kimi_k3.ops.registry import import_entry_point, registry_problems
from model.kimi_k3.specialized import mla_decode_fp8 as mk8
from model.kimi_k3.specialized.mla_decode import compile as compile_key
from model.kimi_k3.specialized.mla_decode.kernel import DSL, MlaConfig
from tests.specialized.test_mla_decode import (
    cache_reads,
    emulate,
    lane_divergent_shuffles,
    operand_dtype,
    ptx_entry,
    query_hi_lo,
    query_scale,
)

CONTRACT_FILE = Path(__file__).resolve().parents[2] / "contracts" / "mla_decode_fp8.yaml"
CONTRACT = load_contract(CONTRACT_FILE)
PROBLEM = load_problem("mla_decode_fp8")
E4M3 = MlaConfig(cache="e4m3")
needs_dsl = pytest.mark.skipif(DSL.error is not None, reason=f"CuTe DSL unavailable: {DSL.error}")


def point(batch: int, heads: int = 12, page_size: int = 64) -> Point:
    return Point(batch, 0, (("heads", heads), ("kv_lora_rank", 512), ("rope_dim", 64), ("page_size", page_size)),
                 "bf16")


def test_contract_names_this_kernel():
    assert CONTRACT.implementation == "model.kimi_k3.specialized.mla_decode_fp8:mla_decode_fp8_cute"
    assert registry_problems(CONTRACT, str(CONTRACT_FILE), imports=False) == []


def test_an_e4m3_cache_runs_on_the_mma_path_only():
    with pytest.raises(ValueError, match="mma path only"):
        MlaConfig(cache="e4m3", path="fma")
    with pytest.raises(ValueError, match="cache 'fp8'"):
        MlaConfig(cache="fp8")
    assert mk8.config_for(12).cache == "e4m3" and mk8.config_for(12).path == "mma"


def test_compile_keys_are_the_e4m3_configs_at_every_head_count():
    keys = mk8.compile_keys(CONTRACT)
    assert [(h, c, r) for _, h, c, r in keys] == [(6, 512, 64), (12, 512, 64)]
    assert all(cfg.cache == "e4m3" for cfg, *_ in keys)


# --- the entry point's checks (CPU tensors: every check before the device's) ---------------------------------------


def _valid(**over):
    args = list(PROBLEM.generate_input(point(2), 0, "normal").args)
    names = ["q_nope", "q_pe", "kv_cache", "kv_scale", "block_table", "lengths", "w_uk", "w_uv", "scale"]
    for k, val in over.items():
        args[names.index(k)] = val
    return args


@needs_dsl
def test_valid_cpu_inputs_pass_every_check_but_the_device():
    with pytest.raises(ValueError, match="CUDA tensors on one device"):
        mk8.mla_decode_fp8_cute(*_valid())


@needs_dsl
@pytest.mark.parametrize("over, message", [
    (dict(kv_scale=0.0), "kv_scale must be a positive finite"),
    (dict(kv_scale=float("nan")), "kv_scale must be a positive finite"),
    (dict(kv_scale=torch.tensor(0.5)), "kv_scale must be a positive finite"),
    (dict(kv_cache=torch.zeros(4, 64, 576, dtype=torch.bfloat16)), "kv_cache must be torch.float8_e4m3fn"),
])
def test_the_entry_point_refuses(over, message):
    with pytest.raises(ValueError, match=message) as err:
        mk8.mla_decode_fp8_cute(*_valid(**over))
    assert "\n" not in str(err.value)


@needs_dsl
def test_a_bf16_config_is_refused_for_an_e4m3_cache():
    with pytest.raises(ValueError, match="cache='e4m3'"):
        mk8.mla_decode_fp8_cute(*_valid(), config=MlaConfig())


# --- compiled for sm_90a without a GPU -------------------------------------------------------------------------------


@needs_dsl
@pytest.mark.parametrize("key", mk8.compile_keys(CONTRACT), ids=lambda k: f"H{k[1]}")
def test_compiles_with_exact_conversions_and_f16_mmas(key):
    """No spills, two CTAs a SM (as the bf16 kernel); the tile's rows arrive in 8-byte cp.async copies (the first
    S - 1 tiles' and each next tile's) into a raw ring, every e4m3 pair goes through cvt.rn.f16x2.e4m3x2 on its way to
    the f16 tile (4 a copy), every MMA is f16 (the bf16 kernel's count), the query in 16-byte copies as the bf16
    kernel's, two barriers more than the bf16 kernel (the query's scaling; the f16 tile freed before each
    conversion), nothing in local memory, no shuffle behind a lane branch; every cache copy's address comes from a
    block-table entry and the tile loop reads the table (as the bf16 kernel's, test_mla_decode.py)."""
    rep = compile_key(key, "sm_90a")
    assert rep.ok(max_registers=65536 // (key[0].threads * key[0].ctas_per_sm) - 1), \
        [(k.name, k.registers, k.spill_bytes) for k in rep.kernels]
    part = ptx_entry(rep.ptx, "partial")
    bf16 = ptx_entry(compile_key((dataclasses.replace(key[0], cache="bf16"), *key[1:]), "sm_90a").ptx, "partial")
    patterns = {"mma f16": r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32\b",
                "mma bf16": r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b",
                "cvt e4m3": r"\bcvt\.rn\.f16x2\.e4m3x2\b",
                "8-byte copies": r"\bcp\.async\.ca\.shared\.global(?:\.\w+)* \[[^]]+\], \[[^]]+\], 8\b",
                "16-byte copies": r"\bcp\.async\.cg\.shared\.global(?:\.\w+)* \[[^]]+\], \[[^]]+\], 16\b",
                "bar.sync": r"\bbar(?:rier)?\.sync\b", "local": r"\b(?:ld|st)\.local\b"}
    got, was = ptx_instruction_counts(part, patterns), ptx_instruction_counts(bf16, patterns)
    cfg, h, c, r = key
    copies = (c + r) // 8 // (32 * cfg.warps // 32)  # a thread's copies a tile (the bf16 kernel's, 8 bytes each)
    assert got["mma f16"] == was["mma bf16"] > 0 and got["mma bf16"] == 0
    query = -(-h * c // 4 // cfg.threads)  # a thread's 16-byte copies of q_lat (fp32)
    assert got["8-byte copies"] == cfg.stages * copies and got["cvt e4m3"] == 4 * copies
    assert got["16-byte copies"] == query and was["16-byte copies"] == cfg.stages * copies + query
    assert got["bar.sync"] == was["bar.sync"] + 2 and got["local"] == 0
    assert lane_divergent_shuffles(part) == [] and lane_divergent_shuffles(ptx_entry(rep.ptx, "merge")) == []
    reads = cache_reads(part)
    assert len(reads.cache_loads) == cfg.stages * copies and reads.paged == reads.cache_loads
    start, end = reads.loop_around(reads.cache_loads[-1].line)
    assert any(start < load.line < end for load in reads.table_loads)


# --- the kernel's arithmetic, emulated ------------------------------------------------------------------------------


def test_the_query_scale_keeps_f16_in_range_exactly():
    q = torch.tensor([[3.0e5, -1.0, 2.0 ** -30], [0.0, 7.0, -5.0e4]])
    qs = query_scale(q, E4M3)
    assert math.log2(qs).is_integer() and 2.0 ** 13 <= float((q * qs).abs().max()) < 2.0 ** 14
    hi, lo = query_hi_lo(q * qs, torch.float16)
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    assert ((hi + lo) / qs - q).abs().max() <= 2.0 ** -20 * q.abs().max()  # ~22 significant bits, scaled back exactly
    assert not torch.isfinite(query_hi_lo(q, torch.float16)[0]).all()  # unscaled, 3e5 is past f16's 65504
    assert query_scale(torch.zeros(2, 3), E4M3) == 1.0 and query_scale(q, MlaConfig()) == 1.0
    assert operand_dtype(E4M3) == torch.float16 and operand_dtype(MlaConfig()) == torch.bfloat16


@pytest.mark.parametrize("page_size", CONTRACT.shapes["page_size"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_the_emulated_kernel_is_within_the_contract(dist, page_size):
    """mla_decode_fp8_cute's arithmetic (f16 operands, the query scaled by a power of two, kv_scale folded into the
    score scale and the output) against the float64 reference, at 12 heads on the problem's inputs."""
    case = PROBLEM.generate_input(point(2, page_size=page_size), 11, dist)
    q_nope, q_pe, cache, kv_scale, table, lengths, w_uk, w_uv, scale = case.args
    got, _ = emulate(q_nope, q_pe, cache, table, lengths, w_uk, w_uv, scale * kv_scale, cfg=mk8.config_for(12))
    check = PROBLEM.check("out", got * kv_scale, PROBLEM.reference(*case.args), CONTRACT.tolerance)
    assert check.passed, check.problems


# --- on the GPU ---------------------------------------------------------------------------------------------------


def point_id(p) -> str:
    return "-".join([f"batch{p.batch}", *(f"{k}{v}" for k, v in p.shape.items())])


@pytest.mark.gpu
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("bench", CONTRACT.benchmark.points, ids=point_id)
def test_matches_reference(bench, dist):
    case = PROBLEM.generate_input(bench_point(CONTRACT, PROBLEM, bench), 0, dist)
    kernel = import_entry_point(CONTRACT.implementation)
    args = [a.to("cuda") if isinstance(a, torch.Tensor) else a for a in case.args]
    got = kernel(*args)
    torch.cuda.synchronize()
    check = PROBLEM.check("out", got.cpu(), PROBLEM.reference(*case.args), CONTRACT.tolerance)
    assert check.passed, check.problems
