"""moe_experts' CuTe DSL kernel (model/kimi_k3/specialized/moe_experts/).

CPU: the in-register dequantization (`e2m1_values`, `scale_factor`: the code the kernel traces) run on numpy words
against mxfp4.dequantize bit for bit, over every code byte and every scale byte, and over packed matrices read as
the kernel reads them (32-bit little-endian words); a numpy/torch model of the two launches' math (group sums
scaled once, the bf16 roundings, SiTU, the slot sum in slot order) against the reference; the argument checks; the
config heuristic; the compile for sm_90a without a GPU, no spills, and the PTX's load mix.
GPU (skipped without one): the kernel against the reference at T = 1..16 on random MXFP4 experts (E = 32, both
intermediate dims) and one K3-shaped case (E = 896), determinism, T = 0, CUDA-graph replay; then the gate problem's
inputs at the contract's benchmark points where the problem exists.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from gates.problems import ProblemError, bench_point, load_problem
from kernels.contract import load_contract
from kernels.cute import cutlass_available, ptx_instruction_counts
from kernels.trees import clone, leaves
from model.kimi_k3 import mxfp4
from model.kimi_k3.ops.moe_experts import moe_experts
from model.kimi_k3.ops.registry import import_entry_point, registry_problems
from model.kimi_k3.ops.situ_mlp import situ
from model.kimi_k3.specialized.moe_experts import INTERMEDIATE, check_args, compile_keys, config_for
from model.kimi_k3.specialized.moe_experts.kernel import (
    BF16X2_2_126,
    CHUNK_WORDS,
    SUPER,
    ExpertsConfig,
    bf16x2_scale,
    e2m1_bf16_pairs,
    e2m1_values,
    scale_factor,
)

CONTRACT_FILE = Path(__file__).resolve().parents[2] / "contracts" / "moe_experts.yaml"
CONTRACT = load_contract(CONTRACT_FILE)
E, L, K = 896, 3584, 16
BETA, BETA_LIN = 4.0, 25.0
DEVICE = "cuda"


def point_id(point) -> str:
    return "-".join([f"batch{point.batch}", f"spec{point.spec_tokens}", *(f"{k}{v}" for k, v in point.shape.items())])


def test_contract_names_this_kernel():
    assert CONTRACT.implementation == "model.kimi_k3.specialized.moe_experts:moe_experts_cute"
    assert registry_problems(CONTRACT, str(CONTRACT_FILE), imports=False) == []
    assert [h.arch for h in CONTRACT.hardware.validated] == ["sm_90"] and not CONTRACT.hardware.declared


# --- the dequantization on numpy words -------------------------------------------------------------------------

class NumpyOps:
    """e2m1_values' and scale_factor's primitives over np.uint32 / np.float32 arrays."""

    @staticmethod
    def shl(v, n):
        return np.left_shift(np.asarray(v, np.uint32), np.asarray(n, np.uint32))

    @staticmethod
    def shr(v, n):
        return np.right_shift(np.asarray(v, np.uint32), np.asarray(n, np.uint32))

    @staticmethod
    def and_(v, m):
        return np.bitwise_and(np.asarray(v, np.uint32), np.uint32(m))

    @staticmethod
    def or_(v, m):
        return np.bitwise_or(np.asarray(v, np.uint32), np.asarray(m, np.uint32))

    @staticmethod
    def f32(bits):
        return np.asarray(bits, np.uint32).view(np.float32)

    @staticmethod
    def mul(a, c):
        return (a * np.float32(c)).astype(np.float32)

    @staticmethod
    def select(cond, a, b):
        return np.where(cond, a, b).astype(np.float32)

    @staticmethod
    def isub(v, n):
        return np.asarray(v, np.uint32) - np.uint32(n)

    @staticmethod
    def le(v, n):
        return np.asarray(v, np.uint32) <= n

    @staticmethod
    def eq(v, n):
        return np.asarray(v, np.uint32) == n

    @staticmethod
    def select_u32(cond, a, b):
        return np.where(cond, np.uint32(a), np.asarray(b, np.uint32)).astype(np.uint32)


def kernel_dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(packed uint8 [N, K/2], scale uint8 [N, K/32]) -> fp32 [N, K] by the kernel's functions, its words read as
    the kernel reads them (little-endian 32-bit words, 4 per 32-code group): value = doubled value x 2^(byte - 128)."""
    n, half_k = packed.shape
    words = np.ascontiguousarray(packed).view("<u4")  # [N, K/8]
    vals = np.stack(e2m1_values(words, NumpyOps()), axis=-1).reshape(n, 2 * half_k)  # element 8 w + i
    factor = scale_factor(scale.astype(np.uint32), NumpyOps())  # [N, K/32]
    with np.errstate(invalid="ignore", over="ignore"):
        return (vals * np.repeat(factor, 32, axis=1)).astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (signed zeros included), every NaN equal to every NaN."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def test_e2m1_every_byte_and_scale_bit_for_bit():
    """All 256 code bytes (two codes each) under every one of the 256 scale bytes."""
    codes = np.arange(256, dtype=np.uint8)
    packed = np.tile(codes, (256, 1))  # [256 scales, 256 bytes = 512 codes = 16 groups]
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    want = mxfp4.dequantize(torch.from_numpy(packed), torch.from_numpy(scale), torch.float32).numpy()
    assert same_bits(kernel_dequantize(packed, scale), want)


def test_e2m1_values_doubled_exactly():
    """The doubled magnitudes of the 8 codes, then the sign bit (word with nibble i = code i, then 8 + i)."""
    for word, sign in ((0x76543210, 1.0), (0xFEDCBA98, -1.0)):
        got = np.array(e2m1_values(np.uint32(word), NumpyOps()), np.float32)
        assert np.array_equal(got, sign * 2 * np.array(mxfp4.E2M1_VALUES, np.float32))
    assert np.signbit(e2m1_values(np.uint32(0x8), NumpyOps())[0])  # -0 keeps its sign


@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_quantized_matrices(seed):
    """Packed matrices from mxfp4.quantize, read as 32-bit words, against mxfp4.dequantize."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(96, 512, generator=g) * torch.exp2(torch.randint(-12, 4, (96, 1), generator=g).float()))
    packed, scale = mxfp4.quantize(w.to(torch.bfloat16))
    want = mxfp4.dequantize(packed, scale, torch.float32).numpy()
    assert same_bits(kernel_dequantize(packed.numpy(), scale.numpy()), want)


# --- the mma path's dequantization to bf16 pairs -------------------------------------------------------------

def bf16x2_to_f32(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low halves, high halves) of bf16x2 words as fp32."""
    w = np.asarray(words, np.uint32)
    return (w << np.uint32(16)).view(np.float32), (w & np.uint32(0xFFFF0000)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 (nearest even; NaN kept quiet) as 16-bit patterns in uint32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), (bits >> 16) | 0x40, rounded).astype(np.uint32)


def mul_bf16x2(a: np.ndarray, b) -> np.ndarray:
    """mul.rn.bf16x2 in numpy: each half's exact fp32 product (bf16 x bf16 fits fp32's significand), rounded."""
    (alo, ahi), (blo, bhi) = bf16x2_to_f32(a), bf16x2_to_f32(np.broadcast_to(np.asarray(b, np.uint32), a.shape))
    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = (alo.astype(np.float64) * blo).astype(np.float32), (ahi.astype(np.float64) * bhi).astype(np.float32)
    return f32_to_bf16_bits(lo) | (f32_to_bf16_bits(hi) << np.uint32(16))


def mma_dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """bf16 bits [N, K] by the mma path's functions: pairs x 2^126 x 2^(byte - 127), two rounded multiplies."""
    n, half_k = packed.shape
    words = np.ascontiguousarray(packed).view("<u4")  # [N, K/8]
    factor = np.repeat(bf16x2_scale(scale.astype(np.uint32), NumpyOps()), 4, axis=1)  # per word
    out = np.zeros((n, half_k // 4, 8), np.uint32)
    for j, p in enumerate(e2m1_bf16_pairs(words, NumpyOps())):  # elements (j, j + 4)
        v = mul_bf16x2(mul_bf16x2(p, BF16X2_2_126), factor)
        out[:, :, j], out[:, :, j + 4] = v & np.uint32(0xFFFF), v >> np.uint32(16)
    return out.reshape(n, 2 * half_k)


def test_bf16_pairs_every_byte_and_scale_bit_for_bit():
    """The mma path's bf16 weights equal mxfp4.dequantize(..., bf16) bit for bit: all 256 code bytes under all 256
    scale bytes (NaN: any NaN)."""
    codes = np.arange(256, dtype=np.uint8)
    packed = np.tile(codes, (256, 1))
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    want = mxfp4.dequantize(torch.from_numpy(packed), torch.from_numpy(scale), torch.bfloat16)
    want_bits = want.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    got = mma_dequantize(packed, scale)
    nan = torch.isnan(want).numpy()
    assert np.array_equal(nan, ((got & 0x7F80) == 0x7F80) & ((got & 0x7F) != 0))
    assert np.array_equal(got[~nan], want_bits[~nan])


def prmt(a, b, sel: int) -> np.uint32:
    """prmt.b32 with the selectors up_mma uses: 0x5410 (low halves of a, b), 0x7632 (high halves)."""
    a, b = int(a), int(b)
    if sel == 0x5410:
        return np.uint32((a & 0xFFFF) | ((b & 0xFFFF) << 16))
    assert sel == 0x7632
    return np.uint32((a >> 16) | ((b >> 16) << 16))


@pytest.mark.parametrize("warps", [1, 2])
def test_mma_fragment_mapping_on_a_numpy_warp(warps):
    """up_mma's data movement, transcribed lane by lane (its load offsets, pairings and MMA operand order) onto
    PTX's m16n8k16 fragment layout, computes 16 rows' dot products with the activation: checks that A's and B's k
    orders agree. warps = 1 is down_mma's mapping too (one warp over all of K: chunk 4 u + t; rows g, g + 8)."""
    rng = np.random.default_rng(warps)
    latent = 512
    w13 = rng.standard_normal((16, latent)).astype(np.float32)  # 8 w1 rows over 8 w3 rows
    packed, scale = (t.numpy() for t in mxfp4.quantize(torch.from_numpy(w13).to(torch.bfloat16)))
    z = torch.randn(latent).to(torch.bfloat16)
    zw = z.view(torch.int32).numpy().view(np.uint32)  # bf16 pairs, element 2 i in the low half
    words = packed.view("<u4")  # [16, latent / 8]
    S = latent // SUPER // warps
    acc = np.zeros((warps, 16))
    for warp in range(warps):
        d = np.zeros((16, 8))  # this warp's D
        for u in range(S):
            for s_ in range(CHUNK_WORDS):
                # per lane (g, t): A and B registers as the kernel builds them
                a_regs = np.zeros((2, 32, 4), np.uint32)
                b_regs = np.zeros((2, 32, 2), np.uint32)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    chunk = warp * S * 4 + t + 4 * u
                    zv = zw[chunk * 16 + 4 * s_: chunk * 16 + 4 * s_ + 4]
                    zp = [prmt(zv[0], zv[2], 0x5410), prmt(zv[0], zv[2], 0x7632),
                          prmt(zv[1], zv[3], 0x5410), prmt(zv[1], zv[3], 0x7632)]
                    wp = []
                    for h, row in enumerate((g, 8 + g)):
                        pairs = e2m1_bf16_pairs(np.uint32(words[row, chunk * 4 + s_]), NumpyOps())
                        sc = bf16x2_scale(np.uint32(scale[row, chunk]), NumpyOps())
                        wp.append([mul_bf16x2(mul_bf16x2(np.array([p], np.uint32), BF16X2_2_126), sc)[0]
                                   for p in pairs])
                    for m in range(2):
                        a_regs[m, lane] = [wp[0][2 * m], wp[1][2 * m], wp[0][2 * m + 1], wp[1][2 * m + 1]]
                        b_regs[m, lane] = [zp[2 * m], zp[2 * m + 1]]
                for m in range(2):  # D += A B by PTX's fragment layout
                    A, B = np.zeros((16, 16)), np.zeros((16, 8))
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        a_slots = ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))
                        for reg, (row, k0) in enumerate(a_slots):
                            lo, hi = bf16x2_to_f32(a_regs[m, lane, reg])
                            A[row, k0], A[row, k0 + 1] = lo, hi
                        for reg, k0 in enumerate((2 * t, 2 * t + 8)):
                            lo, hi = bf16x2_to_f32(b_regs[m, lane, reg])
                            B[k0, g], B[k0 + 1, g] = lo, hi
                    d += A @ B
        assert np.allclose(d, d[:, :1])  # every column is the token
        acc[warp] = d[:, 0]
    want = mxfp4.dequantize(torch.from_numpy(packed), torch.from_numpy(scale)).double() @ z.double()
    assert np.allclose(acc.sum(0), want.numpy(), rtol=1e-9, atol=1e-9)


# --- the two launches' math, modelled in torch ----------------------------------------------------------------

def random_experts(e: int, latent: int, inter: int, seed: int = 0, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, latent, generator=g) / latent**0.5
    w2 = torch.randn(e, latent, inter, generator=g) / inter**0.5
    q13 = mxfp4.quantize(w13.reshape(-1, latent).to(torch.bfloat16))
    q2 = mxfp4.quantize(w2.reshape(-1, inter).to(torch.bfloat16))
    w13q = tuple(t.reshape(e, 2 * inter, -1).to(device) for t in q13)
    w2q = tuple(t.reshape(e, latent, -1).to(device) for t in q2)
    return w13q, w2q


def random_routing(t: int, e: int, k: int, latent: int, seed: int = 0, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(t, latent, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    weights = torch.rand(t, k, generator=g) / k
    return z.to(device), ids.to(device), weights.to(device)


def model_of_kernel(z, ids, weights, w13, w2, beta, beta_lin):
    """The kernel's math in torch: per row, the 32-code groups' sums of z x (2 value) in fp32, each times
    2^(scale - 128), summed, rounded to bf16 (a, b and w2 h), SiTU in fp32 to bf16, the slots summed in
    slot order with the routing weights in fp32."""
    t, latent = z.shape
    k = ids.shape[1]

    def rows_dot(packed, scale, act):  # packed [N, C/2], act [C] -> [N]
        vals = torch.from_numpy(kernel_dequantize(packed.numpy(), np.full_like(scale.numpy(), 128)))  # 2 value
        groups = (vals * act.float()).reshape(packed.shape[0], -1, 32).sum(-1)
        factor = torch.from_numpy(scale_factor(scale.numpy().astype(np.uint32), NumpyOps()))
        return (groups * factor).sum(-1).to(torch.bfloat16)

    y = torch.zeros(t, latent, dtype=torch.float32)
    for tok in range(t):
        for s in range(k):
            e = int(ids[tok, s])
            ab = rows_dot(w13[0][e], w13[1][e], z[tok])
            a, b = ab.chunk(2)
            h = situ(a, b, beta, beta_lin)
            h2 = rows_dot(w2[0][e], w2[1][e], h)
            y[tok] = y[tok] + weights[tok, s] * h2.float()
    return y


def check_close(got: torch.Tensor, ref: torch.Tensor, tol=None):
    tol = tol or CONTRACT.tolerance
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.isfinite(got).all()
    close = (got - ref).abs() <= tol.atol + tol.rtol * ref.abs()
    assert close.float().mean().item() >= tol.min_close_fraction, f"close fraction {close.float().mean().item()}"
    rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel <= tol.max_rel_l2, f"rel L2 {rel}"


@pytest.mark.parametrize("inter", [128, 256])
def test_model_of_kernel_matches_reference(inter):
    """The structure the kernel implements (where it scales, rounds and sums) reproduces the reference."""
    e, latent, t, k = 8, 512, 3, 4
    w13, w2 = random_experts(e, latent, inter, seed=inter)
    z, ids, weights = random_routing(t, e, k, latent, seed=inter)
    check_close(model_of_kernel(z, ids, weights, w13, w2, BETA, BETA_LIN),
                moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN))


# --- argument checks and the config ---------------------------------------------------------------------------

def cpu_args(t=2, e=4, latent=512, inter=128, k=4):
    w13 = (torch.zeros(e, 2 * inter, latent // 2, dtype=torch.uint8),
           torch.zeros(e, 2 * inter, latent // 32, dtype=torch.uint8))
    w2 = (torch.zeros(e, latent, inter // 2, dtype=torch.uint8), torch.zeros(e, latent, inter // 32, dtype=torch.uint8))
    z = torch.zeros(t, latent, dtype=torch.bfloat16)
    return z, torch.zeros(t, k, dtype=torch.int64), torch.zeros(t, k, dtype=torch.float32), w13, w2


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


REFUSALS = {
    "z dtype": (lambda a: _replace(a, 0, a[0].float()), "z must be bf16"),
    "ids dtype": (lambda a: _replace(a, 1, a[1].int()), "ids int64"),
    "weights dtype": (lambda a: _replace(a, 2, a[2].double()), "weights fp32"),
    "dense experts": (lambda a: _replace(a, 3, (a[3][0],)), "MXFP4 (packed, scale) pairs"),
    "scale dtype": (lambda a: _replace(a, 4, (a[4][0], a[4][1].float())), "must be uint8"),
    "z rank": (lambda a: _replace(a, 0, a[0][None]), "z must be [T, L]"),
    "weights shape": (lambda a: _replace(a, 2, a[2][:, :2]), "must both be [T="),
    "too many tokens": (lambda a: cpu_args(t=17), "T=17 tokens: at most 16"),
    "top_k": (lambda a: cpu_args(k=33, e=40), "top_k=33"),
    "w2 shape": (lambda a: _replace(a, 4, (a[4][0][:, :, :32], a[4][1])), "w2 packed must be"),
    "w13 scale shape": (lambda a: _replace(a, 3, (a[3][0], a[3][1][:, :, :8])), "w13 scale must be"),
    "latent tiling": (lambda a: cpu_args(latent=768), "latent dim 768"),
    "inter tiling": (lambda a: cpu_args(inter=96), "intermediate dim 96"),
    "contiguity": (lambda a: _replace(a, 0, torch.zeros(512, 2, dtype=torch.bfloat16).t()), "contiguous"),
    "cpu tensors": (lambda a: a, "CUDA tensors on one device"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_check_args_refuses(case):
    build, message = REFUSALS[case]
    with pytest.raises(ValueError, match=None) as err:
        check_args(*build(cpu_args()))
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_config_heuristic_and_tiling():
    for t in range(1, 17):
        cfg = config_for(t, 384)
        assert (cfg.up_path, cfg.down_path) == ("mma", "mma")  # the faster pair at every timed T (NOTES.md)
        assert cfg.down_warps == 8 and cfg.up_rows_per_cta == 8 and cfg.down_rows_per_cta == 16
        for inter in INTERMEDIATE.values():
            cfg.check(L, inter, K)
    with pytest.raises(ValueError, match="up_rows"):
        ExpertsConfig(up_rows=3)
    with pytest.raises(ValueError, match="slot groups"):
        ExpertsConfig(down_warps=8).check(L, 384, 12)
    with pytest.raises(ValueError, match="intermediate dim 192"):
        ExpertsConfig().check(L, 192, K)  # TP16's 192 must come zero-padded to 256


def test_compile_keys_cover_both_tp_sizes():
    keys = compile_keys(CONTRACT)
    assert {key[3] for key in keys} == {384, 256}
    assert len(keys) == 2  # one config at every T: one key per intermediate dim
    assert all(key[1:3] == (E, L) and key[4] == K for key in keys)


# --- compiling for sm_90a without a GPU -----------------------------------------------------------------------

_REPORTS: dict = {}


def _report(cfg, inter):
    from model.kimi_k3.specialized.moe_experts.kernel import compile_report

    if (cfg, inter) not in _REPORTS:
        _REPORTS[cfg, inter] = compile_report(cfg, E, L, inter, K, arch="sm_90a")
    return _REPORTS[cfg, inter]


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
@pytest.mark.parametrize("inter", [384, 256])
@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
def test_fma_paths_compile_for_sm90a_without_spills(tokens, inter):
    cfg = dataclasses.replace(config_for(tokens, inter), up_path="fma", down_path="fma")
    report = _report(cfg, inter)
    names = {k.name.split("_")[2]: k for k in report.kernels}
    assert set(names) == {"up", "down"}, [k.name for k in report.kernels]
    for kind, k in names.items():
        print(f"T={tokens} I={inter} {kind}: {k.registers} registers, {k.spill_bytes} B spills, "
              f"{k.stack_frame_bytes} B stack")
        assert k.spill_bytes == 0 and k.stack_frame_bytes == 0
        assert k.registers <= 128
    counts = ptx_instruction_counts(report.ptx, {
        "weights": r"\bld\.global\.L1::no_allocate\.v4\.b32\b", "activations": r"\bld\.global\.nc\.v4\.b32\b",
        "local": r"\b(?:ld|st)\.local\b", "atomics": r"\batom\.", "shared": r"\bld\.shared\.b32\b",
        # the dequantization's exactness needs subnormals kept: no flush-to-zero on fp32 multiplies and FMAs
        "ftz": r"\b(?:mul|fma)(?:\.rn)?\.ftz\.f32\b", "fmul": r"\bmul(?:\.rn)?\.f32\b"})
    up_chunks = cfg.up_rows * L // 512
    down_chunks = (K // cfg.down_warps) * inter // 128  # a thread's slots x its chunks of a w2 row
    assert counts["weights"] == up_chunks + down_chunks
    assert counts["activations"] == 4 * (L // 512 + down_chunks)  # z once per chunk for the warp's rows; h per chunk
    assert counts["local"] == 0 and counts["atomics"] == 0
    assert counts["shared"] == cfg.down_warps  # the slot groups' sums, added in group order
    assert counts["ftz"] == 0 and counts["fmul"] >= 8 * (up_chunks + down_chunks) * CHUNK_WORDS


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
@pytest.mark.parametrize("inter", [384, 256])
def test_mma_paths_compile_for_sm90a_without_spills(inter):
    cfg = config_for(1, inter)  # the default pair
    report = _report(cfg, inter)
    names = {k.name.split("_")[2]: k for k in report.kernels}
    assert set(names) == {"up", "down"}, [k.name for k in report.kernels]  # kernel_cutlass_up_mma_...
    for kind, k in names.items():
        print(f"mma path I={inter} {kind}: {k.registers} registers, {k.spill_bytes} B spills")
        assert k.spill_bytes == 0 and k.stack_frame_bytes == 0 and k.registers <= 128
    steps = L // SUPER // cfg.up_warps  # super-steps per warp
    counts = ptx_instruction_counts(report.ptx, {
        "mma": r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b",
        "hmul2": r"\bmul\.rn\.bf16x2\b", "prmt": r"\bprmt\.b32\b",
        "weights": r"\bld\.global\.L1::no_allocate\.v4\.b32\b", "local": r"\b(?:ld|st)\.local\b"})
    down_steps = (K // cfg.down_warps) * (inter // SUPER)  # a warp's slots x super-steps of a w2 row
    assert counts["mma"] == (steps + down_steps) * CHUNK_WORDS * 2
    assert counts["hmul2"] == (steps + down_steps) * CHUNK_WORDS * 2 * 4 * 2  # 2 rows x 4 pairs x (2^126, scale)
    assert counts["prmt"] == (steps + down_steps) * CHUNK_WORDS * 4
    assert counts["weights"] == 2 * steps + 2 * down_steps
    assert counts["local"] == 0


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
@pytest.mark.parametrize("inter", [384, 256])
def test_tokens_first_swaps_the_grids_and_nothing_else(inter):
    """`tokens_first`: the same two kernels (the same loads and MMAs; no spills and at most 80 registers, the
    default's occupancy of 6 CTAs an SM or better) with the block index's x and y read the other way round."""
    default = config_for(1, inter)
    plain, swapped = (_report(dataclasses.replace(default, tokens_first=f), inter) for f in (False, True))
    for a, b in zip(plain.kernels, swapped.kernels, strict=True):
        assert a.spill_bytes == b.spill_bytes == 0 and b.registers <= 80, (a, b)
    patterns = {"mma": r"\bmma\.sync\b", "weights": r"\bld\.global\.L1::no_allocate\.v4\.b32\b"}
    assert ptx_instruction_counts(plain.ptx, patterns) == ptx_instruction_counts(swapped.ptx, patterns)
    assert plain.ptx != swapped.ptx


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
def test_the_probes_first_launch_alone_compiles_without_the_second():
    """probe.py's time split: stop_after="up" launches `up` only."""
    report = _report(dataclasses.replace(config_for(1, 384), stop_after="up"), 384)
    assert [k.name.split("_")[2] for k in report.kernels] == ["up"]
    with pytest.raises(ValueError, match="stop_after"):
        ExpertsConfig(stop_after="gemv")


# --- GPU ------------------------------------------------------------------------------------------------------

@functools.cache
def gpu_experts(e, inter, seed=0):
    """Random MXFP4 experts on the GPU: quantized random bf16 for small E; random codes and scales for E = 896
    (valid MXFP4; quantizing 2 GB of bf16 would dominate the test)."""
    if e <= 64:
        return random_experts(e, L, inter, seed, DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def pair(rows, cols):
        packed = torch.randint(0, 256, (e, rows, cols // 2), generator=g, device=DEVICE, dtype=torch.uint8)
        scale = torch.randint(117, 121, (e, rows, cols // 32), generator=g, device=DEVICE, dtype=torch.uint8)
        return packed, scale

    return pair(2 * inter, L), pair(L, inter)


PATHS = [("fma", "fma"), ("mma", "fma"), ("fma", "mma"), ("mma", "mma")]  # (up_path, down_path)


@pytest.mark.gpu
@pytest.mark.parametrize("paths", PATHS, ids=lambda p: f"up_{p[0]}-down_{p[1]}")
@pytest.mark.parametrize("inter", [384, 256])
@pytest.mark.parametrize("tokens", list(range(1, 17)))
def test_matches_reference_small_e(tokens, inter, paths):
    from model.kimi_k3.specialized.moe_experts import moe_experts_cute

    w13, w2 = gpu_experts(32, inter, seed=inter)
    z, ids, weights = random_routing(tokens, 32, K, L, seed=tokens, device=DEVICE)
    cfg = dataclasses.replace(config_for(tokens, inter), up_path=paths[0], down_path=paths[1])
    got = moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN, config=cfg)
    check_close(got, moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN))
    assert torch.equal(got, moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN, config=cfg))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [384, 256])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_tiles_first_matches_the_default_bitwise(tokens, inter):
    """`tokens_first` changes only the order the CTAs run in, never what a thread sums: y with the tiles outer is
    the default config's, bit for bit (and within the tolerance of the reference)."""
    from model.kimi_k3.specialized.moe_experts import moe_experts_cute

    w13, w2 = gpu_experts(32, inter, seed=inter)
    z, ids, weights = random_routing(tokens, 32, K, L, seed=tokens, device=DEVICE)
    default = config_for(tokens, inter)
    got = moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN,
                           config=dataclasses.replace(default, tokens_first=not default.tokens_first))
    check_close(got, moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN))
    assert torch.equal(got, moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN, config=default))


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [384, 256])
def test_paths_agree(inter):
    """All four path combinations sum exact products in fp32 (in other orders): their y agree far inside the
    tolerance."""
    from model.kimi_k3.specialized.moe_experts import moe_experts_cute

    w13, w2 = gpu_experts(32, inter, seed=inter)
    z, ids, weights = random_routing(4, 32, K, L, seed=11, device=DEVICE)
    ys = [moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN,
                           config=dataclasses.replace(config_for(4, inter), up_path=up, down_path=down))
          for up, down in PATHS]
    for y in ys[1:]:
        check_close(y, ys[0], CONTRACT.tolerance.model_copy(update={"atol": 1e-3, "rtol": 1e-3, "max_rel_l2": 1e-3}))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_matches_reference_k3_shape(tokens):
    from model.kimi_k3.specialized.moe_experts import moe_experts_cute

    w13, w2 = gpu_experts(E, 384)
    z, ids, weights = random_routing(tokens, E, K, L, seed=7, device=DEVICE)
    check_close(moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN),
                moe_experts(z, ids, weights, w13, w2, BETA, BETA_LIN))


@pytest.mark.gpu
def test_zero_tokens_and_graph_replay():
    from model.kimi_k3.specialized.moe_experts import moe_experts_cute, prepare

    w13, w2 = gpu_experts(32, 384, seed=384)  # the cached set of test_matches_reference_small_e
    z, ids, weights = random_routing(0, 32, K, L, device=DEVICE)
    assert moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN).shape == (0, L)
    z, ids, weights = random_routing(4, 32, K, L, seed=3, device=DEVICE)
    prepare(4, 32, L, 384, K)
    want = moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN)
    ids.copy_(torch.roll(ids, 1, dims=0))  # new routing, same buffers: the graph reads ids on the device
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_experts_cute(z, ids, weights, w13, w2, BETA, BETA_LIN))
    assert not torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("point", CONTRACT.benchmark.points, ids=point_id)
def test_matches_reference(point, dist):
    try:
        problem = load_problem("moe_experts")
    except ProblemError as e:
        pytest.skip(f"the gate has no problem for moe_experts yet: {e}")
    case = problem.generate_input(bench_point(CONTRACT, problem, point), 0, dist)
    kernel = import_entry_point(CONTRACT.implementation)
    got_args, ref_args = clone(case.args, DEVICE), clone(case.args, DEVICE)
    got, ref = kernel(*got_args), problem.reference(*ref_args)
    pairs = list(zip(leaves(got, "out"), leaves(ref, "out"), strict=True))
    for (name, g), (_, r) in pairs:
        result = problem.check(name, g, r, CONTRACT.tolerance)
        assert result.passed, result.problems
