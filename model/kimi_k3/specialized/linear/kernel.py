"""Decode-batch bf16 projection y[M, N] = x[M, K] @ W[N, K]^T, fp32 accumulation, CuTe DSL, Hopper (sm_90a).

At decode sizes (M <= 64 tokens) every one of K3's projections is bound by reading W once, so the kernel is
built around that stream; x (at most 64 x 7168 bf16, < 1 MB) is read through L1 (and L2) where it stays.

Work decomposition (both paths). A CTA owns `block_rows` consecutive rows of W (= output features) over a
K-range of K / split_k; its warps own disjoint rows and each walks the CTA's whole K-range. With split_k > 1
the split_k CTAs of one row tile form a thread-block cluster (grid x): each sums its K-range, and the partials
meet in distributed shared memory (`st.async` onto a transaction barrier), where CTA q of the cluster adds the
split_k partials of its share of the tile's rows in rank order: a fixed-order, deterministic reduction in one
launch, with no global workspace and no atomics.

Weight stream. Every element of W is read exactly once, by a 16-byte `ld.global.L1::no_allocate`, into a
register ring `stages` k-steps deep; the k-loop is unrolled by `stages`, so every ring index is a compile-time
constant. Rows past N (in the last row tile) re-read row N - 1 and are never stored.

Path A, `gemv` (CUDA cores, M <= 8). Half-warp h of a warp owns P = rows_per_warp / 2 rows; its lane kl reads
elements 8 kl .. 8 kl + 7 of each 128-element k-step of those rows, so a load instruction covers 256
contiguous bytes of each of two rows. x's matching 8 elements of every token come through L1 (the same
addresses for both halves and for every warp of the CTA). Each lane keeps P x M fp32 partial sums; after the
K-range a transposing butterfly sums them over the half-warp's 16 lanes.

Path B, `mma` (tensor cores, M <= 64). Operands swapped: a 16-row tile of W is the A operand of
`mma.sync.m16n8k16` (bf16 in, fp32 accumulators) and 8 tokens of x^T the B operand, so tokens sit on the
MMA's N side (padded to 8 with zeros, never stored). Inside each 32-element k-step K is permuted so that both
operands load as 16-byte vectors straight from global memory: lane (g, t) = (lane / 4, lane % 4) loads
elements 8 t .. 8 t + 7 of the step from W rows g and g + 8 and from token g; the first four are its k-slots of
one MMA's fragments, the last four those of a second MMA. A and B are permuted alike, so the sum over k is
unchanged; no cross-lane reduction is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kernels.cute import dsl_import, import_cutlass, require_dsl

with dsl_import() as DSL:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr

PATHS = ("gemv", "mma")
OUT_DTYPES = ("bfloat16", "float32")
MAX_TOKENS = {"gemv": 8, "mma": 64}
# Elements of K a k-step covers per row: a half-warp of 16 lanes x 8 (gemv), a quad of 4 lanes x 8 (mma).
K_STEP = {"gemv": 128, "mma": 32}
SPLITS = (1, 2, 4, 8)  # CTAs of a cluster that split K: up to the largest portable cluster
SMEM_PER_SM = 228 * 1024
# 16-byte weight loads per thread in flight that `for_shape` aims for: 256 B, so two CTAs of 128 threads keep
# 64 KB per SM in flight, twice what ~4.3 TB/s x ~0.8 us of loaded HBM latency / 132 SMs needs.
TARGET_LOADS_IN_FLIGHT = 16


@dataclass(frozen=True)
class LinearConfig:
    """Everything about the launch that changes the generated code, except M and K (baked in too: see
    LinearKernel). Build with `for_shape`, tune with `dataclasses.replace`."""

    path: str = "gemv"
    warps: int = 4  # warps per CTA
    # gemv: 2 x the rows each half-warp owns (2, 4, 8 or 16); mma: 16 x the row tiles per warp (16 or 32).
    rows_per_warp: int = 8
    split_k: int = 1  # CTAs of one cluster that split K
    stages: int = 4  # k-steps of weight loads in flight per thread
    # Occupancy hint (nvvm.minctasm): ptxas caps registers so this many CTAs fit an SM; 0 = no cap.
    min_ctas_per_sm: int = 0
    out_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path {self.path!r}: one of {PATHS}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype {self.out_dtype!r}: one of {OUT_DTYPES}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps {self.warps}: 1, 2, 4 or 8")
        if self.path == "gemv" and self.rows_per_warp not in (2, 4, 8, 16):
            raise ValueError(f"rows_per_warp {self.rows_per_warp}: gemv needs 2, 4, 8 or 16")
        if self.path == "mma" and self.rows_per_warp not in (16, 32):
            raise ValueError(f"rows_per_warp {self.rows_per_warp}: mma needs 16 or 32 (one or two row tiles)")
        if self.split_k not in SPLITS:
            raise ValueError(f"split_k {self.split_k}: one of {SPLITS}")
        if self.block_rows % self.split_k:
            raise ValueError(f"split_k {self.split_k} must divide the {self.block_rows} rows of a CTA")
        if self.stages < 1:
            raise ValueError(f"stages {self.stages}: must be >= 1")
        if self.min_ctas_per_sm < 0:
            raise ValueError(f"min_ctas_per_sm {self.min_ctas_per_sm}: must be >= 0")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def block_rows(self) -> int:
        """Rows of W (output features) per CTA."""
        return self.warps * self.rows_per_warp

    @property
    def k_step(self) -> int:
        return K_STEP[self.path]

    @property
    def loads_per_step(self) -> int:
        """16-byte weight loads per thread per k-step: the ring's width."""
        return self.rows_per_warp // 2 if self.path == "gemv" else self.rows_per_warp // 8

    def k_steps(self, k: int) -> int:
        """k-steps in one CTA's K-range."""
        return k // self.split_k // self.k_step

    def row_tiles(self, n: int) -> int:
        return -(-n // self.block_rows)

    def ctas(self, n: int) -> int:
        return self.row_tiles(n) * self.split_k

    def smem_bytes(self, m: int) -> int:
        """Dynamic shared memory: the CTA's fp32 partials [M, block_rows]; with split_k > 1 also the receive
        buffer [split_k, M, block_rows / split_k] and its barrier."""
        part = m * self.block_rows * 4
        return part if self.split_k == 1 else 2 * part + 16

    def smem_carveout(self, m: int) -> int:
        """Percent of the SM's unified memory to make shared memory when min_ctas_per_sm is set: enough for
        that many CTAs (the driver rounds up to a supported size); the rest stays L1, which serves x."""
        return min(100, -(-100 * self.min_ctas_per_sm * (self.smem_bytes(m) + 1024) // SMEM_PER_SM))

    def check(self, m: int, k: int) -> None:
        """Raise ValueError unless this config can take M tokens against K inputs."""
        if not 1 <= m <= MAX_TOKENS[self.path]:
            raise ValueError(f"{self.path}: M={m} outside 1..{MAX_TOKENS[self.path]}")
        if k <= 0 or k % (self.k_step * self.split_k):
            raise ValueError(f"K={k} is not a positive multiple of k_step {self.k_step} x split_k {self.split_k}")
        if self.stages > self.k_steps(k):
            raise ValueError(f"stages {self.stages} > the {self.k_steps(k)} k-steps of a CTA (K={k})")
        if self.min_ctas_per_sm * self.smem_bytes(m) > SMEM_PER_SM:
            raise ValueError(f"{self.min_ctas_per_sm} CTAs of {self.smem_bytes(m)} B shared memory exceed an SM")

    @classmethod
    def for_shape(cls, m: int, n: int, k: int, num_sms: int = 132, out_dtype: str = "bfloat16") -> LinearConfig:
        """The config the entry point uses: gemv for M <= 8 (where K is a multiple of 128), mma otherwise.

        Tilings are tried from the most rows per CTA down (x is re-read from L2 once per CTA), and for each the
        fewest K splits (each shortens a CTA's weight stream and adds a cluster exchange) that give at least
        two CTAs per SM (>= 8 streaming warps an SM) spread evenly: the busiest SM holds at most 1 / 0.8 of
        the mean. Where nothing qualifies (few rows), the most CTAs, evenly spread, up to two per SM.
        """
        for path in ("gemv", "mma") if m <= MAX_TOKENS["gemv"] else ("mma",):
            fits = [cls(path=path, warps=warps, rows_per_warp=rows_per_warp, split_k=split, out_dtype=out_dtype)
                    for warps, rows_per_warp in _tilings(path, m) for split in SPLITS
                    if (warps * rows_per_warp) % split == 0 and k % (K_STEP[path] * split) == 0
                    and (split == 1 or k // split // K_STEP[path] >= 2)]  # a split leaves each CTA a pipeline
            if fits:
                break
        else:
            raise ValueError(f"no config for M={m}, N={n}, K={k}: K must be a positive multiple of {K_STEP['mma']}")

        def spread(c: LinearConfig) -> float:
            ctas = c.ctas(n)
            return ctas / (num_sms * -(-ctas // num_sms))

        good = [c for c in fits if c.ctas(n) >= 2 * num_sms and spread(c) >= 0.8]
        cfg = good[0] if good else max(fits, key=lambda c: min(c.ctas(n), 2 * num_sms) * spread(c))
        loads = TARGET_LOADS_IN_FLIGHT
        if cfg.path == "mma" and cfg.rows_per_warp == 32:
            loads = 12  # two row tiles x 8 token tiles = 64 accumulators: a 4th stage takes ptxas from 182 to 255 regs
        stages = max(1, min(loads // cfg.loads_per_step, cfg.k_steps(k)))
        return dataclasses.replace(cfg, stages=stages)


def _tilings(path: str, m: int) -> list:
    """(warps, rows_per_warp) that for_shape tries, the most rows per CTA first."""
    if path == "gemv":
        return [(4, 8), (4, 4), (2, 4)]  # 32, 16 and 8 rows per CTA
    if m > 32:
        return [(4, 32), (4, 16), (2, 16)]  # 128, 64 and 32 rows: x re-read from L2 at most twice per W byte
    return [(4, 16), (2, 16), (1, 16)]  # 64, 32 and 16 rows


def _pow2_at_least(v: int) -> int:
    return 1 << (v - 1).bit_length()


def _select_f32(cond, a, b):
    return Float32(cutlass.select_(cond, a, b))


def _shuffle_xor(v, offset: int):
    return cute.arch.shuffle_sync_bfly(v, offset=offset)


def _half_warp_transpose_sum(vals: list, lane, select=_select_f32, shuffle_xor=_shuffle_xor):
    """Sum each of len(vals) (a power of two) per-lane values over the 16 lanes of the half-warp.

    A transposing butterfly: at offset `off` the lane keeps the half of its values selected by its lane bit
    `off` and adds the partner's copy of that half, so it holds half as many. After T = min(log2 len, 4) such
    steps (offsets 8, 4, ...) a plain butterfly over the remaining offsets finishes the sums. Returns
    (sums, first, writer): lane kl (= lane % 16) holds the sums of values first + i, i < len(sums) = len >> T,
    first = len(sums) * (kl >> (4 - T)); lanes that differ only in their low 4 - T bits hold the same sums, and
    `writer` is true for one of them. `select` and `shuffle_xor` are the DSL's selp and shfl.sync.bfly; the
    tests pass numpy ones to run this code on a CPU model of a warp.
    """
    steps = min(len(vals).bit_length() - 1, 4)
    for off in (8, 4, 2, 1)[:steps]:
        half = len(vals) // 2
        upper = (lane & off) != 0
        kept = []
        for lo, hi in zip(vals[:half], vals[half:]):
            kept.append(select(upper, hi, lo) + shuffle_xor(select(upper, lo, hi), off))
        vals = kept
    for off in (1, 2, 4, 8)[:4 - steps]:
        vals = [v + shuffle_xor(v, off) for v in vals]
    kl = lane % 16
    return vals, len(vals) * (kl >> (4 - steps)), (kl & ((1 << (4 - steps)) - 1)) == 0


def _send_f32(smem_ptr, val, mbar_ptr, peer_rank):
    """st.async of an f32 to the same shared-memory offset in CTA `peer_rank` of the cluster; its arrival
    completes 4 bytes of the transaction count of the peer's barrier at `mbar_ptr`."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    bits = Int32(llvm.bitcast(T.i32(), Float32(val).ir_value()))
    cute.arch.store_async_dsmem(smem_ptr, bits, mbar_ptr, peer_rank)


if DSL.error is None:

    class LinearKernel:
        """y[M, N] = x[M, K] W[N, K]^T for one config, M and K (baked in: they fix the unrolled loops and the
        register arrays); N and x's row stride are runtime arguments."""

        def __init__(self, cfg: LinearConfig, m: int, k: int):
            cfg.check(m, k)
            self.cfg, self.m, self.k = cfg, m, k
            self.out_type = out_type(cfg.out_dtype)

        @cute.jit
        def __call__(self, pX: cute.Pointer, pW: cute.Pointer, pY: cute.Pointer, n: Int32, x_stride: Int32,
                     stream: cuda.CUstream):
            c, M, K = self.cfg, self.m, self.k
            # x's rows start 16-byte aligned: the entry point takes only x_stride % 8 == 0 (elements).
            mX = cute.make_tensor(pX, cute.make_layout((M, K), stride=(cute.assume(x_stride, divby=8), 1)))
            mW = cute.make_tensor(pW, cute.make_layout((n, K), stride=(K, 1)))
            mY = cute.make_tensor(pY, cute.make_layout((M, n), stride=(n, 1)))
            self.kernel(mX, mW, mY, n).launch(
                grid=[c.split_k, (n + c.block_rows - 1) // c.block_rows, 1], block=[c.threads, 1, 1],
                stream=stream, cluster=[c.split_k, 1, 1] if cutlass.const_expr(c.split_k > 1) else None,
                min_blocks_per_mp=c.min_ctas_per_sm,
                preferred_smem_carveout=c.smem_carveout(M) if cutlass.const_expr(c.min_ctas_per_sm > 0) else None)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, n: Int32):
            c, M = self.cfg, self.m
            S, ROWS = c.split_k, c.block_rows
            R = ROWS // S  # rows of the tile each CTA of the cluster finalizes
            tidx, _, _ = cute.arch.thread_idx()
            _, tile, _ = cute.arch.block_idx()
            rank = cute.arch.block_idx_in_cluster() if cutlass.const_expr(S > 1) else 0
            tile_row0 = tile * ROWS
            k_vec0 = rank * (self.k // S // 8)  # first 8-element vector of this CTA's K-range

            smem = cutlass.memory.SmemAllocator()
            sPart = smem.allocate_tensor(Float32, cute.make_layout((M, ROWS), stride=(ROWS, 1)), byte_alignment=16)
            sRecv = mbar = None
            if cutlass.const_expr(S > 1):
                # CTA q finalizes rows [q R, (q + 1) R) of the tile: every CTA of the cluster sends it those rows of
                # its partial, into slot [sender's rank] of q's receive buffer, by st.async; the S x M x R x 4 bytes
                # complete q's barrier.
                sRecv = smem.allocate_tensor(Float32, cute.make_layout((S, M, R), stride=(M * R, R, 1)),
                                             byte_alignment=16)
                mbar = smem.allocate_array(Int64, 1, byte_alignment=8)
                if tidx == 0:
                    cute.arch.mbarrier_init(mbar, 1)
                    cute.arch.mbarrier_init_fence()
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, S * M * R * 4)
                # A peer's shared memory may be written only once that peer has started and initialised its
                # barrier: arrive now, wait before the first send.
                cute.arch.cluster_arrive_relaxed()

            if cutlass.const_expr(c.path == "gemv"):
                self.gemv_partials(mX, mW, sPart, n, tile_row0, k_vec0)
            else:
                self.mma_partials(mX, mW, sPart, n, tile_row0, k_vec0)
            cute.arch.sync_threads()

            if cutlass.const_expr(S == 1):
                self.store_rows(mY, n, tile_row0, sPart, None)
            else:
                cute.arch.cluster_wait()
                for e in cutlass.range(tidx, M * ROWS, c.threads):
                    m, r = e // ROWS, e % ROWS
                    _send_f32(sRecv.iterator + cute.crd2idx((rank, m, r % R), sRecv.layout), sPart[m, r], mbar,
                              r // R)
                while not cute.arch.mbarrier_test_wait(mbar, 0):  # spin: try_wait's suspend hint may wake late
                    pass
                self.store_rows(mY, n, tile_row0 + rank * R, None, sRecv)

        @cute.jit
        def store_rows(self, mY: cute.Tensor, n: Int32, row0: Int32, sPart, sRecv):
            """y[m, row0 + r] = the finished sum of (m, r) for r < rows and row0 + r < N: sPart[m, r] (one CTA per
            tile, rows = block_rows), or sRecv[0, m, r] + ... + sRecv[S - 1, m, r] in rank order (a cluster,
            rows = block_rows / S). Consecutive threads write consecutive rows, contiguous in y."""
            c, M = self.cfg, self.m
            rows = c.block_rows // c.split_k
            tidx, _, _ = cute.arch.thread_idx()
            for e in cutlass.range(tidx, M * rows, c.threads):
                m, r = e // rows, e % rows
                if row0 + r < n:
                    if cutlass.const_expr(sRecv is None):
                        total = sPart[m, r]
                    else:
                        total = sRecv[0, m, r]
                        for s in cutlass.range_constexpr(1, c.split_k):
                            total = total + sRecv[s, m, r]
                    mY[m, row0 + r] = total.to(self.out_type)

        @cute.jit
        def stream_weights(self, mX: cute.Tensor, w_rows: list, k_vec: Int32, acc: cute.Tensor, token: Int32):
            """Accumulate every k-step of the CTA's K-range into acc, in order, with the 16-byte weight loads of
            the next `stages` steps in flight.

            At step s the thread loads w_rows[i][8 (k_vec + s k_step / 8) ..][:8] into ring[:, i, s % stages] for
            every i. Unrolled by `stages`, so every ring index is static: a runtime loop over the first G - 1
            groups of `stages` steps (G = steps // stages), then the last group and the steps % stages left,
            unrolled, issuing only the loads of steps that exist.
            """
            c = self.cfg
            steps, D = c.k_steps(self.k), c.stages
            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            ring = cute.make_rmem_tensor((8, len(w_rows), D), BFloat16)
            for d in cutlass.range_constexpr(D):
                self.issue_loads(load, w_rows, k_vec, ring, d, d)
            groups, tail = steps // D, steps % D
            for g in cutlass.range(groups - 1):
                for d in cutlass.range_constexpr(D):
                    self.compute_step(mX, ring, d, g * D + d, acc, k_vec, token)
                    self.issue_loads(load, w_rows, k_vec, ring, d, g * D + d + D)
            for d in cutlass.range_constexpr(D):
                self.compute_step(mX, ring, d, (groups - 1) * D + d, acc, k_vec, token)
                if cutlass.const_expr(d < tail):
                    self.issue_loads(load, w_rows, k_vec, ring, d, groups * D + d)
            for d in cutlass.range_constexpr(tail):
                self.compute_step(mX, ring, d, groups * D + d, acc, k_vec, token)

        @cute.jit
        def issue_loads(self, load: cute.CopyAtom, w_rows: list, k_vec: Int32, ring: cute.Tensor,
                        slot: cutlass.Constexpr, step):
            """ring[:, i, slot] = w_rows[i][8 (k_vec + step k_step / 8) ..][:8] for every i."""
            for i in cutlass.range_constexpr(len(w_rows)):
                cute.copy(load, cute.local_tile(w_rows[i], (8,), (k_vec + step * (self.cfg.k_step // 8),)),
                          ring[None, i, slot])

        @cute.jit
        def compute_step(self, mX: cute.Tensor, ring: cute.Tensor, slot: cutlass.Constexpr, step, acc: cute.Tensor,
                         k_vec: Int32, token: Int32):
            """acc += this thread's share of k-step `step`, whose weights are in ring[:, :, slot]. The thread's
            elements of the step are those of 8-element vector k_vec + step k_step / 8, of x's row `token` (mma)
            or of each of x's rows (gemv)."""
            x_load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128, invariant=True)
            if cutlass.const_expr(self.cfg.path == "gemv"):
                self.gemv_step(x_load, mX, ring, slot, step, acc, k_vec)
            else:
                self.mma_step(x_load, mX, ring, slot, step, acc, k_vec, token)

        @cute.jit
        def gemv_partials(self, mX: cute.Tensor, mW: cute.Tensor, sPart: cute.Tensor, n: Int32, tile_row0: Int32,
                          k_vec0: Int32):
            """Path A: sPart[m, r] = sum over the CTA's K-range of x[m, k] W[tile_row0 + r, k] (CUDA cores)."""
            c, M = self.cfg, self.m
            P = c.rows_per_warp // 2  # rows per half-warp
            Mp = _pow2_at_least(M)  # tokens padded so that the butterfly halves a power of two of values
            tidx, _, _ = cute.arch.thread_idx()
            lane = cute.arch.lane_idx()
            half, kl = lane // 16, lane % 16
            row0 = (tidx // 32) * c.rows_per_warp + half * P  # the half-warp's first row, in the tile
            w_rows = [mW[cutlass.min(tile_row0 + row0 + p, n - 1), None] for p in range(P)]
            acc = cute.make_rmem_tensor((M, P), Float32)
            acc.fill(0.0)
            self.stream_weights(mX, w_rows, k_vec0 + kl, acc, Int32(0))

            # value v = p Mp + m (zero for the padding tokens m >= M), summed over the half-warp's 16 lanes
            vals = [acc[m, p] if m < M else Float32(0.0) for p in range(P) for m in range(Mp)]
            sums, first, writer = _half_warp_transpose_sum(vals, lane)
            if writer:
                for i in cutlass.range_constexpr(len(sums)):
                    m, p = (first + i) % Mp, (first + i) // Mp
                    if m < M:
                        sPart[m, row0 + p] = sums[i]

        @cute.jit
        def gemv_step(self, x_load: cute.CopyAtom, mX: cute.Tensor, ring: cute.Tensor, slot: cutlass.Constexpr,
                      step, acc: cute.Tensor, k_vec: Int32):
            """acc[m, p] += sum over the lane's 8 elements of W[row p] x[m]: each weight element converted once,
            then one fp32 FMA chain per (token, row)."""
            P = self.cfg.rows_per_warp // 2
            w = [ring[None, p, slot].load().to(Float32) for p in range(P)]
            for m in cutlass.range_constexpr(self.m):
                xv = cute.make_rmem_tensor((8,), BFloat16)
                cute.copy(x_load, cute.local_tile(mX[m, None], (8,), (k_vec + step * 16,)), xv)
                xf = xv.load().to(Float32)
                for p in cutlass.range_constexpr(P):
                    a = acc[m, p]
                    for e in cutlass.range_constexpr(8):
                        a = a + w[p][e] * xf[e]
                    acc[m, p] = a

        @cute.jit
        def mma_partials(self, mX: cute.Tensor, mW: cute.Tensor, sPart: cute.Tensor, n: Int32, tile_row0: Int32,
                         k_vec0: Int32):
            """Path B: sPart[m, r] = sum over the CTA's K-range of x[m, k] W[tile_row0 + r, k] (mma.sync)."""
            c, M = self.cfg, self.m
            RT = c.rows_per_warp // 16  # 16-row tiles per warp (the MMA's M side)
            NT = (M + 7) // 8  # 8-token tiles (the MMA's N side)
            tidx, _, _ = cute.arch.thread_idx()
            lane = cute.arch.lane_idx()
            g, t = lane // 4, lane % 4
            row0 = (tidx // 32) * c.rows_per_warp  # the warp's first row, in the tile
            # ring index i = 2 rt + u holds row 16 rt + 8 u + g of the warp's rows: fragment rows g and g + 8
            w_rows = [mW[cutlass.min(tile_row0 + row0 + 16 * (i // 2) + 8 * (i % 2) + g, n - 1), None]
                      for i in range(2 * RT)]
            acc = cute.make_rmem_tensor((4, 1, 1, RT, NT), Float32)  # (C fragment, MMA m, MMA n, rt, nt)
            acc.fill(0.0)
            self.stream_weights(mX, w_rows, k_vec0 + t, acc, g)

            # C fragment: acc[2 u + j, 0, 0, rt, nt] is (row 16 rt + 8 u + g, token 8 nt + 2 t + j)
            for rt in cutlass.range_constexpr(RT):
                for nt in cutlass.range_constexpr(NT):
                    for u in cutlass.range_constexpr(2):
                        for j in cutlass.range_constexpr(2):
                            token = 8 * nt + 2 * t + j
                            if token < M:
                                sPart[token, row0 + 16 * rt + 8 * u + g] = acc[2 * u + j, 0, 0, rt, nt]

        @cute.jit
        def mma_step(self, x_load: cute.CopyAtom, mX: cute.Tensor, ring: cute.Tensor, slot: cutlass.Constexpr,
                     step, acc: cute.Tensor, k_vec: Int32, g: Int32):
            """Two MMAs per (row tile, token tile): MMA h takes elements 4 h .. 4 h + 3 of the lane's 8 as its
            fragment k-slots 2t, 2t+1, 2t+8, 2t+9, in W's rows and x's token alike (tests check CuTe's fragment
            layout against this)."""
            M, RT = self.m, self.cfg.rows_per_warp // 16
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
            for nt in cutlass.range_constexpr((M + 7) // 8):
                # B source: token 8 nt + g, elements 8 t .. 8 t + 7 of the step; zeros for padding tokens
                xv = cute.make_rmem_tensor((8,), BFloat16)
                token = 8 * nt + g
                x_src = cute.local_tile(mX[token, None], (8,), (k_vec + step * 4,))
                if cutlass.const_expr(8 * nt + 8 <= M):
                    cute.copy(x_load, x_src, xv)
                else:
                    xv.fill(0.0)
                    if token < M:
                        cute.copy(x_load, x_src, xv)
                for h in cutlass.range_constexpr(2):  # elements 4 h .. 4 h + 3 feed MMA h of the step
                    b = cute.make_rmem_tensor((4, 1, 1), BFloat16)  # k-slots (2t, 2t+1), (2t+8, 2t+9)
                    for e in cutlass.range_constexpr(4):
                        b[e] = xv[4 * h + e]
                    for rt in cutlass.range_constexpr(RT):
                        # A fragment: (row g, k-slots 2t..), (row g+8, 2t..), (row g, 2t+8..), (row g+8, 2t+8..)
                        a = cute.make_rmem_tensor((8, 1, 1), BFloat16)
                        for e in cutlass.range_constexpr(2):
                            a[e] = ring[4 * h + e, 2 * rt, slot]
                            a[2 + e] = ring[4 * h + e, 2 * rt + 1, slot]
                            a[4 + e] = ring[4 * h + 2 + e, 2 * rt, slot]
                            a[6 + e] = ring[4 * h + 2 + e, 2 * rt + 1, slot]
                        d = acc[None, None, None, rt, nt]
                        cute.gemm(atom, d, a, b, d)


def out_type(out_dtype: str):
    """The CuTe type of y for a config's out_dtype."""
    return {"bfloat16": BFloat16, "float32": Float32}[out_dtype]


def launch_args(x_ptr: int, w_ptr: int, y_ptr: int, out_dtype: str, n: int, x_stride: int, stream: int):
    """The kernel's arguments for device addresses, N, x's row stride (elements) and a CUDA stream handle.
    y is written with scalar stores, so its pointer is assumed aligned to one element only."""
    gmem = cute.AddressSpace.gmem
    y_type = out_type(out_dtype)
    return (_runtime_make_ptr(BFloat16, x_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(BFloat16, w_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(y_type, y_ptr, gmem, assumed_align=y_type.width // 8),
            Int32(n), Int32(x_stride), cuda.CUstream(stream))


def fake_args(out_dtype: str = "bfloat16"):
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 0, out_dtype, 1, 8, 0)


def compile_kernel(cfg: LinearConfig, m: int, k: int, options: str = ""):
    """cute.compile the kernel for (cfg, M, K), for the arch the DSL targets in this process."""
    require_dsl(DSL.error)
    return cute.compile(LinearKernel(cfg, m, k), *fake_args(cfg.out_dtype), options=options)


def compile_report(cfg: LinearConfig, m: int, k: int, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    return compile_for_arch(LinearKernel(cfg, m, k), *fake_args(cfg.out_dtype), arch=arch,
                            dynamic_smem_bytes=cfg.smem_bytes(m), **kw)
