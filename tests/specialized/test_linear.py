"""linear: y = x W^T (decode-batch bf16 projection, CuTe DSL) against a float64 reference.

CPU: the kernel compiles for sm_90a (no spills, <= 255 registers, the loads / MMAs / cluster exchange the design
says); the config heuristic is sane for every K3 shape and M; the entry point's argument checks raise ValueError
before anything is written. GPU (H200): every K3 shape at TP8 and TP16 x M in 1..64 on normal inputs and on
inputs with rows scaled by 64, into NaN-poisoned outputs; determinism; strided x; CUDA-graph replay; every path,
tiling, K split and ring depth on integer-valued inputs, where fp32 sums are exact in any order so that any
difference is a logic error. A failure prints `diagnose`: which tokens, rows, row tiles and K splits are wrong,
and what the wrong values equal (partial sums of some K splits, another row's or token's result, zero, NaN).

    PYTHONPATH=$PWD python -m pytest -q tests/specialized/test_linear.py                  # CPU part
    PYTHONPATH=$PWD python -m pytest -q -m gpu -n 8 tests/specialized/test_linear.py      # GPU part (~120 compiles)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch

from kernels.cute import cutlass_available
from model.kimi_k3.specialized.linear.kernel import LinearConfig
from model.kimi_k3.specialized.linear.shapes import PROJECTIONS, SHAPES, bytes_moved, names
from model.kimi_k3.specialized.linear.tuned import MEASURED_SMS, TUNED, tuned_config

CUTLASS_OK, CUTLASS_WHY = cutlass_available()
needs_cutlass = pytest.mark.skipif(not CUTLASS_OK, reason=f"CuTe DSL not importable: {CUTLASS_WHY}")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200); CPU CI compiles only")

NUM_SMS = 132
TOKENS_GEMV = (1, 2, 3, 4, 7, 8)
TOKENS_MMA = (9, 16, 33, 64)
ATOL, RTOL, MAX_REL_L2 = 2e-2, 1.6e-2, 1e-2


# ----------------------------------------------------------------------------------------------- CPU


def _cfg(path, warps, rows_per_warp, split_k, stages, out_dtype="bfloat16"):
    return LinearConfig(path=path, warps=warps, rows_per_warp=rows_per_warp, split_k=split_k, stages=stages,
                        out_dtype=out_dtype)


# (config, M, K): the heuristic's picks for K3 shapes plus the corners (M = 1, padding tokens, fp32 out, mma at M <= 8)
COMPILE_CASES = [
    (_cfg("gemv", 4, 8, 1, 4), 1, 7168),  # lm_head, batch 1
    (_cfg("gemv", 4, 8, 2, 4), 8, 7168),  # kda_in_proj TP8
    (_cfg("gemv", 4, 4, 4, 3, "float32"), 3, 1536),  # padding tokens in the butterfly (M 3 -> 4), fp32 out
    (_cfg("gemv", 2, 4, 1, 3), 7, 384),  # K = 384: 3 k-steps, one group and no runtime loop; 8-row CTAs
    (_cfg("gemv", 4, 4, 8, 7), 5, 7168),  # 7 k-steps: one group of 7, no runtime loop
    (_cfg("mma", 4, 16, 4, 8), 9, 7168),  # a second token tile holding one token
    (_cfg("mma", 4, 16, 4, 8), 16, 4224),  # dense_down: 33 k-steps, a tail of one step
    (_cfg("mma", 2, 16, 8, 6), 33, 1536),
    (_cfg("mma", 4, 32, 2, 3), 64, 7168),  # lm_head at 64 tokens: the most registers
    (_cfg("mma", 1, 16, 8, 5, "float32"), 1, 7168),  # mma at M = 1, 16-row CTAs, fp32 out
]


def _unrolled_steps(cfg: LinearConfig, k: int) -> int:
    """k-steps the code holds (each issues one ring fill and computes one step): `stages` in the runtime loop's
    body (compiled away when the K-range is a single group), `stages` in the last group, steps % stages after."""
    steps = cfg.k_steps(k)
    return (cfg.stages if steps >= 2 * cfg.stages else 0) + cfg.stages + steps % cfg.stages


@needs_cutlass
@pytest.mark.parametrize("cfg,m,k", COMPILE_CASES,
                         ids=[f"{c.path}-w{c.warps}x{c.rows_per_warp}-s{c.split_k}-st{c.stages}-M{m}-K{k}-{c.out_dtype}"
                              for c, m, k in COMPILE_CASES])
def test_compiles_for_sm90a_without_gpu(cfg, m, k):
    """One kernel for sm_90a: no spills, no local memory, <= 255 registers; every weight load a 16-byte
    L1::no_allocate load, loads_per_step of them per unrolled k-step; the MMA count of the unrolled steps; the
    cluster exchange only with a K split."""
    from kernels.cute import ptx_instruction_counts
    from model.kimi_k3.specialized.linear.kernel import compile_report

    rep = compile_report(cfg, m, k, arch="sm_90a")
    assert len(rep.kernels) == 1, rep.ptxas_log
    kern = rep.kernels[0]
    print(f"{cfg} M={m} K={k}: {kern.registers} registers, {kern.spill_bytes} B spills, {kern.smem_bytes} B smem")
    assert kern.arch == "sm_90a"
    assert kern.spill_bytes == 0 and kern.stack_frame_bytes == 0, kern
    assert 0 < kern.registers <= 255, kern
    assert kern.smem_bytes == cfg.smem_bytes(m) <= 227 * 1024
    counts = ptx_instruction_counts(rep.ptx)
    assert counts["ld.local"] == 0 and counts["st.local"] == 0
    weight_loads = rep.ptx.count("ld.global.L1::no_allocate.v4")
    assert weight_loads == _unrolled_steps(cfg, k) * cfg.loads_per_step, weight_loads
    if cfg.path == "mma":  # 2 per (row tile, token tile) per step
        mmas = _unrolled_steps(cfg, k) * 2 * (cfg.rows_per_warp // 16) * -(-m // 8)
        assert rep.ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == mmas
    else:
        assert "mma.sync" not in rep.ptx
    if cfg.split_k > 1:  # sends in a runtime loop over the CTA's partials (which the compiler may unroll)
        assert rep.ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes") >= 1
        assert rep.ptx.count("barrier.cluster.arrive.relaxed") == 1 and "fence.mbarrier_init.release.cluster" in rep.ptx
    else:
        assert "cluster" not in rep.ptx
    assert rep.cubin_path and rep.cubin_path.endswith(".cubin")


def _heuristic_keys():
    """The distinct (config, M, K) the heuristic picks for the K3 shapes at the M that need the most registers in
    each path and token-tile class: 8 (gemv), 16, 32 and 64 (mma)."""
    keys = {(LinearConfig.for_shape(m, n, k, NUM_SMS), m, k) for (n, k) in SHAPES for m in (8, 16, 32, 64)}
    return sorted(keys, key=lambda t: (t[2], t[1], str(t[0])))


@pytest.mark.slow
@needs_cutlass
def test_every_heuristic_config_compiles_clean():
    """Slow (49 configs, ~6 min on 2 cores): the heuristic's configs for every K3 shape compile without spills."""
    from model.kimi_k3.specialized.linear.kernel import compile_report

    problems = []
    for cfg, m, k in _heuristic_keys():
        kern = compile_report(cfg, m, k).kernels[0]
        print(f"{cfg} M={m} K={k}: {kern.registers} registers, {kern.spill_bytes} B spills", flush=True)
        if kern.spill_bytes or kern.stack_frame_bytes or not 0 < kern.registers <= 255:
            problems.append((cfg, m, k, kern))
    assert not problems, problems


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_heuristic_is_sane_for_every_k3_shape(out_dtype):
    """Every K3 projection and M in {1, 2, 4, 8, 16, 32, 64}: a valid config (M <= 8 on CUDA cores, above on
    tensor cores), >= 1.4 CTAs per SM (>= 2 for all but 768 rows at 64 tokens), x re-read from L2 at most
    twice per weight byte, a pipeline of >= 1 stage and <= 16 loads in flight per thread."""
    for (n, k), m in itertools.product(SHAPES, (1, 2, 4, 8, 16, 32, 64)):
        cfg = LinearConfig.for_shape(m, n, k, num_sms=NUM_SMS, out_dtype=out_dtype)
        where = f"{names(n, k)} N={n} K={k} M={m}: {cfg}"
        cfg.check(m, k)
        assert cfg.out_dtype == out_dtype
        assert cfg.path == ("gemv" if m <= 8 else "mma"), where
        assert cfg.ctas(n) >= 1.4 * NUM_SMS, where
        assert m / cfg.block_rows <= 2, where
        assert 1 <= cfg.stages <= cfg.k_steps(k) and cfg.stages * cfg.loads_per_step <= 16, where
        assert cfg.smem_bytes(m) <= 227 * 1024, where


@needs_cutlass
@pytest.mark.parametrize("key", sorted(TUNED), ids=[f"M{m}-N{n}-K{k}" for m, n, k in sorted(TUNED)])
def test_measured_configs_are_valid_and_compile_clean(key):
    """Every entry of the measured table (tuned.py) is a K3 projection, is what config_for returns on the H200
    (and not elsewhere), fits its problem, and compiles for sm_90a without spills."""
    from model.kimi_k3.specialized.linear import config_for
    from model.kimi_k3.specialized.linear.kernel import compile_report

    m, n, k = key
    assert (n, k) in SHAPES
    cfg = config_for(m, n, k, num_sms=MEASURED_SMS)
    assert cfg == tuned_config(m, n, k, MEASURED_SMS, "bfloat16") != config_for(m, n, k, num_sms=MEASURED_SMS + 2)
    cfg.check(m, k)
    kern = compile_report(cfg, m, k, arch="sm_90a").kernels[0]
    assert kern.spill_bytes == 0 and kern.stack_frame_bytes == 0 and 0 < kern.registers <= 255, kern


def test_heuristic_routes_k_not_multiple_of_128_to_mma():
    cfg = LinearConfig.for_shape(4, 7168, 2112)  # K = 66 x 32: no 128-element gemv step fits
    assert cfg.path == "mma" and 2112 % (cfg.k_step * cfg.split_k) == 0
    with pytest.raises(ValueError):
        LinearConfig.for_shape(4, 7168, 100)


def test_config_rejects_what_it_cannot_build():
    for bad in (dict(path="wgmma"), dict(out_dtype="float16"), dict(warps=3), dict(path="gemv", rows_per_warp=6),
                dict(path="mma", rows_per_warp=8), dict(split_k=3), dict(split_k=16),
                dict(path="gemv", warps=1, rows_per_warp=2, split_k=4), dict(stages=0), dict(min_ctas_per_sm=-1)):
        with pytest.raises(ValueError):
            LinearConfig(**{"path": "gemv", **bad} if "path" not in bad else bad)
    cfg = LinearConfig(path="gemv", split_k=2, stages=4)
    for m, k in ((9, 7168), (0, 7168), (1, 7168 + 32), (1, 7168 - 128), (1, 256 * 3)):
        with pytest.raises(ValueError):
            cfg.check(m, k)  # too many tokens, none, K not a multiple of 2 x 128, fewer k-steps than stages


@needs_cutlass
@pytest.mark.parametrize("n_vals", [1, 2, 4, 8, 16, 32, 64])
def test_half_warp_transpose_sum_on_a_cpu_warp(n_vals):
    """The gemv path's reduction, run on a numpy model of a warp (a value is an array over the 32 lanes, a
    shuffle a gather by lane ^ offset): each writer lane holds, for i < len(sums), the half-warp's sum of value
    first + i, and the writers cover every value of both half-warps exactly once."""
    import numpy as np

    from model.kimi_k3.specialized.linear.kernel import _half_warp_transpose_sum

    lane = np.arange(32)
    rng = np.random.default_rng(n_vals)
    vals = [rng.integers(-1000, 1000, 32).astype(np.float64) for _ in range(n_vals)]
    sums, first, writer = _half_warp_transpose_sum(vals, lane, select=np.where,
                                                   shuffle_xor=lambda v, off: v[lane ^ off])
    covered = []
    for ln in np.nonzero(writer)[0]:
        half = slice(16 * (ln // 16), 16 * (ln // 16) + 16)
        for i, s_ in enumerate(sums):
            assert s_[ln] == vals[first[ln] + i][half].sum(), (ln, i)
            covered.append((ln // 16, first[ln] + i))
    assert sorted(covered) == [(h, v) for h in range(2) for v in range(n_vals)]


def _fragment_index(operand: str, lane: int, v: int) -> int:
    """Where value v of lane (g, t) = (lane / 4, lane % 4) sits in the m16n8k16 tile (column-major: A (m, k)
    16 x 16, B (n, k) 8 x 16, C (m, n) 16 x 8), as mma_step and mma_partials assume: A (row g + 8 v1, k 2t + v0 +
    8 v2), B (token g, k 2t + v0 + 8 v1), C (row g + 8 v1, token 2t + v0), v = v0 + 2 v1 + 4 v2."""
    g, t = lane // 4, lane % 4
    if operand == "A":
        return g + 8 * ((v // 2) % 2) + 16 * (2 * t + v % 2 + 8 * (v // 4))
    if operand == "B":
        return g + 8 * (2 * t + v % 2 + 8 * (v // 2))
    return g + 8 * (v // 2) + 16 * (2 * t + v % 2)


@needs_cutlass
def test_mma_fragment_layouts_are_what_the_kernel_assumes():
    """The warp MMA atom's thread-value layouts (CuTe's own description of mma.sync.m16n8k16 bf16) place every
    fragment value where the mma path's K permutation and epilogue expect it."""
    from model.kimi_k3.specialized.linear.kernel import BFloat16, Float32, cute

    mismatches = {}

    def check(operand, tv):
        values = cute.size(tv, mode=[1])
        mismatches[operand] = [(lane, v) for lane in range(32) for v in range(values)
                               if tv((lane, v)) != _fragment_index(operand, lane, v)]

    @cute.jit
    def probe():
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        check("A", atom.tv_layout_A)
        check("B", atom.tv_layout_B)
        check("C", atom.tv_layout_C)

    cute.compile(probe)
    assert mismatches == {"A": [], "B": [], "C": []}, mismatches


def _poison(shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype)


def _bad_calls():
    """(label, x, weight, kwargs, message fragment): each must raise ValueError before writing."""
    m, n, k = 4, 64, 256
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    wide = torch.randn(m, k + 64).bfloat16()
    yield "x fp16", x.half(), w, {}, "bf16"
    yield "weight fp32", x, w.float(), {}, "bf16"
    yield "x 3-D", x[None], w, {}, "[M, K]"
    yield "K mismatch", x, w[:, :128], {}, "K="
    yield "M 65", torch.randn(65, k).bfloat16(), w, {}, "M=65"
    yield "K 100", torch.randn(m, 100).bfloat16(), torch.randn(n, 100).bfloat16(), {}, "multiple of 32"
    yield "weight transposed", x, torch.randn(k, n).bfloat16().t(), {}, "contiguous"
    yield "x column stride 2", torch.randn(m, 2 * k).bfloat16()[:, ::2], w, {}, "stride"
    yield "x row stride 260", torch.randn(m, k + 4).bfloat16()[:, :k], w, {}, "stride"
    yield "x misaligned", wide[:, 4:k + 4], w, {}, "aligned"
    yield "out shape", x, w, dict(out=_poison((n, m))), f"[{m}, {n}]"
    yield "out fp16", x, w, dict(out=_poison((m, n), torch.float16)), "bf16 or fp32"
    yield "out strided", x, w, dict(out=_poison((m, 2 * n))[:, ::2]), "contiguous"
    yield "out_dtype vs out", x, w, dict(out=_poison((m, n)), out_dtype=torch.float32), "out_dtype"
    shared = torch.randn(m * k).bfloat16()
    yield "out overlaps x", shared.view(m, k), w, dict(out=shared[:m * n].view(m, n)), "overlaps"
    yield "CPU tensors", x, w, dict(out=_poison((m, n))), "CUDA"


def test_bad_calls_raise_before_writing():
    """Every input outside the envelope raises ValueError (checks ordered so that all of them run on CPU
    tensors, the device check last), and a given out is left as it was."""
    from model.kimi_k3.specialized.linear import check_args, linear_cute

    for label, x, w, kw, fragment in _bad_calls():
        out = kw.get("out")
        before = out.clone() if out is not None else None
        fn = linear_cute if CUTLASS_OK else check_args
        with pytest.raises(ValueError, match=None) as info:
            if fn is linear_cute:
                linear_cute(x, w, **kw)
            else:
                check_args(x, w, kw.get("out"), kw.get("out_dtype"))
        assert fragment in str(info.value), f"{label}: {info.value}"
        if out is not None and label != "out overlaps x":
            assert torch.equal(out.isnan(), before.isnan()), f"{label}: out was written"


def test_floor_per_shape():
    """Bytes and floor at 4.3 TB/s, as NOTES.md tabulates them: e.g. kda_in_proj TP8 moves 90.1 MB -> 21.0 us."""
    b = bytes_moved(1, 6288, 7168)
    assert abs(b / 1e6 - 90.2) < 0.1 and abs(b / 4.3e12 * 1e6 - 21.0) < 0.05
    assert bytes_moved(64, 20480, 7168, out_bytes=4) == 2 * 20480 * 7168 + 2 * 64 * 7168 + 4 * 64 * 20480
    assert {(p.n, p.k) for p in PROJECTIONS} == set(SHAPES) and len(SHAPES) == 15


# ----------------------------------------------------------------------------------------------- GPU


@functools.lru_cache(maxsize=4)
def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed * 1_000_003 + n * 7919 + k)
    return (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16()


def _x(m: int, k: int, dist: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda")
    if dist == "large_rows":  # a few rows of large activations, as after an outlier channel
        x[::3] *= 64
    return x.bfloat16()


def _exact_inputs(m: int, n: int, k: int, seed: int):
    """Integer-valued x and W in -2..2: every partial sum is an integer below 2^24, exact in fp32 in any order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(-2, 3, (m, k), generator=g, device="cuda").bfloat16()
    w = torch.randint(-2, 3, (n, k), generator=g, device="cuda").bfloat16()
    return x, w


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def diagnose(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig,
             bad: torch.Tensor) -> str:
    """What is wrong, in terms of the kernel's decomposition: tokens, rows, row tiles, in-tile rows (and which
    cluster CTA finalizes them), and for a sample of wrong elements what their value equals."""
    m, k = x.shape
    n = w.shape[0]
    got, want = got.double(), want.double()
    lines = [f"{cfg} M={m} N={n} K={k}: {int(bad.sum())} of {bad.numel()} elements wrong, "
             f"{int(got.isnan().sum())} NaN (never written?), {int(got.isinf().sum())} inf"]
    if not bad.any():
        return lines[0]
    tokens = sorted(set(bad.nonzero()[:, 0].tolist()))
    rows = bad.any(0).nonzero()[:, 0]
    local = (rows % cfg.block_rows).tolist()
    lines.append(f"tokens wrong: {tokens}")
    lines.append(f"rows wrong: {rows.numel()} of {n}, first {rows[:12].tolist()}, last {rows[-4:].tolist()}; "
                 f"row tiles {len(set((rows // cfg.block_rows).tolist()))} of {cfg.row_tiles(n)} "
                 f"(last tile is {n - (cfg.row_tiles(n) - 1) * cfg.block_rows} rows)")
    lines.append(f"in-tile rows wrong: {sorted(set(local))[:40]}")
    if cfg.split_k > 1:
        owners = sorted({r // (cfg.block_rows // cfg.split_k) for r in local})
        lines.append(f"cluster CTAs that finalize them: {owners} of {cfg.split_k}")
    kl = k // cfg.split_k
    partials = torch.stack([x[:, s * kl:(s + 1) * kl].double() @ w[:, s * kl:(s + 1) * kl].double().t()
                            for s in range(cfg.split_k)])
    for mi, ni in bad.nonzero()[:8].tolist():
        g_, r_ = got[mi, ni].item(), want[mi, ni].item()
        tol = ATOL + RTOL * abs(r_)
        notes = []
        if g_ == 0:
            notes.append("zero")
        for subset in itertools.chain.from_iterable(itertools.combinations(range(cfg.split_k), c)
                                                    for c in range(1, cfg.split_k)):
            if abs(partials[list(subset), mi, ni].sum().item() - g_) <= tol:
                notes.append(f"= partial sum of K splits {subset}")
                break
        for dm, dn in ((0, 1), (0, -1), (0, 8), (0, -8), (0, 16), (0, -16), (1, 0), (-1, 0), (2, 0), (-2, 0)):
            if 0 <= mi + dm < m and 0 <= ni + dn < n and abs(want[mi + dm, ni + dn].item() - g_) <= tol:
                notes.append(f"= result of token {mi + dm} row {ni + dn}")
        lines.append(f"  y[{mi}, {ni}] = {g_:.6g}, want {r_:.6g} {' '.join(notes)}")
    return "\n".join(lines)


def _check(got, x, w, cfg, *, exact=False):
    """Exact: equal to the float64 result. Otherwise: relative L2 < 1e-2 and every element within atol 2e-2 +
    rtol 1.6e-2 of the reference rounded to the output's dtype."""
    want = _reference(x, w)
    assert got.shape == want.shape
    if exact:
        bad = got.double() != want
        assert not bad.any(), diagnose(got, want, x, w, cfg, bad)
        return
    want_rounded = want.to(got.dtype).double()
    err = (got.double() - want_rounded).abs()
    bad = ~(err <= ATOL + RTOL * want_rounded.abs())  # NaN counts as bad
    rel = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert not bad.any() and rel < MAX_REL_L2, f"rel L2 {rel:.3e}\n" + diagnose(got, want, x, w, cfg, bad)


def _run(x, w, cfg=None, out_dtype=torch.bfloat16):
    """linear_cute into a NaN-poisoned output; returns (y, the config it ran)."""
    from model.kimi_k3.specialized.linear import config_for, linear_cute

    m, n = x.shape[0], w.shape[0]
    cfg = cfg or config_for(m, n, x.shape[1], out_dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    y = linear_cute(x, w, out=out, config=cfg)
    torch.cuda.synchronize()
    assert y is out
    return out, dataclasses.replace(cfg, out_dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[out_dtype])


@gpu
@needs_cuda
@needs_cutlass
def test_available_on_h200():
    from model.kimi_k3.specialized.linear import available

    ok, why = available()
    assert ok, why


@gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("m", TOKENS_GEMV + TOKENS_MMA)
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{names(n, k).replace(' ', '-')}-{n}x{k}" for n, k in SHAPES])
def test_k3_shapes(n, k, m):
    """Every K3 shape x M, on normal inputs and on inputs with every third row scaled by 64, each into a
    NaN-poisoned output (every element must be written)."""
    w = _weight(n, k)
    for dist in ("normal", "large_rows"):
        x = _x(m, k, dist, seed=m * 31 + k + n)
        y, cfg = _run(x, w)
        _check(y, x, w, cfg)


@gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("n,k,m", [(20480, 7168, 1), (6288, 7168, 8), (768, 7168, 64), (1152, 1536, 33)])
def test_fp32_out(n, k, m):
    """fp32 y (lm_head, router): within 1e-5 relative of the float64 result, elementwise 2e-5 of |y|max."""
    w = _weight(n, k)
    x = _x(m, k, "normal", seed=5)
    y, cfg = _run(x, w, out_dtype=torch.float32)
    want = _reference(x, w)
    err = (y.double() - want).abs()
    bad = ~(err <= 2e-5 * want.abs().max())
    rel = ((y.double() - want).norm() / want.norm()).item()
    assert not bad.any() and rel < 1e-5, f"rel L2 {rel:.3e}\n" + diagnose(y, want, x, w, cfg, bad)


# (path, warps, rows_per_warp, split_k, stages, M) at K = 2048 (gemv: 16 k-steps, mma: 64): every tiling, split
# and warp count; ring depths of 1, with a tail (steps % stages), filling the K-range (no runtime loop), and up to
# 16 loads in flight; tokens padded in the butterfly (3, 5, 7) and in the MMA's token tiles (1, 9, 13, 33, 40).
VARIANTS = [
    ("gemv", 4, 8, 1, 1, 1), ("gemv", 4, 8, 1, 3, 5), ("gemv", 4, 8, 2, 3, 8), ("gemv", 4, 8, 4, 4, 7),
    ("gemv", 4, 8, 8, 2, 3), ("gemv", 4, 4, 4, 3, 8), ("gemv", 2, 4, 8, 1, 5), ("gemv", 1, 2, 2, 3, 1),
    ("gemv", 1, 2, 1, 5, 4), ("gemv", 2, 16, 8, 2, 2), ("gemv", 4, 16, 1, 1, 8), ("gemv", 8, 8, 4, 2, 4),
    ("mma", 4, 16, 1, 1, 1), ("mma", 4, 16, 2, 5, 8), ("mma", 4, 16, 4, 8, 13), ("mma", 2, 16, 8, 5, 40),
    ("mma", 1, 16, 8, 8, 64), ("mma", 4, 32, 1, 5, 64), ("mma", 4, 32, 4, 3, 33), ("mma", 1, 16, 1, 1, 9),
    ("mma", 2, 16, 2, 8, 16), ("mma", 4, 32, 8, 8, 1), ("mma", 8, 16, 8, 2, 24),
]


@gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("path,warps,rpw,split,stages,m", VARIANTS,
                         ids=[f"{p}-w{w}x{r}-s{s}-st{st}-M{m}" for p, w, r, s, st, m in VARIANTS])
@pytest.mark.parametrize("n", [1000, 37])  # a partial last row tile; fewer rows than most CTAs hold
def test_every_variant_exact(path, warps, rpw, split, stages, m, n):
    """Integer-valued inputs, fp32 out: the result must equal the exact one (any summation order gives it)."""
    k = 2048
    cfg = LinearConfig(path=path, warps=warps, rows_per_warp=rpw, split_k=split, stages=stages, out_dtype="float32")
    x, w = _exact_inputs(m, n, k, seed=split * 100 + m)
    y, cfg = _run(x, w, cfg, out_dtype=torch.float32)
    _check(y, x, w, cfg, exact=True)


@gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("n,k,m", [(6288, 7168, 1), (3216, 7168, 8), (768, 7168, 16), (1152, 1536, 64),
                                   (7168, 4224, 33)])
def test_k3_shapes_exact(n, k, m):
    """The heuristic's configs on integer-valued inputs (fp32 out): exact."""
    x, w = _exact_inputs(m, n, k, seed=n + m)
    y, cfg = _run(x, w, out_dtype=torch.float32)
    _check(y, x, w, cfg, exact=True)


@gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("n,k,m", [(6288, 7168, 4), (768, 7168, 8), (3584, 7168, 16), (1152, 1536, 64)])
def test_deterministic(n, k, m):
    """Four runs bitwise identical (the K split is summed in a fixed order), x and W untouched."""
    w = _weight(n, k)
    x = _x(m, k, "large_rows", seed=1)
    x0, w0 = x.clone(), w.clone()
    ys = [_run(x, w)[0] for _ in range(4)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    assert torch.equal(x, x0) and torch.equal(w, w0)


@gpu
@needs_cuda
@needs_cutlass
@pytest.mark.parametrize("m", [1, 8, 16, 64])
def test_strided_x(m):
    """x as a column slice of a wider tensor (row stride K + 64) gives bitwise the result of a contiguous x."""
    n, k = 2112, 7168
    w = _weight(n, k)
    wide = _x(m, k + 64, "normal", seed=3)
    x = wide[:, 32:k + 32]
    assert x.stride(0) == k + 64 and (m == 1 or not x.is_contiguous())
    y, cfg = _run(x, w)
    _check(y, x, w, cfg)
    assert torch.equal(y, _run(x.contiguous(), w)[0])


@gpu
@needs_cuda
@needs_cutlass
def test_cuda_graph_replay_matches_eager():
    from model.kimi_k3.specialized.linear import linear_cute

    n, k, m = 3584, 7168, 8
    w = _weight(n, k)
    x = _x(m, k, "normal", seed=4)
    eager = linear_cute(x, w)
    static_out = torch.empty_like(eager)
    linear_cute(x, w, out=static_out)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_cute(x, w, out=static_out)
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


@gpu
@needs_cuda
@needs_cutlass
def test_tiny_and_empty():
    """N smaller than a CTA's rows; M = 0 and N = 0 return empty results without a launch."""
    from model.kimi_k3.specialized.linear import linear_cute

    for n, m in ((5, 3), (1, 1), (17, 12)):
        x, w = _exact_inputs(m, n, 256, seed=n)
        y, cfg = _run(x, w, out_dtype=torch.float32)
        _check(y, x, w, cfg, exact=True)
    w = _weight(64, 256)
    assert linear_cute(torch.empty(0, 256, dtype=torch.bfloat16, device="cuda"), w).shape == (0, 64)
    assert linear_cute(_x(2, 256, "normal", 0), w[:0]).shape == (2, 0)
    assert math.isfinite(float(linear_cute(_x(1, 256, "normal", 0), w).float().sum()))
