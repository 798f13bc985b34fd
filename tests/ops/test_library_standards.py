"""Library standards (GPU baselines) against the references: moe_experts (humming MXFP4 W4A16 + PyTorch
fallback), attn_res (torch composition), rms_norm (FLA Triton RMSNorm).

CPU: the MoE fallback composition equals the reference on small shapes (MXFP4 and dense, fp32 and bf16
activations); the torch routing alignment has vLLM's moe_align_block_size semantics, and an emulation of
humming's indexed GEMM contract on it reproduces the reference; the attn_res standard equals the reference;
standard_available() says why not on a CPU machine.

GPU (H200; `pytest -m gpu`): at K3 shapes (E=896, L=3584, k=16, TP8 I=384 and TP16 I=256 with 192 real),
T in 1, 4, 16, 64, MXFP4 experts from `mxfp4.quantize` of random bf16 weights and sigmoid top-16 routing:
the humming path (SiTU fused by humming, and SiTU in torch) and the dispatching `moe_experts_standard`
against the reference (relative L2 <= 1e-2 and >= 99.9 % of elements within atol 2e-2 + rtol 1.6e-2);
the Triton routing alignment against the torch one; CUDA-graph capture (replay equals eager, also after new
inputs are copied into the captured buffers); the fallback at K3 shapes and under capture; attn_res and
rms_norm standards at K3 shapes and under capture. Every assertion message carries the metrics.
"""

from __future__ import annotations

import pytest
import torch

from model.kimi_k3 import mxfp4
from model.kimi_k3.bench.probe_standards import (
    K3_BETA,
    K3_BETA_LIN,
    K3_EPS,
    K3_EXPERTS,
    K3_HIDDEN,
    K3_INTER,
    K3_LATENT,
    K3_TOP_K,
    compare,
    fmt,
    make_attn_res_case,
    make_mxfp4_experts,
    make_rms_case,
    make_routing,
    make_z,
    passes,
)
from model.kimi_k3.ops import attn_res_standard as A
from model.kimi_k3.ops import moe_experts_standard as M
from model.kimi_k3.ops import rms_norm_standard as R
from model.kimi_k3.ops.attn_res import attn_res
from model.kimi_k3.ops.moe_experts import moe_experts
from model.kimi_k3.ops.moe_route import moe_route as route
from model.kimi_k3.ops.rms_norm import rms_norm
from model.kimi_k3.ops.situ_mlp import situ

gpu = pytest.mark.gpu
BETA, BETA_LIN = 4.0, 25.0


# ---------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------

def _small_experts(e, inter, latent, seed, dense=False):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, latent, generator=g) * latent ** -0.5
    w2 = torch.randn(e, latent, inter, generator=g) * inter ** -0.5
    if dense:
        return (w13.bfloat16(),), (w2.bfloat16(),)
    q13 = [mxfp4.quantize(w13[i]) for i in range(e)]
    q2 = [mxfp4.quantize(w2[i]) for i in range(e)]
    return ((torch.stack([p for p, _ in q13]), torch.stack([s for _, s in q13])),
            (torch.stack([p for p, _ in q2]), torch.stack([s for _, s in q2])))


def _small_routing(t, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    return route(torch.randn(t, 32, generator=g), torch.randn(e, 32, generator=g), torch.zeros(e), k, True, 1.0)


@pytest.mark.parametrize("dense", [False, True], ids=["mxfp4", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_fallback_equals_reference_cpu(k, dtype, dense):
    if dense and dtype != torch.bfloat16:
        pytest.skip("the reference multiplies dense bf16 experts by z as is: bf16 activations only")
    e, inter, latent, t = 8, 64, 128, 5
    w13, w2 = _small_experts(e, inter, latent, seed=k, dense=dense)
    ids, weights = _small_routing(t, e, k, seed=10 + k)
    z = torch.randn(t, latent, generator=torch.Generator().manual_seed(k)).to(dtype)
    ref = moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN)
    # a tiny chunk budget: several chunks, one pair per chunk
    for budget in (1, 1 << 30):
        out = M.moe_experts_fallback(z, ids, weights, w13, w2, BETA, BETA_LIN, max_temp_bytes=budget)
        m = compare(out, ref, atol=1e-5 if dtype == torch.float32 else 2e-2,
                    rtol=1e-4 if dtype == torch.float32 else 1.6e-2)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert m["rel_l2"] <= (1e-5 if dtype == torch.float32 else 1e-2) and m["close_frac"] == 1.0, fmt(m)


def test_gather_dequantize_is_exact_cpu():
    (p, s), _ = _small_experts(6, 32, 128, seed=3)
    experts = torch.tensor([5, 0, 5, 2])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = M.gather_dequantize(p, s, experts, dtype)
        want = torch.stack([mxfp4.dequantize(p[i], s[i], dtype) for i in experts.tolist()])
        assert torch.equal(got, want), dtype


def test_standard_dispatch_on_cpu_serves_fallback():
    e, inter, latent, t, k = 8, 64, 128, 3, 4
    w13, w2 = _small_experts(e, inter, latent, seed=1)
    ids, weights = _small_routing(t, e, k, seed=2)
    z = torch.randn(t, latent).bfloat16()
    out = M.moe_experts_standard(z, ids, weights, w13, w2, BETA, BETA_LIN)
    ref = moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN)
    assert M.last_path() == "fallback"
    assert passes(compare(out, ref)), fmt(compare(out, ref))
    assert "PyTorch composition" in M.standard_label(quantized=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_standard_available_says_why_not_on_cpu():
    for mod in (M, R):
        ok, why = mod.standard_available()
        assert not ok and "CUDA" in why, why
    assert "humming path unavailable" in M.standard_label()
    with pytest.raises(RuntimeError, match="unavailable"):
        R.rms_norm_standard(torch.randn(2, 8), torch.ones(8), 1e-5)


def _check_alignment(ids, e, block, sorted_ids, expert_ids, ntp, exact_order=True):
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    sorted_ids, expert_ids, total = sorted_ids.cpu(), expert_ids.cpu(), int(ntp.cpu()[0])
    assert sorted_ids.dtype == expert_ids.dtype == ntp.dtype == torch.int32
    assert sorted_ids.numel() == expert_ids.numel() * block and sorted_ids.numel() >= total
    assert total % block == 0 and bool((sorted_ids[total:] == n).all())
    valid = sorted_ids[sorted_ids < n]
    assert sorted(valid.tolist()) == list(range(n)), "every pair exactly once"
    counts = torch.bincount(flat, minlength=e)
    assert total == int(((counts + block - 1) // block * block).sum())
    prev = -1
    for b in range(total // block):
        rows = sorted_ids[b * block:(b + 1) * block]
        rows = rows[rows < n]
        ex = int(expert_ids[b])
        assert rows.numel() > 0, f"block {b} has no pair"
        assert bool((flat[rows] == ex).all()), (f"block {b}: pairs of experts {flat[rows].tolist()} "
                                                f"in expert {ex}'s block")
        assert ex >= prev, "groups in expert order"
        prev = ex
        if exact_order:
            assert rows.tolist() == sorted(rows.tolist())
    assert bool((expert_ids >= 0).all()) and bool((expert_ids < e).all())


@pytest.mark.parametrize("t,k,e,block", [(1, 16, 896, 8), (4, 16, 896, 8), (64, 16, 896, 8), (64, 16, 896, 16),
                                         (512, 16, 896, 16), (7, 3, 8, 4), (3, 2, 8, 8)])
def test_moe_align_block_size_semantics_cpu(t, k, e, block):
    ids, _ = _small_routing(t, e, k, seed=t * 31 + k)
    out = M.moe_align_block_size(ids, e, block)
    _check_alignment(ids, e, block, *out)
    assert out[1].numel() == M.max_align_blocks(t * k, e, block)


def _emulate_indexed_gemm(x, w, sorted_ids, expert_ids, ntp, block, top_k, n_out):
    """What humming's indexed GEMM computes (scheduler.cuh / loader_a / gmem_writer): for every block b below
    num_tokens_padded, every row id r = sorted_ids[...] < n_out: out[r] = x[r // top_k] @ w[expert_ids[b]].T."""
    out = torch.full((n_out, w.shape[1]), float("nan"), dtype=x.dtype)
    for b in range(int(ntp[0]) // block):
        for r in sorted_ids[b * block:(b + 1) * block].tolist():
            if r < n_out:
                out[r] = x[r // top_k] @ w[int(expert_ids[b])].t()
    return out


@pytest.mark.parametrize("block", [4, 8])
def test_indexed_gemm_contract_reproduces_reference_cpu(block):
    """The humming path's glue (alignment, top_k row mapping, SiTU on the split halves, the slot sum), with
    the two GEMMs emulated, equals the reference."""
    e, inter, latent, t, k = 8, 64, 128, 6, 3
    w13, w2 = _small_experts(e, inter, latent, seed=5)
    ids, weights = _small_routing(t, e, k, seed=6)
    z = torch.randn(t, latent, generator=torch.Generator().manual_seed(7))
    d13 = torch.stack([mxfp4.dequantize(w13[0][i], w13[1][i]) for i in range(e)])
    d2 = torch.stack([mxfp4.dequantize(w2[0][i], w2[1][i]) for i in range(e)])
    align = M.moe_align_block_size(ids, e, block)
    gate_up = _emulate_indexed_gemm(z, d13, *align, block, top_k=k, n_out=t * k)
    act = situ(gate_up[:, :inter], gate_up[:, inter:], BETA, BETA_LIN)
    down = _emulate_indexed_gemm(act, d2, *align, block, top_k=1, n_out=t * k)
    out = M.weighted_slot_sum(down, weights)
    ref = moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN)
    m = compare(out, ref, atol=1e-5, rtol=1e-4)
    assert m["rel_l2"] < 1e-5 and m["close_frac"] == 1.0, fmt(m)


def test_situ_cuda_expression_cpu():
    expr = M.situ_cuda_expression(4.0, 25.0)
    assert expr == "(4.0f) * tanhf(a / (4.0f)) * (1.0f / (1.0f + expf(-a))) * ((25.0f) * tanhf(b / (25.0f)))"
    with pytest.raises(ValueError):
        M.situ_cuda_expression(float("inf"), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 9])
def test_attn_res_standard_equals_reference_cpu(m, dtype):
    g = torch.Generator().manual_seed(m)
    src = [(torch.randn(3, 256, generator=g) * (i + 1)).to(dtype) for i in range(m)]
    nw = (torch.rand(256, generator=g) + 0.5).bfloat16()
    pw = (torch.randn(1, 256, generator=g) * 0.05).bfloat16()
    out, ref = A.attn_res_standard(src, nw, pw, 1e-5), attn_res(src, nw, pw, 1e-5)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    m_ = compare(out, ref, atol=1e-6, rtol=1e-5)
    assert m_["close_frac"] == 1.0, fmt(m_)


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------

def _require_humming():
    ok, why = M.standard_available()
    if not ok:
        pytest.fail(f"humming path unavailable on this GPU machine: {why}")


_EXPERTS: dict[int, tuple] = {}


def _k3_experts(tp):
    """K3 rank-local MXFP4 experts for a TP degree (both degrees stay alive: 2.0 + 1.3 GB, as much again once
    repacked for humming)."""
    if tp not in _EXPERTS:
        inter, real = K3_INTER[tp]
        _EXPERTS[tp] = make_mxfp4_experts(K3_EXPERTS, inter, K3_LATENT, inter_real=real, seed=tp)
    return _EXPERTS[tp]


_WARM: set = set()


def _humming_experts(tp):
    """The TP degree's experts repacked for humming, every GEMM config of the tested token counts compiled."""
    _require_humming()
    w13, w2 = _k3_experts(tp)
    experts = M.prepare(w13, w2)
    if tp not in _WARM:
        times = experts.warmup([1, 4, 16, 64], K3_TOP_K)
        print(f"TP{tp} humming warmup: {times}")
        _WARM.add(tp)
    return experts


def _moe_case(tp, t, seed=0):
    w13, w2 = _k3_experts(tp)
    ids, weights = make_routing(t, K3_EXPERTS, K3_TOP_K, seed=1000 * seed + t)
    z = make_z(t, K3_LATENT, seed=1000 * seed + t)
    return z, ids, weights, w13, w2


_REFS: dict[tuple, torch.Tensor] = {}


def _moe_reference(tp, t, seed=0):
    key = (tp, t, seed)
    if key not in _REFS:
        z, ids, weights, w13, w2 = _moe_case(tp, t, seed)
        _REFS[key] = moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)
    return _REFS[key]


def _assert_moe(out, ref, what):
    m = compare(out, ref)
    assert out.dtype == torch.float32, f"{what}: dtype {out.dtype}"
    assert passes(m), f"{what}: {fmt(m)} [{M.standard_label()}]"
    return m


@gpu
@pytest.mark.parametrize("t", [1, 4, 16, 64])
@pytest.mark.parametrize("mode", M.SITU_MODES)
@pytest.mark.parametrize("tp", [8, 16])
def test_moe_humming_equals_reference(tp, mode, t):
    experts = _humming_experts(tp)
    z, ids, weights, w13, w2 = _moe_case(tp, t)
    ref = _moe_reference(tp, t)
    out = experts(z, ids, weights, K3_BETA, K3_BETA_LIN, situ=mode)
    plan = experts.plan(t, K3_TOP_K)
    m = _assert_moe(out, ref, f"humming situ={mode} TP{tp} T={t} blocks={plan.block13}/{plan.block2}")
    print(f"TP{tp} T={t} situ={mode}: {fmt(m)}; GEMM configs {plan.configs}")


@gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("tp", [8, 16])
def test_moe_standard_dispatches_to_humming(tp, t):
    _humming_experts(tp)
    z, ids, weights, w13, w2 = _moe_case(tp, t, seed=3)
    out = M.moe_experts_standard(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)
    assert M.last_path() == "humming"
    assert M.standard_label().startswith("humming "), M.standard_label()
    _assert_moe(out, moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN), f"standard TP{tp} T={t}")
    # the cache: the second call reuses the repacked weights
    assert M.prepare(w13, w2) is M.prepare(w13, w2)


@gpu
def test_moe_humming_inplace_prepare():
    """prepare(inplace=True) writes humming's layout into the checkpoint tensors (no second copy) and
    computes what the out-of-place repack computes."""
    _require_humming()
    inter, real = K3_INTER[8]
    w13, w2 = make_mxfp4_experts(64, inter, K3_LATENT, inter_real=real, seed=9)
    ids, weights = make_routing(16, 64, K3_TOP_K, seed=9)
    z = make_z(16, K3_LATENT, seed=9)
    ref = moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)
    out_of_place = M.HummingMoEExperts(w13, w2)(z, ids, weights, K3_BETA, K3_BETA_LIN)
    before = [t.clone() for t in (*w13, *w2)]
    experts = M.prepare(w13, w2, inplace=True)
    assert experts.inplace and experts.extra_bytes < 1 << 20
    assert experts.w13.weight.data_ptr() == w13[0].data_ptr() and experts.w2.weight_scale.data_ptr() == w2[1].data_ptr()
    assert not all(torch.equal(a, b) for a, b in zip(before, (*w13, *w2))), "checkpoint tensors unchanged"
    out = M.moe_experts_standard(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)  # served from the cache entry
    assert M.last_path() == "humming" and M.prepare(w13, w2) is experts
    same = compare(out, out_of_place)
    assert same["rel_l2"] <= 1e-3, f"inplace vs out-of-place: {fmt(same)}"
    _assert_moe(out, ref, "inplace repack")
    M.release(w13, w2)


@gpu
@pytest.mark.parametrize("t,block", [(1, 8), (16, 8), (64, 8), (64, 16), (512, 16)])
def test_moe_align_triton_matches_torch(t, block):
    if M._TRITON_ERROR is not None:
        pytest.fail(f"Triton unavailable: {M._TRITON_ERROR}")
    ids, _ = make_routing(t, K3_EXPERTS, K3_TOP_K, seed=t + block)
    tri = M.moe_align_block_size_triton(ids, K3_EXPERTS, block)
    ref = M.moe_align_block_size(ids, K3_EXPERTS, block)
    _check_alignment(ids, K3_EXPERTS, block, *tri, exact_order=False)
    assert torch.equal(tri[1], ref[1]) and torch.equal(tri[2], ref[2])


@gpu
def test_weighted_slot_sum_triton():
    down = torch.randn(64 * 16, K3_LATENT, device="cuda").bfloat16()
    w = torch.rand(64, 16, device="cuda")
    got = M.weighted_slot_sum(down, w)
    want = (down.view(64, 16, -1).double() * w.double().unsqueeze(-1)).sum(1)
    assert (got.double() - want).abs().max().item() < 1e-4


def _capture(fn):
    """Warm up on a side stream, capture fn() in a CUDA graph; returns (graph, captured output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def _check_graph(make_fn, what, tol=1e-6):
    """Capture fn over static buffers; replay == eager; then new inputs copied in: replay == eager again."""
    static, fn = make_fn(0)
    g, out = _capture(fn)
    g.replay()
    torch.cuda.synchronize()
    eager = fn()
    m = compare(out, eager)
    assert m["rel_l2"] <= tol, f"{what}: replay vs eager {fmt(m)}"
    fresh, _ = make_fn(1)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    eager = fn()
    m2 = compare(out, eager)
    assert m2["rel_l2"] <= tol, f"{what}: replay vs eager after new inputs {fmt(m2)}"
    return m, m2


@gpu
@pytest.mark.parametrize("mode", M.SITU_MODES)
@pytest.mark.parametrize("t", [1, 16])
def test_moe_humming_cuda_graph(t, mode):
    experts = _humming_experts(8)
    w13, w2 = _k3_experts(8)

    def make(seed):
        z, ids, weights, _, _ = _moe_case(8, t, seed=seed + 11)
        return [z, ids, weights], lambda: experts(z, ids, weights, K3_BETA, K3_BETA_LIN, situ=mode)

    m, m2 = _check_graph(make, f"humming graph T={t} situ={mode}", tol=1e-3)
    print(f"graph T={t} situ={mode}: replay bitwise equal to eager: {m['equal']} / after new inputs: {m2['equal']}")
    # and against the reference on the new inputs
    (z, ids, weights), fn = make(1)
    _assert_moe(fn(), moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN), f"graph inputs T={t}")


@gpu
@pytest.mark.parametrize("t", [1, 4])
def test_moe_fallback_k3_and_graph(t):
    z, ids, weights, w13, w2 = _moe_case(8, t, seed=5)
    out = M.moe_experts_fallback(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)
    _assert_moe(out, moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN), f"fallback TP8 T={t}")

    def make(seed):
        z, ids, weights, _, _ = _moe_case(8, t, seed=seed + 21)
        return [z, ids, weights], lambda: M.moe_experts_fallback(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)

    _check_graph(make, f"fallback graph T={t}", tol=1e-6)


@gpu
def test_moe_fallback_dense_gpu():
    w13, w2 = make_mxfp4_experts(64, 128, 512, seed=2, dense=True)
    ids, weights = make_routing(8, 64, K3_TOP_K, seed=2)
    z = make_z(8, 512, seed=2)
    out = M.moe_experts_standard(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN)
    assert M.last_path() == "fallback"
    _assert_moe(out, moe_experts(z, ids, weights, w13, w2, K3_BETA, K3_BETA_LIN), "dense fallback")


@gpu
@pytest.mark.parametrize("t", [1, 16, 64])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_attn_res_standard_gpu(m, t):
    src, nw, pw = make_attn_res_case(m, t, K3_HIDDEN, seed=m * 100 + t)
    out, ref = A.attn_res_standard(src, nw, pw, K3_EPS), attn_res(src, nw, pw, K3_EPS)
    mt = compare(out, ref, atol=1e-2, rtol=8e-3)
    assert out.dtype == ref.dtype and mt["rel_l2"] <= 4e-3 and mt["close_frac"] >= 0.999, fmt(mt)

    def make(seed):
        s, a, b = make_attn_res_case(m, t, K3_HIDDEN, seed=seed + 5)
        return [*s, a, b], lambda: A.attn_res_standard(s, a, b, K3_EPS)

    _check_graph(make, f"attn_res graph m={m} T={t}")


@gpu
@pytest.mark.parametrize("t", [1, 16, 64, 512])
@pytest.mark.parametrize("d", [K3_HIDDEN, K3_LATENT, 512, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_standard_gpu(d, t, dtype):
    ok, why = R.standard_available()
    if not ok:
        pytest.fail(f"FLA RMSNorm unavailable: {why}")
    x, w = make_rms_case(t, d, seed=d + t, dtype=dtype)
    out, ref = R.rms_norm_standard(x, w, K3_EPS), rms_norm(x, w, K3_EPS)
    assert out.dtype == x.dtype and out.shape == x.shape
    # bf16: one ulp at most (FLA's 1/sqrt vs the reference's rsqrt flips a rounding now and then);
    # fp32: a few ulps (the rstd's last bits)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -18
    diff = (out.double() - ref.double()).abs()
    bound = ulp * ref.double().abs() + 1e-30
    frac_exact = (out == ref).double().mean().item()
    min_exact = 0.99 if dtype == torch.bfloat16 else 0.0
    assert bool((diff <= bound).all()) and frac_exact >= min_exact, \
        f"max rel diff {(diff / ref.double().abs().clamp_min(1e-30)).max().item():.2e}, exact fraction {frac_exact:.5f}"

    def make(seed):
        xx, ww = make_rms_case(t, d, seed=seed + 3, dtype=dtype)
        return [xx, ww], lambda: R.rms_norm_standard(xx, ww, K3_EPS)

    _check_graph(make, f"rms_norm graph D={d} T={t}", tol=0.0)


def test_rms_norm_out_dtype_rounds_the_fp32_result_once():
    """The reference with out_dtype equals its fp32 result cast afterwards, bit for bit (the MoE latent norm's
    cast, moved into the op)."""
    x, w = make_rms_case(16, K3_LATENT, seed=5, device="cpu", dtype=torch.float32)
    w = w.to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, K3_EPS, torch.bfloat16), rms_norm(x, w, K3_EPS).to(torch.bfloat16))


@gpu
@pytest.mark.parametrize("t", [1, 64])
def test_rms_norm_standard_out_dtype_gpu(t):
    """FLA with out_dtype bf16 on an fp32 input: within one bf16 ulp of its fp32 output cast to bf16 and of the
    reference. Not bit for bit: Triton autotunes the row kernel per argument dtype, so the bf16-output launch may run
    another num_warps, another reduction order, another last bit of rstd (seen at 64 tokens on the H200)."""
    ok, why = R.standard_available()
    if not ok:
        pytest.fail(f"FLA RMSNorm unavailable: {why}")
    x, w = make_rms_case(t, K3_LATENT, seed=t, dtype=torch.float32)
    w = w.to(torch.bfloat16)
    out = R.rms_norm_standard(x, w, K3_EPS, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    for other in (R.rms_norm_standard(x, w, K3_EPS).to(torch.bfloat16), rms_norm(x, w, K3_EPS, torch.bfloat16)):
        assert bool(((out.double() - other.double()).abs() <= 2.0**-7 * other.double().abs() + 1e-30).all())
