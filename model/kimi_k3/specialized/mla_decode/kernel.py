"""MLA decode attention over the latent cache, the core after weight absorption, CuTe DSL, Hopper (sm_90a).

    latent[b, h] = softmax_t(scale * query[b, h] . kv[slot_b, t]) over t < length_b, times kv[slot_b, t, :C]

query [B, H, W] fp32 (W = C + R: [q_nope W_UK | q_pe], computed by the entry point), kv [slots, L, W] bf16, slots
and lengths [B] int64 read on the device, latent [B, H, C] fp32. The absorptions (q_nope W_UK, latent W_UV^T) stay in
torch in the entry point (v1). Two launches from one `@cute.jit` call, one stream, no host synchronisation and no
data-dependent host logic (the split count depends on B and L only), so a call can be captured in a CUDA graph.

Launch 1, `partial` (flash-decoding). Grid (splits, B), `threads` threads (8 warps). CTA (s, b) owns the rows
[s chunk, min((s + 1) chunk, length_b)) of sequence b's slot (possibly none: an empty split). It keeps the H queries
in shared memory (fp32, H W 4 bytes) and walks its rows in tiles of T = 32 rows:
  1. load: every thread issues (T W / 8) / threads 16-byte loads of the tile (rows past the split's end are clamped
     to its last valid row, so no padding byte is ever read; their probabilities are 0), then stores them to shared
     memory (bf16, T W 2 bytes).
  2. scores: warp w owns rows w T / 8 .. + T / 8; lane l the bf16 pairs l + 32 j (j < W / 64) of each; per head,
     fp32 FMAs over the lane's pairs (element order 2p, 2p + 1, j ascending), a 5-step butterfly, times `scale`;
     -inf past the split's end. Stored to sP[h, t].
  3. online softmax: warp w owns heads w, w + 8; lane t the tile's row t: m' = max(m, max_t s) (butterfly), alpha =
     exp(m - m') (0 on the first tile, m = -inf), p_t = exp(s_t - m'), l' = l alpha + sum_t p_t (butterfly). sP
     becomes p, the state (m, l, alpha) lives in shared memory.
  4. accumulate: thread i owns latent columns 2 i, 2 i + 1 (C = 2 threads) of every head, in registers (2 H fp32):
     acc = acc alpha + sum_t p_t kv[t, c], t ascending.
Then (normalized partial, log-sum-exp): o = acc / l, lse = m + log(l); an empty split writes o = 0, lse = -inf (no
0 / 0, no exp(-inf - -inf)): the conventions of model/kimi_k3/ops/mla_dcp.py's `partial_attention`.

Launch 2, `merge`. Grid (H, B), C / 4 threads, thread i owns columns 4 i .. 4 i + 3: top = max_s lse_s (0 if every
split is empty), w_s = exp(lse_s - top), latent = sum_s w_s o_s / sum_s w_s (divisor 1 if the sum is 0), splits in
ascending order: mla_dcp.merge's arithmetic. Deterministic (no atomics; fixed orders everywhere).

Known gaps of v1 (NOTES.md): one tile in flight per CTA (load, sync, compute, sync: the next tile is not prefetched);
scores on CUDA cores with a butterfly per (row, head). The slot's base address is 64-bit, offsets inside a slot
32-bit (check_args refuses L x W >= 2^31).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels.cute import import_cutlass

try:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr

    _IMPORT_ERROR = None
except Exception as _e:  # cutlass not installed or broken: the module stays importable
    cutlass = cute = None
    _IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

TILE = 32  # rows per tile = lanes per warp (the softmax step maps row t to lane t)
VEC = 8  # bf16 per 16-byte load
MAX_HEADS = 16
MERGE_COLS = 4  # latent columns per thread of `merge`


@dataclass(frozen=True)
class MlaConfig:
    """Everything about the launches that changes the generated code besides the problem's dims (MlaDecodeKernel),
    and the split heuristic's knobs (which change only runtime arguments)."""

    threads: int = 256  # threads per `partial` CTA (8 warps)
    ctas_per_sm: int = 2  # the split heuristic aims at ctas_per_sm x SMs CTAs
    min_split_rows: int = 128  # ... but gives no split fewer rows than this (the partials' own traffic)
    score_rows: int = 2  # rows whose elements a lane holds at once in the score step (registers: 18 per row)

    def __post_init__(self):
        if self.score_rows not in (1, 2, 4):
            raise ValueError(f"score_rows {self.score_rows}: 1, 2 or 4")
        if self.threads not in (128, 256, 512):
            raise ValueError(f"threads {self.threads}: 128, 256 or 512")
        if self.ctas_per_sm < 1 or self.min_split_rows < TILE or self.min_split_rows % TILE:
            raise ValueError(f"ctas_per_sm {self.ctas_per_sm} >= 1, min_split_rows {self.min_split_rows}: a positive "
                             f"multiple of {TILE}")

    @property
    def warps(self) -> int:
        return self.threads // 32

    def check(self, heads: int, latent: int, rope: int) -> None:
        """ValueError where the dims do not fit this config's mapping."""
        width = latent + rope
        if not 1 <= heads <= MAX_HEADS or heads > 2 * self.warps:
            raise ValueError(f"heads {heads}: 1..{min(MAX_HEADS, 2 * self.warps)}")
        if latent != 2 * self.threads:
            raise ValueError(f"latent dim {latent}: 2 columns a thread, {2 * self.threads} at {self.threads} threads")
        if latent % (MERGE_COLS * 32):
            raise ValueError(f"latent dim {latent}: a multiple of {MERGE_COLS * 32}")
        if rope < 0 or width % 64:
            raise ValueError(f"latent + rope = {width}: a multiple of 64 (bf16 pairs over 32 lanes)")
        if (TILE * width // VEC) % self.threads:
            raise ValueError(f"a tile's {TILE * width // VEC} 16-byte loads do not divide over {self.threads} threads")
        if TILE % self.warps or (TILE // self.warps) % min(self.score_rows, TILE // self.warps):
            raise ValueError(f"{TILE} rows a tile over {self.warps} warps, {self.score_rows} at a time")

    def smem_bytes(self, heads: int, latent: int, rope: int) -> int:
        """sQ (fp32) + sRow (bf16) + sP (fp32) + the softmax state (3 x 16 fp32), as allocated, with alignment."""
        width = latent + rope
        return heads * width * 4 + TILE * width * 2 + MAX_HEADS * TILE * 4 + 3 * MAX_HEADS * 4 + 4 * 128


def split_plan(batch: int, max_len: int, num_sms: int = 132, cfg: MlaConfig = MlaConfig()) -> tuple[int, int]:
    """(splits, chunk): each sequence's rows are cut into `splits` chunks of `chunk` rows (a multiple of TILE), the
    last possibly shorter; chunk x splits >= max_len and every split starts below max_len. Aims at ctas_per_sm x
    num_sms CTAs over the batch, with no chunk under min_split_rows. Depends only on the host values B, L, SMs."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch {batch} and max_len {max_len} must be >= 1")
    want = max(1, -(-cfg.ctas_per_sm * num_sms // batch))
    most = max(1, -(-max_len // cfg.min_split_rows))
    splits = min(want, most)
    chunk = -(-max_len // splits)
    chunk = -(-chunk // TILE) * TILE
    return -(-max_len // chunk), chunk


if _IMPORT_ERROR is None:

    class MlaDecodeKernel:
        """Both launches for one config and (H, C, R) baked in; B, L, the slot count, the split plan and the scale are
        runtime arguments."""

        def __init__(self, cfg: MlaConfig, heads: int, latent: int, rope: int):
            cfg.check(heads, latent, rope)
            self.cfg, self.h, self.c, self.r = cfg, heads, latent, rope
            self.w = latent + rope

        @cute.jit
        def __call__(self, pQ: cute.Pointer, pKV: cute.Pointer, pSlots: cute.Pointer, pLens: cute.Pointer,
                     pPart: cute.Pointer, pLse: cute.Pointer, pLat: cute.Pointer, batch: Int32, max_len: Int32,
                     num_slots: Int32, splits: Int32, chunk: Int32, scale: Float32, stream: cuda.CUstream):
            H, C, W = self.h, self.c, self.w
            mQ = cute.make_tensor(pQ, cute.make_layout((batch, H * W), stride=(H * W, 1)))
            # slot 0's rows [L, W]; `partial` moves the base to its slot with 64-bit arithmetic
            mKV = cute.make_tensor(pKV, cute.make_layout((max_len, W), stride=(W, 1)))
            mSlots = cute.make_tensor(pSlots, cute.make_layout((batch,)))
            mLens = cute.make_tensor(pLens, cute.make_layout((batch,)))
            mPart = cute.make_tensor(pPart, cute.make_layout((batch, splits, H, C),
                                                             stride=(splits * H * C, H * C, C, 1)))
            mLse = cute.make_tensor(pLse, cute.make_layout((batch, splits, H), stride=(splits * H, H, 1)))
            mLat = cute.make_tensor(pLat, cute.make_layout((batch, H, C), stride=(H * C, C, 1)))
            self.partial(mQ, mKV, mSlots, mLens, mPart, mLse, max_len, num_slots, chunk, scale).launch(
                grid=[splits, batch, 1], block=[self.cfg.threads, 1, 1], stream=stream)
            self.merge(mPart, mLse, mLat, splits).launch(grid=[H, batch, 1], block=[C // MERGE_COLS, 1, 1],
                                                         stream=stream)

        @cute.kernel
        def partial(self, mQ: cute.Tensor, mKV: cute.Tensor, mSlots: cute.Tensor, mLens: cute.Tensor,
                    mPart: cute.Tensor, mLse: cute.Tensor, max_len: Int32, num_slots: Int32, chunk: Int32,
                    scale: Float32):
            c, H, W = self.cfg, self.h, self.w
            NT, NW = c.threads, c.warps
            RW = TILE // NW  # rows per warp in the score step
            RG = min(c.score_rows, RW)  # of which this many at a time
            J = W // 64  # bf16 pairs per lane per row
            LOADS = TILE * W // VEC // NT  # 16-byte loads per thread per tile
            CHUNKS = W // VEC  # 16-byte chunks per row
            tidx, _, _ = cute.arch.thread_idx()
            split, b, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = tidx // 32
            neg_inf = Float32(-math.inf)

            slot = cutlass.min(cutlass.max(Int32(mSlots[b]), Int32(0)), num_slots - 1)  # clamped: never out of bounds
            length = cutlass.min(cutlass.max(Int32(mLens[b]), Int32(0)), max_len)
            start = split * chunk
            stop = cutlass.min(start + chunk, length)
            rows = cutlass.max(stop - start, Int32(0))
            ntiles = (rows + (TILE - 1)) // TILE

            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(Float32, cute.make_layout((H, W), stride=(W, 1)), byte_alignment=16)
            sRow = smem.allocate_tensor(BFloat16, cute.make_layout((TILE, W), stride=(W, 1)), byte_alignment=16)
            sP = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS, TILE), stride=(TILE, 1)),
                                      byte_alignment=16)
            sM = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS,)), byte_alignment=16)
            sL = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS,)), byte_alignment=16)
            sA = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS,)), byte_alignment=16)

            for i in cutlass.range_constexpr(-(-H * W // NT)):
                idx = tidx + i * NT
                if idx < H * W:
                    sQ[idx // W, idx % W] = mQ[b, idx]
            if tidx < H:
                sM[tidx] = neg_inf
                sL[tidx] = Float32(0.0)
                sA[tidx] = Float32(0.0)
            acc = cute.make_rmem_tensor((H, 2), Float32)
            for h in cutlass.range_constexpr(H):
                acc[h, 0] = Float32(0.0)
                acc[h, 1] = Float32(0.0)
            cute.arch.sync_threads()

            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            # the sequence's rows: base + slot L W elements in 64 bits (a cache may exceed 2^31 elements); offsets
            # inside a slot stay 32-bit (check_args: L W < 2^31); the row stride W keeps 16-byte alignment visible
            base_addr = mKV.iterator.toint() + Int64(slot) * Int64(max_len) * Int64(W * 2)
            kv = cute.make_tensor(cute.make_ptr(BFloat16, base_addr, cute.AddressSpace.gmem, assumed_align=16),
                                  cute.make_layout((max_len, W), stride=(W, 1)))
            c0 = 2 * tidx
            for it in cutlass.range(ntiles):
                base = start + it * TILE
                # 1. the tile into shared memory: all loads first, then all stores
                ring = cute.make_rmem_tensor((VEC, LOADS), BFloat16)
                for i in cutlass.range_constexpr(LOADS):
                    idx = tidx + i * NT
                    row = cutlass.min(base + idx // CHUNKS, stop - 1)  # clamped to the split's last valid row
                    cute.copy(load, cute.local_tile(kv[row, None], (VEC,), (idx % CHUNKS,)), ring[None, i])
                for i in cutlass.range_constexpr(LOADS):
                    idx = tidx + i * NT
                    cute.local_tile(sRow[idx // CHUNKS, None], (VEC,), (idx % CHUNKS,)).store(ring[None, i].load())
                cute.arch.sync_threads()
                # 2. scores of the warp's rows for every head, RG rows at a time (their elements in registers)
                for g0 in cutlass.range(RW // RG, unroll=1):  # not unrolled: q is re-read per group
                    xs = cute.make_rmem_tensor((RG, J, 2), Float32)
                    for k in cutlass.range_constexpr(RG):
                        for j in cutlass.range_constexpr(J):
                            e = 2 * (lane + 32 * j)
                            xs[k, j, 0] = sRow[warp * RW + g0 * RG + k, e].to(Float32)
                            xs[k, j, 1] = sRow[warp * RW + g0 * RG + k, e + 1].to(Float32)
                    for h in cutlass.range_constexpr(H):
                        dots = [Float32(0.0) for _ in range(RG)]
                        for j in cutlass.range_constexpr(J):
                            e = 2 * (lane + 32 * j)
                            q0 = sQ[h, e]
                            q1 = sQ[h, e + 1]
                            for k in cutlass.range_constexpr(RG):
                                dots[k] = dots[k] + q0 * xs[k, j, 0]
                                dots[k] = dots[k] + q1 * xs[k, j, 1]
                        for k in cutlass.range_constexpr(RG):
                            s = dots[k]
                            for off in (16, 8, 4, 2, 1):
                                s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
                            t = warp * RW + g0 * RG + k
                            if lane == 0:
                                sP[h, t] = cutlass.select_(base + t < stop, s * scale, neg_inf)
                cute.arch.sync_threads()
                # 3. online softmax: warp w takes heads w and w + NW, lane t row t
                for g in cutlass.range_constexpr(2):
                    h = warp + g * NW
                    if h < H:
                        s = sP[h, lane]
                        top = s
                        for off in (16, 8, 4, 2, 1):
                            top = cutlass.max(top, cute.arch.shuffle_sync_bfly(top, offset=off))
                        m_old = sM[h]
                        m_new = cutlass.max(m_old, top)  # finite: a tile has at least one valid row
                        p = cute.math.exp(s - m_new)
                        total = p
                        for off in (16, 8, 4, 2, 1):
                            total = total + cute.arch.shuffle_sync_bfly(total, offset=off)
                        sP[h, lane] = p
                        cute.arch.sync_warp()
                        if lane == 0:
                            alpha = cute.math.exp(m_old - m_new)
                            sA[h] = alpha
                            sL[h] = sL[h] * alpha + total
                            sM[h] = m_new
                cute.arch.sync_threads()
                # 4. accumulate the thread's two latent columns of every head
                for h in cutlass.range_constexpr(H):
                    alpha = sA[h]
                    acc[h, 0] = acc[h, 0] * alpha
                    acc[h, 1] = acc[h, 1] * alpha
                for t in cutlass.range_constexpr(TILE):
                    x0 = sRow[t, c0].to(Float32)
                    x1 = sRow[t, c0 + 1].to(Float32)
                    for h in cutlass.range_constexpr(H):
                        p = sP[h, t]
                        acc[h, 0] = acc[h, 0] + p * x0
                        acc[h, 1] = acc[h, 1] + p * x1
                cute.arch.sync_threads()
            # the normalized partial and its log-sum-exp; an empty split: 0 and -inf
            for h in cutlass.range_constexpr(H):
                total = sL[h]
                inv = cutlass.select_(total > Float32(0.0), Float32(1.0) / total, Float32(0.0))
                mPart[b, split, h, c0] = acc[h, 0] * inv
                mPart[b, split, h, c0 + 1] = acc[h, 1] * inv
            if tidx < H:
                total = sL[tidx]
                safe = cutlass.select_(total > Float32(0.0), total, Float32(1.0))
                mLse[b, split, tidx] = cutlass.select_(total > Float32(0.0), sM[tidx] + cute.math.log(safe), neg_inf)

        @cute.kernel
        def merge(self, mPart: cute.Tensor, mLse: cute.Tensor, mLat: cute.Tensor, splits: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            h, b, _ = cute.arch.block_idx()
            c0 = tidx * MERGE_COLS
            top = Float32(-math.inf)
            for s in cutlass.range(splits):
                top = cutlass.max(top, mLse[b, s, h])
            top = cutlass.select_(top > Float32(-math.inf), top, Float32(0.0))
            out = cute.make_rmem_tensor((MERGE_COLS,), Float32)
            for j in cutlass.range_constexpr(MERGE_COLS):
                out[j] = Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(splits):
                wgt = cute.math.exp(mLse[b, s, h] - top)
                total = total + wgt
                for j in cutlass.range_constexpr(MERGE_COLS):
                    out[j] = out[j] + wgt * mPart[b, s, h, c0 + j]
            divisor = cutlass.select_(total > Float32(0.0), total, Float32(1.0))
            for j in cutlass.range_constexpr(MERGE_COLS):
                mLat[b, h, c0 + j] = out[j] / divisor


def launch_args(q_ptr: int, kv_ptr: int, slots_ptr: int, lens_ptr: int, part_ptr: int, lse_ptr: int, lat_ptr: int,
                batch: int, max_len: int, num_slots: int, splits: int, chunk: int, scale: float, stream: int):
    """The kernel's arguments for device addresses, the runtime dims, the split plan, the scale and a stream."""
    gmem = cute.AddressSpace.gmem
    return (_runtime_make_ptr(Float32, q_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(BFloat16, kv_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Int64, slots_ptr, gmem, assumed_align=8),
            _runtime_make_ptr(Int64, lens_ptr, gmem, assumed_align=8),
            _runtime_make_ptr(Float32, part_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Float32, lse_ptr, gmem, assumed_align=4),
            _runtime_make_ptr(Float32, lat_ptr, gmem, assumed_align=16),
            Int32(batch), Int32(max_len), Int32(num_slots), Int32(splits), Int32(chunk), Float32(scale),
            cuda.CUstream(stream))


def fake_args():
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 0, 0, 0, 0, 0, 1, 1024, 1, 1, 1024, 192 ** -0.5, 0)


def compile_kernel(cfg: MlaConfig, heads: int, latent: int, rope: int, options: str = ""):
    """cute.compile both launches for a config and dims, for the arch the DSL targets in this process."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"CuTe DSL unavailable: {_IMPORT_ERROR}")
    return cute.compile(MlaDecodeKernel(cfg, heads, latent, rope), *fake_args(), options=options)


def compile_report(cfg: MlaConfig, heads: int, latent: int, rope: int, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"CuTe DSL unavailable: {_IMPORT_ERROR}")
    return compile_for_arch(MlaDecodeKernel(cfg, heads, latent, rope), *fake_args(), arch=arch,
                            dynamic_smem_bytes=cfg.smem_bytes(heads, latent, rope), **kw)
