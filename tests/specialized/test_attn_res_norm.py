"""attn_res_norm's kernel (AttnResNormKernel in model/kimi_k3/specialized/attn_res/kernel.py; entry point
model/kimi_k3/specialized/attn_res_norm/).

CPU: the contract names the entry point, the argument checks (one line each, naming what is wrong), the compile for
sm_90a without spills with the loads, stores and barriers the design promises (attn_res's, plus the norm weight's
loads and one barrier; with the addend, its loads and the sum's stores, and the last source not loaded again).
GPU: the gate problem's inputs at the contract's benchmark points, every distribution at m = 1..9 and T = 1..64,
with and without the addend, and a verify step's 512 tokens against the composition (attn_res's kernel, then the
reference norm) within one bf16 rounding of the norm's output, the partial sum bit for bit, repeated launches bit
for bit, T = 0, and a CUDA graph replay.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gates.problems import bench_point, load_problem
from kernels.contract import load_contract
from kernels.cute import cutlass_available
from kernels.trees import clone, leaves
from model.kimi_k3.ops.attn_res_norm import attn_res_norm
from model.kimi_k3.ops.registry import import_entry_point, registry_problems
from model.kimi_k3.specialized.attn_res import config_for
from model.kimi_k3.specialized.attn_res_norm import attn_res_norm_cute
from tests.specialized.test_attn_res import EPS, D, inputs, memory_traffic

CONTRACT_FILE = Path(__file__).resolve().parents[2] / "contracts" / "attn_res_norm.yaml"
CONTRACT = load_contract(CONTRACT_FILE)


def norm_weight(seed: int, d: int = D, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)


def test_contract_names_this_kernel():
    assert CONTRACT.implementation == "model.kimi_k3.specialized.attn_res_norm:attn_res_norm_cute"
    assert registry_problems(CONTRACT, str(CONTRACT_FILE), imports=False) == []


@pytest.mark.parametrize("case, message", [
    (lambda s, n, p, w: (s, n, p, w.float()), "sources, norm_w, proj_w, out_w must be bf16"),
    (lambda s, n, p, w: (s, n, p, w[:4096]), "out_w must be [D] with D = 7168, got (4096,)"),
    (lambda s, n, p, w: (s, n, p, w.reshape(2, -1)), "out_w must be [D] with D = 7168"),
    (lambda s, n, p, w: (s, n, p, torch.zeros(2 * D, dtype=torch.bfloat16)[1::2]), "out_w must be contiguous"),
    (lambda s, n, p, w: (s, n, p, None), "out_w must be a tensor"),
    (lambda s, n, p, w: ([s[0].float(), s[1]], n, p, w), "must be bf16"),
    (lambda s, n, p, w: (s, n, p, w), "sources, norm_w, proj_w, out_w must be CUDA tensors"),
])
@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
def test_entry_point_refuses_before_launching(case, message):
    sources, norm_w, proj_w, out_w = case(*inputs(2, 3), norm_weight(1))
    with pytest.raises(ValueError) as err:
        attn_res_norm_cute(sources, norm_w, proj_w, EPS, out_w, EPS)
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("make, message", [
    (lambda s: s[0].float(), "sources, norm_w, proj_w, out_w, addend must be bf16"),
    (lambda s: s[0][:2], "addend must have the sources' shape (3, 7168), got (2, 7168)"),
    (lambda s: torch.zeros(3, 2 * D, dtype=torch.bfloat16)[:, ::2], "addend must be contiguous"),
    (lambda s: 1.0, "addend must be a tensor or None"),
    (lambda s: s[0].clone(), "sources, norm_w, proj_w, out_w, addend must be CUDA tensors"),
])
@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
def test_entry_point_refuses_a_bad_addend(make, message):
    sources, norm_w, proj_w = inputs(2, 3)
    with pytest.raises(ValueError) as err:
        attn_res_norm_cute(sources, norm_w, proj_w, EPS, norm_weight(1), EPS, make(sources))
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
@pytest.mark.parametrize("addend", [False, True])
@pytest.mark.parametrize("m", [1, 2, 9])
def test_compiles_for_sm90a_without_spills(m, addend):
    """attn_res's loads (every source's chunks, the two score weights, the sources again for the mix) plus the norm
    weight's chunks; the normalized mix stored; three barriers (scores, softmax inputs, the norm's sum). With the
    addend: its chunks loaded, the sum's stored, and the last source not loaded again for the mix (the sum stays
    in registers): as many loads as without."""
    from model.kimi_k3.specialized.attn_res_norm import compile

    c = config_for(D).chunks_per_thread
    traffic = memory_traffic(compile((config_for(D), m, D, addend), "sm_90a"), m)
    assert traffic == {"ld16": c * (2 * m + 3), "st16": c * (1 + addend), "bar": 3, "local": 0}


def test_compile_keys_cover_both_forms():
    from model.kimi_k3.specialized.attn_res_norm import compile_keys

    keys = compile_keys(CONTRACT)
    assert {(m, addend) for _, m, _, addend in keys} == {(m, a) for m in CONTRACT.shapes["sources"]
                                                          for a in (False, True)}


# --- GPU ---------------------------------------------------------------------------------------------------------

def _kernel():
    from model.kimi_k3.specialized import attn_res_norm

    ok, why = attn_res_norm.available()
    if not ok:
        pytest.skip(why)
    return attn_res_norm.attn_res_norm_cute


def check_close(got: torch.Tensor, sources, norm_w, proj_w, out_w) -> None:
    """Within two bf16 roundings of the reference: the kernel's mix may round to the neighbouring bf16 of the
    reference's (it sums in another order: one step, up to 2^-7 relative at the bottom of a binade), and the two
    normalized values then round to bf16 apart (another step, up to 2^-7). The H200 found single elements at
    1.08-1.36 % (of 3.7 M at most 6)."""
    want = attn_res_norm(sources, norm_w, proj_w, EPS, out_w, EPS)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("point", CONTRACT.benchmark.points,
                         ids=lambda p: f"batch{p.batch}-sources{p.shape['sources']}-terms{p.shape['partial_terms']}")
def test_gate_problem_inputs(point, dist):
    problem = load_problem("attn_res_norm")
    case = problem.generate_input(bench_point(CONTRACT, problem, point), 0, dist)
    got = dict(leaves(import_entry_point(CONTRACT.implementation)(*clone(case.args, "cuda")), "out"))
    ref = list(leaves(problem.reference(*clone(case.args, "cuda")), "out"))
    assert sorted(got) == sorted(name for name, _ in ref)
    for name, want in ref:
        result = problem.check(name, got[name], want, CONTRACT.tolerance)
        assert result.passed, result.problems


@pytest.mark.gpu
@pytest.mark.parametrize("added", [False, True])
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed", "large", "mixed"])
@pytest.mark.parametrize("m", [1, 2, 5, 9])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_matches_reference(t, m, dist, added):
    kernel = _kernel()
    sources, norm_w, proj_w = inputs(m, t, dist, seed=31 * t + m, device="cuda")
    out_w = norm_weight(t + m, device="cuda")
    if not added:
        got = kernel(sources, norm_w, proj_w, EPS, out_w, EPS)
        assert got.dtype == torch.bfloat16 and got.shape == (t, D)
        check_close(got, sources, norm_w, proj_w, out_w)
        assert torch.equal(got, kernel(sources, norm_w, proj_w, EPS, out_w, EPS))  # deterministic
        return
    addend = inputs(1, t, dist, seed=7 * t + m, device="cuda")[0][0]
    got, summed = kernel(sources, norm_w, proj_w, EPS, out_w, EPS, addend)
    want_sum = sources[-1] + addend
    assert torch.equal(summed, want_sum)  # torch's bf16 add, bit for bit
    check_close(got, [*sources[:-1], want_sum], norm_w, proj_w, out_w)
    again = kernel(sources, norm_w, proj_w, EPS, out_w, EPS, addend)
    assert torch.equal(got, again[0]) and torch.equal(summed, again[1])  # deterministic
    assert summed.data_ptr() not in {s.data_ptr() for s in (*sources, addend)}  # a fresh output


@pytest.mark.gpu
def test_the_mix_is_rounded_as_attn_res_returns_it():
    """Normalizing the kernel's own attn_res output with the reference norm gives the fused result bit for bit up
    to the norm's sum order: the fused kernel rounds the mix to bf16 before the norm, as the composition does."""
    from model.kimi_k3.ops.rms_norm import rms_norm
    from model.kimi_k3.specialized.attn_res import attn_res_cute

    kernel = _kernel()
    sources, norm_w, proj_w = inputs(9, 16, "heavy_tailed", seed=3, device="cuda")
    out_w = norm_weight(4, device="cuda")
    composed = rms_norm(attn_res_cute(sources, norm_w, proj_w, EPS), out_w, EPS)
    fused = kernel(sources, norm_w, proj_w, EPS, out_w, EPS)
    mismatched = (fused != composed).float().mean().item()
    assert mismatched < 1e-3, f"{mismatched:.2%} of elements differ from the composition of the two kernels"
    torch.testing.assert_close(fused.float(), composed.float(), rtol=2**-8, atol=0)


@pytest.mark.gpu
def test_verify_step_tokens_and_zero_tokens():
    kernel = _kernel()
    sources, norm_w, proj_w = inputs(9, 512, seed=5, device="cuda")
    out_w = norm_weight(6, device="cuda")
    check_close(kernel(sources, norm_w, proj_w, EPS, out_w, EPS), sources, norm_w, proj_w, out_w)
    empty = [s[:0] for s in sources]
    assert kernel(empty, norm_w, proj_w, EPS, out_w, EPS).shape == (0, D)


@pytest.mark.gpu
@pytest.mark.parametrize("added", [False, True])
def test_graph_replay_reads_the_sources_at_replay_time(added):
    kernel = _kernel()
    sources, norm_w, proj_w = inputs(4, 3, seed=9, device="cuda")
    out_w = norm_weight(10, device="cuda")
    extra = [inputs(1, 3, seed=11, device="cuda")[0][0]] if added else []
    kernel(sources, norm_w, proj_w, EPS, out_w, EPS, *extra)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(sources, norm_w, proj_w, EPS, out_w, EPS, *extra)
    fresh, _, _ = inputs(5, 3, seed=10, device="cuda")
    for s, f in zip([*sources, *extra], fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    again = kernel(sources, norm_w, proj_w, EPS, out_w, EPS, *extra)
    for replayed, direct in zip(leaves(out, "out"), leaves(again, "out")):
        assert torch.equal(replayed[1], direct[1])
    mixed = [*sources[:-1], sources[-1] + extra[0]] if added else sources
    check_close(out[0] if added else out, mixed, norm_w, proj_w, out_w)
