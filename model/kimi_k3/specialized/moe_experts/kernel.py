"""K3's routed experts at decode batch sizes, MXFP4 weights dequantized in registers, CuTe DSL, Hopper (sm_90a).

    y[t] = sum_k weights[t, k] * bf16(w2_e bf16(SiTU(bf16(w1_e z_t), bf16(w3_e z_t)))),  e = ids[t, k]   (fp32 y)

(reference: model/kimi_k3/ops/moe_experts.py; the bf16 roundings are those of its bf16 matmuls and of `situ`).
Two launches from one `@cute.jit` call, on one stream, no host synchronisation and no data-dependent host logic
(the expert ids are read on the device), so a call can be captured in a CUDA graph.

Launch 1, `up` (gate/up and SiTU). Grid (I / rows_per_cta, T k): CTA (tile, pair) serves one (token, slot) pair,
pair = t k + slot, and `rows_per_cta` rows of its expert's intermediate dim. Each warp owns `up_rows` rows r; half-warp
0 streams row r of w1 (the gate), half-warp 1 row r of w3 (the up projection, row I + r of w13), lane kl of a half
reads 16-byte chunks kl, kl + 16, ... of the row (one chunk = 32 E2M1 codes = one scale group), so a load
instruction of a half-warp covers 256 contiguous bytes. All the warp's chunks are issued before any is used
(7 up_rows loads of 16 bytes in flight per thread at L = 3584). Each lane's fp32 partial is summed over its half by
a butterfly (fixed order), rounded to bf16 as the reference's bf16 matmul does; lane 0 takes b from lane 16,
evaluates SiTU in fp32 in the reference's operation order, rounds to bf16 and stores h[pair, r] (workspace).

Launch 2, `down` (w2 and the slot sum). Grid (L / 8, T): CTA (tile, t) owns 8 rows n of y[t] for all k slots, so
y is summed in one CTA in a fixed order: deterministic, no atomics, no workspace for y. Warp g of the CTA takes
slots [g P, (g + 1) P), P = k / down_warps (4 of 16 by default), in order; a team of TEAM = 4 lanes owns a row n,
lane j of the team reads chunks j, j + 4, ... of row n of w2_e (I / 32 chunks: 3 per lane at I = 384, 2 at 256).
The slots are unrolled and their loads run `down_stages` slots ahead in a register ring, so every ring index is
static (all 4 of a warp's slots at once by default: at batch 1 every byte of w2 the call needs is requested at
once). Per slot: the team's dot products with h[pair] summed by a 2-step butterfly, rounded to bf16 (the
reference's `act @ m2.t()`), times weights[t, slot] in fp32, added to the warp's sum; then thread r < 8 adds the
warps' sums of row r in warp order from shared memory and stores y[t, n].

Dequantization (`e2m1_values`, `scale_factor`: plain Python over primitives, so the tests run the code the kernel
traces on numpy words). A 32-bit word of packed codes holds 8 E2M1 values, element i in nibble i (even index in
the low nibble, bytes little-endian). Code i's sign bit is shifted to bit 31 and its 3 magnitude bits to bits
22..24 of a float (one LOP3 merges the two shifted words): that float is the value x 2^-126 exactly, subnormal
for code 0.5, and one multiply by 2^127 (non-ftz: the PTX has no .ftz) makes 2 x value, a normal float. A group's
32 products with the activations (exact in fp32: bf16 times a 3-bit significand) are summed in fp32, then scaled
once by 2^(byte - 127)
and by 1/2 in one factor, 2^(byte - 128) (the float with exponent field byte - 1; bytes 0, 1 and 255 by selects).
Scaling a group's sum by a power of two is exact, so the result is the reference's sum in another fp32 order.

Tensor-core paths (ExpertsConfig.up_path / down_path = "mma", the default: faster than the CUDA-core paths at
every T and I the H200 timed, NOTES.md). `up_mma` puts 8 w1
rows over the same 8 w3 rows as the 16 rows of mma.sync.m16n8k16 (bf16 in, fp32 accumulators), the pair's token in
all 8 columns, the CTA's warps splitting K and meeting in shared memory in warp order; `down_mma` puts 16 w2 rows
on the MMA's rows with h[pair] as B, a fresh accumulator per slot (rounded to bf16, weighted, summed in slot
order). Lane (g, t) holds chunk 4 u + t of its two rows in k super-step u; k-step s uses word s, turned into 4
bf16x2 pairs (elements (0,4), (1,5), (2,6), (3,7): `e2m1_bf16_pairs`, Marlin's shift / LOP3 trick, value x
2^-126) and multiplied by 2^126 and by the group's `bf16x2_scale` (two mul.rn.bf16x2: exactly
mxfp4.dequantize's bf16); the activations' matching elements are paired alike by PRMT. ~4.4 / 3.7 SASS per weight
(up / down) instead of ~8.

The grids put the pairs (tokens) inner (ExpertsConfig.tokens_first, the default), so the CTAs reading one expert
for several tokens run together and the L2 serves all but the first read. Staging the MMA loops' operands in
shared memory (cp.async) instead of the register ring was measured no faster and removed: the launches are bound by
instruction issue (NOTES.md, sessions 12-14).

Known gaps (NOTES.md): (token, slot) pairs are independent, so an expert chosen by several tokens is requested once
per pair (the L2 absorbs the repeats, see above) and dequantized once per pair; a weight costs ~3.8 instructions on
the mma paths (~6 on the CUDA-core paths), so the launches are bound by instruction issue, not by memory (next:
one multiply a pair, and each expert dequantized once for all its tokens on the MMA's N side).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.cute import dsl_import, import_cutlass, require_dsl
from kernels.mma import mma_m16n8k16

with dsl_import() as DSL:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr
    from cutlass.cutlass_dsl import T as _T

GROUP = 32  # MXFP4 inputs per scale = E2M1 codes per 16-byte chunk
CHUNK_WORDS = 4  # 32-bit words per chunk
HALF = 16  # lanes per row in `up`
TEAM = 4  # lanes per row in `down`
SIGN = 0x80000000
MAG_BITS = 0x01C00000  # fp32 bits 22..24: the two lowest exponent bits and the first mantissa bit
TWO_127 = 2.0**127
MASK32 = 0xFFFFFFFF
MAX_TOKENS = 16
MAX_TOP_K = 32


def e2m1_values(word, ops) -> list:
    """The 8 E2M1 values of a 32-bit word of codes (element i in nibble i), each doubled, as exact fp32 values.

    Code i's sign bit goes to bit 31 and its 3 magnitude bits (exponent e1 e0, mantissa m) to bits 22..24, the
    float's two lowest exponent bits and its first mantissa bit: that float is value x 2^-126 exactly (code 1,
    0.5, lands on the subnormal 2^-127, so the subnormal does the E2M1 subnormal's work); times 2^127 (exact,
    non-ftz) it is 2 x value. Per code: one or two shifts, one 3-input logic op (LOP3), one multiply.

    `ops` supplies shl / shr (logical, 32-bit), and_ / or_ (with 32-bit constants), f32 (the float with these bits)
    and mul (fp32): the kernel passes the DSL's, the tests numpy's."""
    out = []
    for i in range(8):
        signs = word if i == 7 else ops.shl(word, 28 - 4 * i)  # code i's sign at bit 31
        mags = ops.shl(word, 22 - 4 * i) if i <= 5 else ops.shr(word, 4 * i - 22)  # its magnitude at bits 22..24
        bits = ops.or_(ops.and_(signs, SIGN), ops.and_(mags, MAG_BITS))
        out.append(ops.mul(ops.f32(bits), TWO_127))
    return out


def scale_factor(byte, ops):
    """2^(byte - 128) as fp32 from an E8M0 scale byte (a 32-bit integer 0..255): the factor that takes a group's
    sum of doubled values to the sum of its values times 2^(byte - 127), exactly (a power of two). The float whose
    exponent field is byte - 1 for bytes 2..254; the subnormals 2^-128 and 2^-127 for bytes 0 and 1; inf for byte
    255 (E8M0's NaN, which mxfp4.dequantize's fp32 2^128 also makes inf)."""
    normal = ops.f32(ops.shl(ops.isub(byte, 1), 23))
    small = ops.f32(ops.shl(1 << 21, byte))
    out = ops.select(ops.le(byte, 1), small, normal)
    return ops.select(ops.eq(byte, 255), ops.f32(0x7F800000), out)


PAIR_SIGNS = 0x80008000  # the sign bits of both bf16 halves
PAIR_MAGS = 0x01C001C0  # bits 6..8 of both halves: the two lowest exponent bits and the first mantissa bit
BF16X2_2_126 = 0x7E807E80  # 2^126 in both halves
BF16X2_MIN = 0x00400040  # 2^-127 (subnormal) in both halves
SUPER = 4 * GROUP  # elements of a k super-step of the mma path: a quad's 4 chunks (128)


def e2m1_bf16_pairs(word, ops) -> list:
    """The `mma` path's dequantization: a 32-bit word of 8 codes (element i in nibble i) -> 4 bf16x2 words holding
    elements (0, 4), (1, 5), (2, 6), (3, 7), element i in the low half, each value x 2^-126 exactly (code 0.5 is
    the bf16 subnormal 2^-127). Shifting the word left by 4 (3 - j) puts the codes of elements j and j + 4 in the top
    nibbles of the two halves: their signs are already in place, their magnitudes go 6 bits down (Marlin's trick).
    `ops`: shl, shr, and_, or_ (32-bit)."""
    out = []
    for j in range(4):
        w = word if j == 3 else ops.shl(word, 4 * (3 - j))
        out.append(ops.or_(ops.and_(w, PAIR_SIGNS), ops.and_(ops.shr(w, 6), PAIR_MAGS)))
    return out


def bf16x2_scale(byte, ops):
    """2^(byte - 127) in both bf16 halves from an E8M0 byte: the exponent field is the byte (255: inf, as
    mxfp4.dequantize); byte 0 is the subnormal 2^-127. `ops`: shl, or_, eq, select_u32."""
    normal = ops.or_(ops.shl(byte, 7), ops.shl(byte, 23))
    return ops.select_u32(ops.eq(byte, 0), BF16X2_MIN, normal)


@dataclass(frozen=True)
class ExpertsConfig:
    """Everything about the launches that changes the generated code besides the problem's dims (ExpertsKernel)."""

    up_warps: int = 4  # warps per CTA of `up`
    up_rows: int = 2  # intermediate rows per warp of `up` (loads in flight: up_rows x L / 512 per thread)
    down_warps: int = 4  # warps per CTA of `down`, one per group of k / down_warps slots (the CTA's 8 rows each)
    down_stages: int = 4  # slots of w2 loads in flight per thread in `down` (at most its k / down_warps)
    # `up` on tensor cores ("mma": 16 MMA rows = 8 w1 rows over the same 8 w3 rows, tokens on N, the CTA's up_warps
    # warps splitting K; up_rows unused) or on CUDA cores ("fma", v1, up_rows rows a warp)
    up_path: str = "mma"
    # `down` likewise: "mma" = 16 w2 rows a CTA on tensor cores (the CTA's warps still split the slots; its ring of
    # down_stages slots holds 2 I / 128 loads a slot), "fma" = 8 rows a CTA on CUDA cores
    down_path: str = "mma"
    # The grids' order: False, a pair's (token's) tiles are consecutive CTAs; True, a tile's pairs (tokens) are, so
    # the CTAs that read one expert's tile for different tokens are resident together and every read after the
    # first is served by the L2: DRAM then carries each distinct expert's bytes about once, as the standard's
    # grouped GEMM does, with no grouping pass (the gate's routing repeats a quarter of each later token's experts)
    tokens_first: bool = False
    # "up": launch `up` alone (y is left unwritten), so that probe.py can time the two launches apart
    stop_after: str = "down"

    def __post_init__(self):
        if self.up_path not in ("fma", "mma") or self.down_path not in ("fma", "mma"):
            raise ValueError(f"up_path {self.up_path!r}, down_path {self.down_path!r}: 'fma' or 'mma'")
        if self.stop_after not in ("up", "down"):
            raise ValueError(f"stop_after {self.stop_after!r}: 'up' or 'down'")
        if self.up_warps not in (1, 2, 4, 8) or self.down_warps not in (1, 2, 4, 8):
            raise ValueError(f"warps {self.up_warps}, {self.down_warps}: 1, 2, 4 or 8")
        if self.up_rows not in (1, 2, 4):
            raise ValueError(f"up_rows {self.up_rows}: 1, 2 or 4")
        if not 1 <= self.down_stages <= 8:
            raise ValueError(f"down_stages {self.down_stages}: 1..8")

    @property
    def up_rows_per_cta(self) -> int:
        return 8 if self.up_path == "mma" else self.up_warps * self.up_rows

    @property
    def down_rows_per_cta(self) -> int:
        return 16 if self.down_path == "mma" else 32 // TEAM

    def smem_bytes(self, latent: int, inter: int, top_k: int) -> int:
        """Shared memory a CTA of the larger launch allocates: the warps' partial sums."""
        up = self.up_warps * 16 * 4 if self.up_path == "mma" else 0
        return max(up, self.down_warps * self.down_rows_per_cta * 4)

    def check(self, latent: int, inter: int, top_k: int) -> None:
        """ValueError where the dims do not fit this config's tiling."""
        if latent <= 0 or latent % (HALF * GROUP):
            raise ValueError(f"latent dim {latent}: a positive multiple of {HALF * GROUP}")
        if latent % self.down_rows_per_cta:
            raise ValueError(f"latent dim {latent}: a multiple of {self.down_rows_per_cta} rows per `down` CTA")
        if self.up_path == "mma" and latent % (SUPER * self.up_warps):
            raise ValueError(f"latent dim {latent}: the mma path needs a multiple of {SUPER * self.up_warps}")
        if inter <= 0 or inter % (TEAM * GROUP) or inter % self.up_rows_per_cta or \
                (self.down_path == "mma" and inter % SUPER):
            raise ValueError(f"intermediate dim {inter}: a positive multiple of {TEAM * GROUP} and of "
                             f"{self.up_rows_per_cta} rows per `up` CTA")
        if not 1 <= top_k <= MAX_TOP_K or top_k % self.down_warps:
            raise ValueError(f"top_k {top_k}: 1..{MAX_TOP_K} and a multiple of the {self.down_warps} slot groups")

    @staticmethod
    def for_shape(tokens: int, inter: int, num_sms: int = 132) -> ExpertsConfig:
        """The heuristic, the same at every T <= 16: both tensor-core paths (1.3-1.6x the CUDA-core pair on the
        H200, NOTES.md); `up` with 4 warps splitting K over 8 rows a CTA (48 / 32 tiles a pair at I = 384 / 256, so
        >= 512 CTAs from one token of 16 slots); `down` with 8 slot groups of 2 slots, both in flight (2-8 % faster
        than 4 groups of 4 at T = 1-16 in session 14's probe: twice the warps to hide a slot's DRAM round trip);
        the grids' tokens inner (`tokens_first`: 1-2 % faster at T = 8-16 in session 13's probe)."""
        return ExpertsConfig(up_warps=4, up_rows=2, down_warps=8, down_stages=2, tokens_first=True)


if DSL.error is None:

    def _f32(bits):
        return Float32(llvm.bitcast(_T.f32(), Uint32(bits).ir_value()))

    class _DslOps:
        """e2m1_values' and scale_factor's primitives in the DSL, on Uint32."""

        @staticmethod
        def shl(v, n):
            return Uint32(v) << Uint32(n)

        @staticmethod
        def shr(v, n):
            return Uint32(v) >> Uint32(n)

        @staticmethod
        def and_(v, m):
            return Uint32(v) & Uint32(m)

        @staticmethod
        def or_(v, m):
            return Uint32(v) | Uint32(m)

        f32 = staticmethod(_f32)

        @staticmethod
        def mul(a, c):
            return a * Float32(c)

        @staticmethod
        def select(cond, a, b):
            return Float32(cutlass.select_(cond, a, b))

        @staticmethod
        def isub(v, n):
            return Uint32(v) - Uint32(n)

        @staticmethod
        def le(v, n):
            return Uint32(v) <= Uint32(n)

        @staticmethod
        def eq(v, n):
            return Uint32(v) == Uint32(n)

        @staticmethod
        def select_u32(cond, a, b):
            return Uint32(cutlass.select_(cond, Uint32(a), Uint32(b)))

    def _asm_u32(text: str, *args):
        return Uint32(llvm.inline_asm(_T.i32(), [Uint32(a).ir_value() for a in args], text,
                                      "=r" + ",r" * len(args), has_side_effects=False, is_align_stack=False,
                                      asm_dialect=llvm.AsmDialect.AD_ATT))

    def _mul_bf16x2(a, b):
        """mul.rn.bf16x2 (sm_90): both halves, round to nearest even, subnormals kept."""
        return _asm_u32("mul.rn.bf16x2 $0, $1, $2;", a, b)

    def _prmt(a, b, sel: int):
        return _asm_u32(f"prmt.b32 $0, $1, $2, {sel:#x};", a, b)

    class ExpertsKernel:
        """Both launches for one config and the problem's dims (E experts, L latent, I intermediate, k slots)
        baked in; the token count T is a runtime argument (the grids)."""

        def __init__(self, cfg: ExpertsConfig, experts: int, latent: int, inter: int, top_k: int):
            cfg.check(latent, inter, top_k)
            self.cfg, self.e, self.l, self.i, self.k = cfg, experts, latent, inter, top_k

        @cute.jit
        def __call__(self, pZ: cute.Pointer, pIds: cute.Pointer, pWeights: cute.Pointer, pW13: cute.Pointer,
                     pS13: cute.Pointer, pW2: cute.Pointer, pS2: cute.Pointer, pH: cute.Pointer, pY: cute.Pointer,
                     tokens: Int32, beta: Float32, beta_lin: Float32, stream: cuda.CUstream):
            c, E, L, In, k = self.cfg, self.e, self.l, self.i, self.k
            mZ = cute.make_tensor(pZ, cute.make_layout((tokens, L), stride=(L, 1)))
            mIds = cute.make_tensor(pIds, cute.make_layout((tokens, k), stride=(k, 1)))
            mWeights = cute.make_tensor(pWeights, cute.make_layout((tokens, k), stride=(k, 1)))
            # packed codes as 32-bit words (8 codes each), scales as bytes
            mW13 = cute.make_tensor(pW13, cute.make_layout((E, 2 * In, L // 8), stride=(2 * In * L // 8, L // 8, 1)))
            mS13 = cute.make_tensor(pS13, cute.make_layout((E, 2 * In, L // GROUP),
                                                           stride=(2 * In * L // GROUP, L // GROUP, 1)))
            mW2 = cute.make_tensor(pW2, cute.make_layout((E, L, In // 8), stride=(L * In // 8, In // 8, 1)))
            mS2 = cute.make_tensor(pS2, cute.make_layout((E, L, In // GROUP), stride=(L * In // GROUP, In // GROUP, 1)))
            mH = cute.make_tensor(pH, cute.make_layout((tokens * k, In), stride=(In, 1)))
            mY = cute.make_tensor(pY, cute.make_layout((tokens, L), stride=(L, 1)))
            if cutlass.const_expr(c.up_path == "mma"):  # z as 32-bit words (bf16 pairs) for the mma path
                mZ = cute.make_tensor(cute.recast_ptr(pZ, dtype=Uint32),
                                      cute.make_layout((tokens, L // 2), stride=(L // 2, 1)))
            up = self.up_mma if cutlass.const_expr(c.up_path == "mma") else self.up
            up(mZ, mIds, mW13, mS13, mH, beta, beta_lin).launch(
                grid=self.grid(In // c.up_rows_per_cta, tokens * k), block=[32 * c.up_warps, 1, 1], stream=stream)
            if cutlass.const_expr(c.stop_after == "down"):
                down = self.down
                if cutlass.const_expr(c.down_path == "mma"):  # h as 32-bit words (bf16 pairs) for the mma path
                    mH = cute.make_tensor(cute.recast_ptr(pH, dtype=Uint32),
                                          cute.make_layout((tokens * k, In // 2), stride=(In // 2, 1)))
                    down = self.down_mma
                down(mIds, mWeights, mW2, mS2, mH, mY).launch(
                    grid=self.grid(L // c.down_rows_per_cta, tokens), block=[32 * c.down_warps, 1, 1], stream=stream)

        # --- shared pieces -----------------------------------------------------------------------------------

        def grid(self, tiles, items) -> list:
            """A launch's grid over (tile, pair or token), in the config's order (ExpertsConfig.tokens_first)."""
            return [items, tiles, 1] if self.cfg.tokens_first else [tiles, items, 1]

        @cute.jit
        def tile_and_item(self):
            """This CTA's (tile, pair or token): the inverse of `grid`."""
            x, y, _ = cute.arch.block_idx()
            tile, item = x, y
            if cutlass.const_expr(self.cfg.tokens_first):
                tile, item = y, x
            return tile, item

        @cute.jit
        def expert_of(self, mIds: cute.Tensor, token: Int32, slot):
            """ids[token, slot] as Int32, clamped into [0, E) so that a bad id cannot read outside the weights."""
            e = Int32(mIds[token, slot])
            return cutlass.min(cutlass.max(e, Int32(0)), Int32(self.e - 1))

        @cute.jit
        def chunk_dots(self, chunks: list, mAct: cute.Tensor, row: Int32, elem0: Int32) -> list:
            """For each chunk of 4 code words (32 codes) in `chunks`, all over the same 32 activations: the sum over
            its codes of (2 x E2M1 value) x act[row, elem0 + i], fp32, unscaled. Each activation vector is loaded
            once and used by every chunk while it is live."""
            act_load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
            ops = _DslOps()
            totals = [Float32(0.0) for _ in chunks]
            for q in cutlass.range_constexpr(CHUNK_WORDS):
                av = cute.make_rmem_tensor((8,), BFloat16)
                cute.copy(act_load, cute.local_tile(mAct[row, None], (8,), (elem0 // 8 + q,)), av)
                af = av.load().to(Float32)
                for r in cutlass.range_constexpr(len(chunks)):
                    vals = e2m1_values(chunks[r][q], ops)
                    t = totals[r]
                    for i in cutlass.range_constexpr(8):
                        t = t + af[i] * vals[i]
                    totals[r] = t
            return totals

        # --- launch 1: gate / up and SiTU -------------------------------------------------------------------

        @cute.kernel
        def up(self, mZ: cute.Tensor, mIds: cute.Tensor, mW13: cute.Tensor, mS13: cute.Tensor, mH: cute.Tensor,
               beta: Float32, beta_lin: Float32):
            c, L, In, k = self.cfg, self.l, self.i, self.k
            R, J = c.up_rows, L // (HALF * GROUP)  # rows per warp, chunks per lane of a row
            tidx, _, _ = cute.arch.thread_idx()
            tile, pair = self.tile_and_item()
            lane = cute.arch.lane_idx()
            half, kl = lane // HALF, lane % HALF
            token, slot = pair // k, pair % k
            e = self.expert_of(mIds, token, slot)
            row0 = tile * c.up_rows_per_cta + (tidx // 32) * R
            ops = _DslOps()
            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            ring = cute.make_rmem_tensor((CHUNK_WORDS, J, R), Uint32)
            for r in cutlass.range_constexpr(R):
                wrow = mW13[e, half * In + row0 + r, None]
                for j in cutlass.range_constexpr(J):
                    cute.copy(load, cute.local_tile(wrow, (CHUNK_WORDS,), (kl + HALF * j,)), ring[None, j, r])
            accs = [Float32(0.0) for _ in range(R)]
            for j in cutlass.range_constexpr(J):  # chunk-major: z's chunk is loaded once for the warp's R rows
                chunk = kl + HALF * j
                dots = self.chunk_dots([ring[None, j, r] for r in range(R)], mZ, token, chunk * GROUP)
                for r in cutlass.range_constexpr(R):
                    factor = scale_factor(Uint32(mS13[e, half * In + row0 + r, chunk]), ops)
                    accs[r] = accs[r] + dots[r] * factor
            for r in cutlass.range_constexpr(R):
                acc = accs[r]
                for off in (8, 4, 2, 1):  # the half-warp's sum; the xor never crosses halves
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
                ab = acc.to(BFloat16).to(Float32)  # a on lane 0, b on lane 16
                b = cute.arch.shuffle_sync(ab, 16)
                if lane == 0:
                    mH[pair, row0 + r] = situ(ab, b, beta, beta_lin).to(BFloat16)

        @cute.kernel
        def up_mma(self, mZ: cute.Tensor, mIds: cute.Tensor, mW13: cute.Tensor, mS13: cute.Tensor, mH: cute.Tensor,
                   beta: Float32, beta_lin: Float32):
            """`up` on tensor cores. CTA (tile, pair): 8 rows r0..r0+7 of I; MMA row g is w1 row r0 + g, row g + 8 is
            w3 row r0 + g, so lane (g, t)'s C fragment holds a (c0) and b (c2) of row r0 + g. Warp w takes k
            super-steps [w S, (w + 1) S) of 128 elements, S = L / 128 / warps; in super-step u, lane (g, t) loads
            chunk 4 u + t (16 bytes, one scale group) of both rows, all S super-steps' loads issued first. k-step s of
            the super-step uses word s of each lane's chunk: its 4 bf16x2 pairs (elements (0,4), (1,5), (2,6),
            (3,7)) x 2^126 x 2^(scale - 127) (exact: two mul.rn.bf16x2) are MMA 1's a0..a3 (pairs (0,4), (1,5)) and
            MMA 2's (pairs (2,6), (3,7)); z's elements 128 u + 32 t + 8 s .. + 7, paired alike by PRMT, are B in
            every column (all 8 columns are the pair's token; column 0 is read). The warps' column-0 sums meet in
            shared memory and thread r < 8 adds them in warp order, rounds a and b to bf16, applies SiTU."""
            c, L, In, k = self.cfg, self.l, self.i, self.k
            W = c.up_warps
            S = L // SUPER // W  # super-steps per warp
            tidx, _, _ = cute.arch.thread_idx()
            tile, pair = self.tile_and_item()
            lane = cute.arch.lane_idx()
            warp = tidx // 32
            g, t = lane // 4, lane % 4
            token, slot = pair // k, pair % k
            e = self.expert_of(mIds, token, slot)
            r0 = tile * 8
            rows = (r0 + g, In + r0 + g)  # MMA rows g (w1) and g + 8 (w3)
            ops = _DslOps()
            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            z_load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128, invariant=True)
            smem = cutlass.memory.SmemAllocator()
            sPart = smem.allocate_tensor(Float32, cute.make_layout((W, 16), stride=(16, 1)), byte_alignment=16)
            chunk0 = warp * S * 4 + t  # chunk of super-step 0 of this warp, for this lane
            ring = cute.make_rmem_tensor((CHUNK_WORDS, 2, S), Uint32)
            for u in cutlass.range_constexpr(S):
                for h in cutlass.range_constexpr(2):
                    cute.copy(load, cute.local_tile(mW13[e, rows[h], None], (CHUNK_WORDS,), (chunk0 + 4 * u,)),
                              ring[None, h, u])
            zrow = mZ[token, None]  # z as 32-bit words: elements 2 i, 2 i + 1 in word i
            two126 = Uint32(BF16X2_2_126)
            acc = [Float32(0.0) for _ in range(4)]
            for u in cutlass.range_constexpr(S):
                chunk = chunk0 + 4 * u
                scales = [bf16x2_scale(Uint32(mS13[e, rows[h], chunk]), ops) for h in range(2)]
                for s_ in cutlass.range_constexpr(CHUNK_WORDS):
                    zv = cute.make_rmem_tensor((4,), Uint32)  # z elements 32 chunk + 8 s_ .. + 7, as 4 pairs
                    cute.copy(z_load, cute.local_tile(zrow, (4,), (chunk * 4 + s_,)), zv)
                    zp = [_prmt(zv[0], zv[2], 0x5410), _prmt(zv[0], zv[2], 0x7632),
                          _prmt(zv[1], zv[3], 0x5410), _prmt(zv[1], zv[3], 0x7632)]  # (0,4), (1,5), (2,6), (3,7)
                    wp = []
                    for h in cutlass.range_constexpr(2):
                        pairs = e2m1_bf16_pairs(ring[s_, h, u], ops)
                        wp.append([_mul_bf16x2(_mul_bf16x2(p, two126), scales[h]) for p in pairs])
                    # MMA 1: pairs (0,4), (1,5); MMA 2: pairs (2,6), (3,7)
                    for m in cutlass.range_constexpr(2):
                        acc = mma_m16n8k16([wp[0][2 * m], wp[1][2 * m], wp[0][2 * m + 1], wp[1][2 * m + 1]],
                                           [zp[2 * m], zp[2 * m + 1]], acc)
            if t == 0:
                sPart[warp, g] = acc[0]  # column 0: row g (w1) and row g + 8 (w3)
                sPart[warp, 8 + g] = acc[2]
            cute.arch.sync_threads()
            if tidx < 8:  # the warps' K ranges in warp order: deterministic
                a = sPart[0, tidx]
                b = sPart[0, 8 + tidx]
                for w in cutlass.range_constexpr(1, W):
                    a = a + sPart[w, tidx]
                    b = b + sPart[w, 8 + tidx]
                a = a.to(BFloat16).to(Float32)
                b = b.to(BFloat16).to(Float32)
                mH[pair, r0 + tidx] = situ(a, b, beta, beta_lin).to(BFloat16)

        # --- launch 2: w2 and the sum over slots ----------------------------------------------------------------

        @cute.kernel
        def down(self, mIds: cute.Tensor, mWeights: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mH: cute.Tensor,
                 mY: cute.Tensor):
            c, In, k = self.cfg, self.i, self.k
            G = c.down_warps  # slot groups, one warp each
            P = k // G  # slots per group
            J, D = In // (TEAM * GROUP), min(c.down_stages, P)  # chunks per lane, slots in flight
            ROWS = c.down_rows_per_cta
            tidx, _, _ = cute.arch.thread_idx()
            tile, token = self.tile_and_item()
            lane = cute.arch.lane_idx()
            warp = tidx // 32
            tl, r = lane % TEAM, lane // TEAM
            n = tile * ROWS + r
            ops = _DslOps()
            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            smem = cutlass.memory.SmemAllocator()
            sPart = smem.allocate_tensor(Float32, cute.make_layout((G, ROWS), stride=(ROWS, 1)), byte_alignment=16)
            slots = [warp * P + m for m in range(P)]  # the warp's slots, in order
            experts = [self.expert_of(mIds, token, slots[m]) for m in range(P)]
            ring = cute.make_rmem_tensor((CHUNK_WORDS, J, D), Uint32)
            for m in cutlass.range_constexpr(D):
                self.load_w2(load, mW2, experts[m], n, tl, ring, m % D)
            y = Float32(0.0)
            for m in cutlass.range_constexpr(P):
                acc = Float32(0.0)
                for j in cutlass.range_constexpr(J):
                    chunk = tl + TEAM * j
                    factor = scale_factor(Uint32(mS2[experts[m], n, chunk]), ops)
                    acc = acc + self.chunk_dots([ring[None, j, m % D]], mH, token * k + slots[m],
                                                chunk * GROUP)[0] * factor
                if cutlass.const_expr(m + D < P):
                    self.load_w2(load, mW2, experts[m + D], n, tl, ring, m % D)
                for off in (2, 1):  # the team's sum
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
                h2 = acc.to(BFloat16).to(Float32)  # the reference's bf16 `act @ m2.t()`
                y = y + mWeights[token, slots[m]] * h2
            if tl == 0:
                sPart[warp, r] = y
            cute.arch.sync_threads()
            if tidx < ROWS:  # the groups' sums in group order: deterministic
                total = sPart[0, tidx]
                for g in cutlass.range_constexpr(1, G):
                    total = total + sPart[g, tidx]
                mY[token, tile * ROWS + tidx] = total

        @cute.kernel
        def down_mma(self, mIds: cute.Tensor, mWeights: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor,
                     mH: cute.Tensor, mY: cute.Tensor):
            """`down` on tensor cores. CTA (tile, t): 16 rows n0 + g, n0 + g + 8 of y[t]; warp w takes slots
            [w P, (w + 1) P) in order. Per slot, up_mma's k mapping over K = I (super-step u: lane (g, t) holds chunk
            4 u + t of both rows; k-step s: word s, pairs (0,4)..(3,7) x 2^126 x scale as A, h's matching elements
            paired by PRMT as B in all 8 columns), a fresh fp32 accumulator; then every lane holds rows g, g + 8 of
            w2_e h (columns are copies): rounded to bf16, times the slot's weight, added to the lane's y in slot
            order. The warps' sums meet in shared memory; thread r < 16 adds them in warp order and stores."""
            c, In, k = self.cfg, self.i, self.k
            G = c.down_warps
            P = k // G
            SI = In // SUPER  # super-steps of a w2 row
            D = min(c.down_stages, P)
            tidx, _, _ = cute.arch.thread_idx()
            tile, token = self.tile_and_item()
            lane = cute.arch.lane_idx()
            warp = tidx // 32
            g, t = lane // 4, lane % 4
            n0 = tile * 16
            rows = (n0 + g, n0 + g + 8)
            ops = _DslOps()
            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            h_load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128, invariant=True)
            smem = cutlass.memory.SmemAllocator()
            sPart = smem.allocate_tensor(Float32, cute.make_layout((G, 16), stride=(16, 1)), byte_alignment=16)
            slots = [warp * P + m for m in range(P)]
            experts = [self.expert_of(mIds, token, slots[m]) for m in range(P)]
            ring = cute.make_rmem_tensor((CHUNK_WORDS, 2, SI, D), Uint32)
            for m in cutlass.range_constexpr(D):
                self.load_w2_mma(load, mW2, experts[m], rows, t, ring, m % D)
            two126 = Uint32(BF16X2_2_126)
            y = [Float32(0.0), Float32(0.0)]  # rows g, g + 8
            for m in cutlass.range_constexpr(P):
                hrow = mH[token * k + slots[m], None]
                acc = [Float32(0.0) for _ in range(4)]
                for u in cutlass.range_constexpr(SI):
                    chunk = 4 * u + t
                    scales = [bf16x2_scale(Uint32(mS2[experts[m], rows[h], chunk]), ops) for h in range(2)]
                    for s_ in cutlass.range_constexpr(CHUNK_WORDS):
                        hv = cute.make_rmem_tensor((4,), Uint32)
                        cute.copy(h_load, cute.local_tile(hrow, (4,), (chunk * 4 + s_,)), hv)
                        hp = [_prmt(hv[0], hv[2], 0x5410), _prmt(hv[0], hv[2], 0x7632),
                              _prmt(hv[1], hv[3], 0x5410), _prmt(hv[1], hv[3], 0x7632)]
                        wp = []
                        for h in cutlass.range_constexpr(2):
                            pairs = e2m1_bf16_pairs(ring[s_, h, u, m % D], ops)
                            wp.append([_mul_bf16x2(_mul_bf16x2(p, two126), scales[h]) for p in pairs])
                        for q in cutlass.range_constexpr(2):
                            acc = mma_m16n8k16([wp[0][2 * q], wp[1][2 * q], wp[0][2 * q + 1], wp[1][2 * q + 1]],
                                               [hp[2 * q], hp[2 * q + 1]], acc)
                if cutlass.const_expr(m + D < P):
                    self.load_w2_mma(load, mW2, experts[m + D], rows, t, ring, m % D)
                weight = mWeights[token, slots[m]]
                y[0] = y[0] + weight * acc[0].to(BFloat16).to(Float32)  # the reference's bf16 `act @ m2.t()`
                y[1] = y[1] + weight * acc[2].to(BFloat16).to(Float32)
            if t == 0:
                sPart[warp, g] = y[0]
                sPart[warp, 8 + g] = y[1]
            cute.arch.sync_threads()
            if tidx < 16:  # the slot groups' sums in group order: deterministic
                total = sPart[0, tidx]
                for w in cutlass.range_constexpr(1, G):
                    total = total + sPart[w, tidx]
                mY[token, n0 + tidx] = total

        @cute.jit
        def load_w2_mma(self, load: cute.CopyAtom, mW2: cute.Tensor, e: Int32, rows: tuple, t: Int32,
                        ring: cute.Tensor, slot: cutlass.Constexpr):
            """ring[:, h, u, slot] = chunk 4 u + t of row rows[h] of w2_e, for every super-step u."""
            for h in cutlass.range_constexpr(2):
                wrow = mW2[e, rows[h], None]
                for u in cutlass.range_constexpr(self.i // SUPER):
                    cute.copy(load, cute.local_tile(wrow, (CHUNK_WORDS,), (4 * u + t,)), ring[None, h, u, slot])

        @cute.jit
        def load_w2(self, load: cute.CopyAtom, mW2: cute.Tensor, e: Int32, n: Int32, tl: Int32, ring: cute.Tensor,
                    slot: cutlass.Constexpr):
            J = self.i // (TEAM * GROUP)
            wrow = mW2[e, n, None]
            for j in cutlass.range_constexpr(J):
                cute.copy(load, cute.local_tile(wrow, (CHUNK_WORDS,), (tl + TEAM * j,)), ring[None, j, slot])

    @cute.jit
    def situ(a: Float32, b: Float32, beta: Float32, beta_lin: Float32) -> Float32:
        """The reference's SiTU in fp32, its operation order: beta tanh(a / beta) sigmoid(a) (beta_lin tanh(b /
        beta_lin))."""
        sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-a))
        return beta * cute.math.tanh(a / beta) * sig * (beta_lin * cute.math.tanh(b / beta_lin))


def launch_args(z_ptr: int, ids_ptr: int, weights_ptr: int, w13_ptr: int, s13_ptr: int, w2_ptr: int, s2_ptr: int,
                h_ptr: int, y_ptr: int, tokens: int, beta: float, beta_lin: float, stream: int):
    """The kernel's arguments for device addresses, the token count, SiTU's betas and a CUDA stream handle."""
    gmem = cute.AddressSpace.gmem
    return (_runtime_make_ptr(BFloat16, z_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Int64, ids_ptr, gmem, assumed_align=8),
            _runtime_make_ptr(Float32, weights_ptr, gmem, assumed_align=4),
            _runtime_make_ptr(Uint32, w13_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Uint8, s13_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Uint32, w2_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Uint8, s2_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(BFloat16, h_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Float32, y_ptr, gmem, assumed_align=4),
            Int32(tokens), Float32(beta), Float32(beta_lin), cuda.CUstream(stream))


def fake_args():
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 4.0, 25.0, 0)


def compile_kernel(cfg: ExpertsConfig, experts: int, latent: int, inter: int, top_k: int, options: str = ""):
    """cute.compile both launches for a config and dims, for the arch the DSL targets in this process."""
    require_dsl(DSL.error)
    return cute.compile(ExpertsKernel(cfg, experts, latent, inter, top_k), *fake_args(), options=options)


def compile_report(cfg: ExpertsConfig, experts: int, latent: int, inter: int, top_k: int, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    return compile_for_arch(ExpertsKernel(cfg, experts, latent, inter, top_k), *fake_args(), arch=arch,
                            dynamic_smem_bytes=cfg.smem_bytes(latent, inter, top_k), **kw)
