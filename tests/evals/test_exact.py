"""The evals gate's exact yardstick (gates/evals/exact.py): which ops get it, that it is the float64 mix, and that
its path runs the exact op where the contract's kernel would, the standard elsewhere."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.checks import evals
from gates.evals.exact import EXACT, attn_res_exact, attn_res_norm_exact, exact_path
from kernels.contract import load_contract
from model.kimi_k3.ops.attn_res import attn_res
from model.kimi_k3.ops.attn_res_norm import attn_res_norm
from tests.evals.test_paths import decode
from tests.gates.fixtures.helpers import CPU_EXAMPLE


def attn_res_inputs(dtype: torch.dtype, m: int = 5, t: int = 3, d: int = 256):
    g = torch.Generator().manual_seed(0)
    sources = [(torch.randn(t, d, generator=g) * 3).to(dtype) for _ in range(m)]
    return sources, torch.randn(d, generator=g).to(dtype), torch.randn(1, d, generator=g).to(dtype), 1e-6


def test_attn_res_exact_is_the_reference_mix_rounded_once():
    """fp32: the reference's own math within fp32 rounding. bf16: within one bf16 step of the reference and
    independent of the sources' order (float64 sums round to the same bf16 whatever their order)."""
    sources, norm_w, proj_w, eps = attn_res_inputs(torch.float32)
    torch.testing.assert_close(attn_res_exact(sources, norm_w, proj_w, eps), attn_res(sources, norm_w, proj_w, eps),
                               rtol=1e-5, atol=1e-5)
    sources, norm_w, proj_w, eps = attn_res_inputs(torch.bfloat16)
    exact = attn_res_exact(sources, norm_w, proj_w, eps)
    assert exact.dtype == torch.bfloat16
    torch.testing.assert_close(exact, attn_res(sources, norm_w, proj_w, eps), rtol=2**-7, atol=1e-3)
    assert torch.equal(exact, attn_res_exact(sources[::-1], norm_w, proj_w, eps))


def test_attn_res_norm_exact_normalizes_the_exact_mix_as_rounded():
    """The exact mix rounded to the sources' dtype (as the op's reference rounds its mix), normalized in float64:
    within two bf16 steps of the reference (the mix may round to a neighbour, then the norm rounds), and the same
    whatever the sources' order."""
    sources, norm_w, proj_w, eps = attn_res_inputs(torch.bfloat16)
    out_w = torch.linspace(0.5, 1.5, sources[0].shape[-1]).to(torch.bfloat16)
    exact = attn_res_norm_exact(sources, norm_w, proj_w, eps, out_w, 1e-5)
    assert exact.dtype == torch.bfloat16
    torch.testing.assert_close(exact, attn_res_norm(sources, norm_w, proj_w, eps, out_w, 1e-5), rtol=2**-6, atol=1e-2)
    assert torch.equal(exact, attn_res_norm_exact(sources[::-1], norm_w, proj_w, eps, out_w, 1e-5))


def test_attn_res_norm_exact_takes_the_partial_sums_add_as_the_reference_does():
    """With an addend, the sum is the reference's bf16 add bit for bit (it has one right answer) and the exact mix
    is that of the sources with the sum last."""
    sources, norm_w, proj_w, eps = attn_res_inputs(torch.bfloat16)
    out_w = torch.linspace(0.5, 1.5, sources[0].shape[-1]).to(torch.bfloat16)
    addend = attn_res_inputs(torch.bfloat16, m=1)[0][0].flip(0)
    y, summed = attn_res_norm_exact(sources, norm_w, proj_w, eps, out_w, 1e-5, addend)
    ref_y, ref_summed = attn_res_norm(sources, norm_w, proj_w, eps, out_w, 1e-5, addend)
    assert torch.equal(summed, ref_summed) and torch.equal(summed, sources[-1] + addend)
    assert torch.equal(y, attn_res_norm_exact([*sources[:-1], summed], norm_w, proj_w, eps, out_w, 1e-5))
    torch.testing.assert_close(y, ref_y, rtol=2**-6, atol=1e-2)


def test_the_yardstick_is_exact_only_for_ops_whose_standard_rounds_as_the_reference():
    attn_res_contract = load_contract(CPU_EXAMPLE)
    kda = load_contract(Path("contracts/kda_decode.yaml"))
    assert set(EXACT) == {"attn_res", "attn_res_norm"}
    assert evals.yardstick(attn_res_contract, gpu=False, kv_cache_dtype="auto") is False  # CPU: absolute bounds
    assert evals.yardstick(kda, gpu=True, kv_cache_dtype="auto") is True  # the standard path
    assert evals.yardstick(kda, gpu=False, kv_cache_dtype="fp8") is True
    build = evals.yardstick(attn_res_contract, gpu=True, kv_cache_dtype="auto")
    assert callable(build) and build.func is exact_path


def test_the_exact_path_runs_the_exact_op_where_the_kernel_would(make_pair, tiny_model, monkeypatch):
    """The CPU example's contract admits the tiny model's decode steps: there the exact mix runs (it is counted as
    the path's specialized calls), prefill falls back to the standard as the candidate's would, and the logits stay
    within fp32 rounding of the standard path's."""
    calls = []
    monkeypatch.setitem(EXACT, "attn_res", lambda *a: calls.append(1) or attn_res_exact(*a))
    path = exact_path(tiny_model, load_contract(CPU_EXAMPLE))
    assert path.name == "standard, attn_res exact"
    logits = decode(path)
    counts = path.dispatch_counts()["attn_res"]
    assert counts["specialized"] == len(calls) > 0 and counts["standard"] > 0
    torch.testing.assert_close(logits, decode(make_pair().candidate), rtol=1e-4, atol=1e-4)
