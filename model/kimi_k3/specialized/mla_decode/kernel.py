"""MLA decode attention over the latent cache, the core after weight absorption, CuTe DSL, Hopper (sm_90a).

    latent[b, h] = softmax_t(scale * query[b, h] . row_b(t)) over t < length_b, times row_b(t)[:C]
    row_b(t) = kv[block_table[b, t // P], t % P]

query [B, H, W] (W = C + R: [q_nope W_UK | q_pe]) in its two pieces, q_lat fp32 [H, B, C] (the entry point's bmm)
and q_pe bf16 [B, H, R] (any view with contiguous rows: the q projection's), kv the paged cache [pages, P, W]
bf16 (P rows a page, a runtime argument; a slot per sequence is P = L with a one-column table), block_table [B,
max_blocks] int32 and lengths [B] int64 read on the device; the output absorbed in `merge`: out [B, H, V] fp32 =
out_scale x latent W_UV^T, W_UV [H, V, C] bf16 (a view of kv_b_proj: its head stride a runtime argument, V too), each
product exact inside an fp32 FMA and summed in ascending column order (the reference's fp32 absorption up to the
order of its sums). The query absorption (q_nope W_UK) stays in torch in the entry point. Two launches from one
`@cute.jit` call, one stream, no host synchronisation and no data-dependent host logic (the split count depends on B
and max_blocks x P only), so a call can be captured in a CUDA graph and replayed with other tables and lengths.

Rows are addressed one at a time, by the thread that moves them (`tile_row`, `page_of`, `cache_row`): each thread
owns one row of every tile, reads its page from the block table (clamped into [0, pages), never trusted) and
addresses the row at the pool's base + page P W + (t % P) W elements, the page's offset in 64 bits, the row's inside
it in 32 (check_args: P W < 2^31). A tile may span pages (P < 32, or P not a multiple of 32): every row still finds
its own. Only the entries of a sequence's used blocks are read: rows past a split's end are clamped to its last
valid row.

Launch 1, `partial` (flash-decoding), path "fma" (MlaConfig.path; default "mma"). Grid (splits, B), `threads` threads
(8 warps). CTA (s, b) owns the rows [s chunk, min((s + 1) chunk, length_b)) of sequence b (possibly none: an empty
split). It keeps the H queries in shared memory (fp32, H W 4 bytes) and walks its rows in tiles of T = 32 rows:
  1. load: warp w loads rows w T / 8 .. + T / 8 of the tile, 8 lanes a row, lane l the 16-byte chunks l % 8 + 8 i
     (W / 64 of them) of its row, found through its page, all loads before the stores to shared memory (bf16, T W 2
     bytes); rows past the split's end are clamped to its last valid row, so no padding byte is ever read; their
     probabilities are 0.
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

Path "mma" (`partial_mma`, the default; NOTES.md, v4): the same splits, tiles of 32 rows, softmax and outputs, the
per-tile math on tensor cores (mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, lane (g, t) = (lane // 4, lane % 4)),
the H <= 16 heads on the MMA's M side (rows g and g + 8 of every fragment; rows past H are zero in Q and P). A CTA
is MMA_THREADS = 128 threads (4 warps; ~230 registers, two CTAs a SM):
  - prologue: the sequence's fp32 query staged into shared memory by coalesced cp.async (in a tile no copy writes
    before the loop's first barrier), then each warp builds the A fragments of its k range (W / 16 / 4 = 9 k-steps)
    in registers, hi = bf16(q) and lo = bf16(q - hi): S = Q_hi KV^T + Q_lo KV^T carries ~16 significant bits of q
    (bf16 q alone fails the contract on heavy-tailed and large inputs, NOTES.md).
  - loads: a ring of MlaConfig.stages tiles filled by cp.async (16 bytes, L2 only; thread_chunks' mapping, each row
    through its page, rows past the split clamped), stages - 1 tiles ahead of the one computed, one commit group per
    tile. A thread reads the block-table entry of its row in the next tile to copy one tile early (`page_ahead`), so
    the table load's latency passes under a tile's math instead of stalling the copies. Tile rows are padded by 16
    bytes so that every ldmatrix reads 8 rows from 8 different bank groups.
  - scores: warp w takes k range w over all 32 rows: per k-step two ldmatrix.x4 give B of the 4 n-tiles; the hi and
    the lo MMA in separate accumulators (8 chains); the ranges' sums meet in shared memory (sS) and are added in
    range order.
  - softmax as the fma path's step 3, warp w heads w, w + 4, ... (fp32 m, l, alpha; l sums the fp32 p); p rounded
    to bf16 into sPb.
  - P.V: warp w owns latent columns [128 w, 128 w + 128) (16 n-tiles of 8); O = O alpha + P[16, 32] KV[32, cols]:
    A = P by ldmatrix.x4 (two k-steps of 16 rows), B by ldmatrix.x4.trans of the tile rows; fp32 accumulators.
  Three barriers a tile (tile landed and the previous tile's stage free; scores in sS; p in sPb). Then o = O / l
  and lse as the fma path (lane (g, t) stores heads g, g + 8 < H, columns 2 t, 2 t + 1 of each n-tile).

Cache "e4m3" (MlaConfig.cache; the FP8 cache of mla_decode_fp8, mma path only): the same CTAs and fragment maps over
one-byte elements. The ring holds raw rows (8-byte cp.async, the bf16 path's element mapping); at the top of each
tile a barrier frees the one f16 tile and each thread converts the chunks it copied exactly (cvt.rn.f16x2.e4m3x2)
into it; every MMA runs on f16 operands (mma.sync...f32.f16.f16.f32): the query's hi and lo in f16 after
`query_scale` multiplied it by the power of two that puts its largest magnitude in [2^13, 2^14) (f16 ends at 65504;
the scores are scaled back), P in f16. The cache's scale never reaches the kernel: the entry point folds it into
`scale` and the output.

Launch 2, `merge`. Grid (H, vsplit, ceil(B / MERGE_SEQS)), C / 4 threads (`merge_vsplit`: about two CTAs an SM).
For each of the CTA's sequences in turn: thread i owns columns 4 i .. 4 i + 3: top = max_s lse_s (0 if every split
is empty) and the weights w_s = exp(lse_s - top) computed by all threads together into shared memory (at most
MAX_SPLITS), then latent = sum_s w_s o_s / sum_s w_s (divisor 1 if the sum is 0), splits in ascending order,
MERGE_UNROLL of them in flight, a split's 4 columns in one 16-byte load: mla_dcp.merge's arithmetic; the latent
stays in shared memory (fp32). The vsplit CTAs of a (head, group) each do this merge (the same sums) and then absorb
their share of the output columns: blocks of C / 32 columns, every vsplit-th; thread (col, part) takes a column and
every ABSORB_PARTS-th 16-byte piece of its W_UV row from `part` on (a column's 8 lanes read 128 consecutive bytes;
all of a thread's pieces in flight at once; read once for all the CTA's sequences: they share the head), sums each
sequence over its pieces in order, then the 8 parts by a butterfly; times out_scale (an fp8 cache's kv_scale).
Deterministic (no atomics; fixed orders everywhere).

Known gaps (NOTES.md): the fma path keeps one tile in flight per CTA and is bound by its CUDA-core FMAs; the mma
path is bound by its per-tile latency (~2.8 us a tile a CTA, ~3.4 TB/s with every SM busy) and by a CTA's fixed
cost when its split is short; the e4m3 cache halves the bytes but not that latency. The fma path reads its rows' pages
in the tile they are loaded in (one table load's latency a tile; it is the exact path, not the fast one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kernels.cute import dsl_import, import_cutlass, require_dsl
from kernels.mma import mma_m16n8k16

with dsl_import() as DSL:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float8E4M3FN, Float16, Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr
    from cutlass.cutlass_dsl import T as _T


TILE = 32  # rows per tile = lanes per warp (the softmax step maps row t to lane t)
VEC = 8  # cache elements per load (16 bytes of bf16, 8 of e4m3)
MAX_HEADS = 16
MERGE_COLS = 4  # latent columns per thread of `merge`
MAX_SPLITS = 1024  # splits a sequence may have: `merge` keeps their weights in shared memory (4 KB)
MERGE_UNROLL = 8  # splits `merge` has in flight per thread
MERGE_SEQS = 4  # sequences a `merge` CTA merges and absorbs (W_UV[h] read once for them from L2, then from L1)
ABSORB_PARTS = 8  # lanes of `merge` that share one output column's dot over C (128 consecutive bytes of W_UV's row)
PATHS = ("fma", "mma")
CACHES = ("bf16", "e4m3")  # the cache's element type
MMA_K = 16  # k of mma.sync m16n8k16
MMA_N = 8  # n of mma.sync m16n8k16
ROW_PAD = 8  # bf16 past each shared row of the mma path: a 16-byte shift per row keeps ldmatrix conflict-free
SCORE_PARTS = 4  # mma path: the k ranges of the score step (a warp's 9 k-steps of the query stay in its registers)
MMA_THREADS = 32 * SCORE_PARTS  # mma path: a warp a k range, every row of the tile; two CTAs a SM
FMA_THREADS = 256  # fma path: 2 latent columns a thread
QUERY_PAD = 8  # fp32 past each staged query row: a half-warp's 8-byte fragment reads hit distinct banks


@dataclass(frozen=True)
class MlaConfig:
    """Everything about the launches that changes the generated code besides the problem's dims (MlaDecodeKernel),
    and the split heuristic's knobs (which change only runtime arguments)."""

    ctas_per_sm: int = 2  # the split heuristic aims at ctas_per_sm x SMs CTAs
    min_split_rows: int = 128  # ... but gives no split fewer rows than this (the partials' own traffic)
    score_rows: int = 2  # rows whose elements a lane holds at once in the score step (registers: 18 per row)
    # "mma": the per-tile math on tensor cores (mma.sync m16n8k16 bf16, heads on M; faster at every measured
    # point); "fma": on CUDA cores in fp32 (v1: exact to ~1e-6 where mma's bf16 P gives ~5e-4 relative)
    path: str = "mma"
    # "e4m3": an FP8 cache (mla_decode_fp8). Its rows arrive in 8-byte copies (the bf16 path's element mapping), are
    # converted exactly to f16 (cvt.rn.f16x2.e4m3x2) into a shared tile, and the MMAs run on f16 operands (the
    # query's hi + lo and P in f16); mma path only
    cache: str = "bf16"
    # mma path: tiles per CTA in a ring of shared-memory stages filled by cp.async (stages - 1 tiles ahead of the
    # one being computed); 2 keeps two CTAs a SM within the shared memory
    stages: int = 2

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path {self.path!r}: one of {PATHS}")
        if self.cache not in CACHES:
            raise ValueError(f"cache {self.cache!r}: one of {CACHES}")
        if self.cache == "e4m3" and self.path != "mma":
            raise ValueError("cache 'e4m3' runs on the mma path only")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"stages {self.stages}: 2..8")
        if self.score_rows not in (1, 2, 4):
            raise ValueError(f"score_rows {self.score_rows}: 1, 2 or 4")
        if self.ctas_per_sm < 1 or self.min_split_rows < TILE or self.min_split_rows % TILE:
            raise ValueError(f"ctas_per_sm {self.ctas_per_sm} >= 1, min_split_rows {self.min_split_rows}: a positive "
                             f"multiple of {TILE}")

    @property
    def threads(self) -> int:
        """Threads per `partial` CTA: fma 256 (2 latent columns a thread), mma MMA_THREADS (a warp a k range)."""
        return MMA_THREADS if self.path == "mma" else FMA_THREADS

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def code(self) -> MlaConfig:
        """This config with the split heuristic's knobs at their defaults: all the generated code depends on (the
        compile cache's key, so that a sweep of the splits compiles nothing new)."""
        return replace(self, ctas_per_sm=MlaConfig.ctas_per_sm, min_split_rows=MlaConfig.min_split_rows)

    @property
    def score_parts(self) -> int:
        """mma path: the k ranges the scores are split into (a warp's share of the query lives in its registers); the
        ranges' sums are added in range order."""
        return SCORE_PARTS

    def check(self, heads: int, latent: int, rope: int) -> None:
        """ValueError where the dims do not fit this config's mapping."""
        width = latent + rope
        most = MAX_HEADS if self.path == "mma" else min(MAX_HEADS, 2 * self.warps)  # the softmax's heads a warp
        if not 1 <= heads <= most:
            raise ValueError(f"heads {heads}: 1..{most}")
        if self.path == "fma" and latent != 2 * self.threads:
            raise ValueError(f"latent dim {latent}: 2 columns a thread, {2 * self.threads} at {self.threads} threads")
        if self.path == "mma" and latent % (MMA_N * self.warps):
            raise ValueError(f"latent dim {latent}: {self.warps} warps x n-tiles of {MMA_N} columns")
        if self.path == "mma" and width % (MMA_K * SCORE_PARTS):
            raise ValueError(f"latent + rope = {width}: {SCORE_PARTS} k ranges of whole k-steps of {MMA_K}")
        if latent % (MERGE_COLS * 32):
            raise ValueError(f"latent dim {latent}: a multiple of {MERGE_COLS * 32}")
        if rope < 0 or width % 64:
            raise ValueError(f"latent + rope = {width}: a multiple of 64 (bf16 pairs over 32 lanes)")
        if TILE % self.warps or (width // VEC) % (32 * self.warps // TILE):
            raise ValueError(f"a row's {width // VEC} chunks of {VEC} do not divide over "
                             f"{32 * self.warps // TILE} lanes ({TILE} rows over {self.warps} warps)")
        if TILE % self.warps or (TILE // self.warps) % min(self.score_rows, TILE // self.warps):
            raise ValueError(f"{TILE} rows a tile over {self.warps} warps, {self.score_rows} at a time")

    def smem_bytes(self, heads: int, latent: int, rope: int) -> int:
        """The shared memory `partial` allocates, with alignment. fma: sQ (fp32) + sRow (bf16) + sP (fp32) + the
        softmax state (3 x 16 fp32). mma: the ring (`stages` tiles of padded bf16 rows; e4m3: `stages` tiles of raw
        rows and the padded f16 tile they are converted into) + sS (fp32, a k range each, padded rows) + sPb
        (padded rows) + the state. The staged query (MAX_HEADS rows of W + QUERY_PAD fp32) borrows a tile."""
        width = latent + rope
        state = 3 * MAX_HEADS * 4 + 4 * 128
        if self.path == "fma":
            return heads * width * 4 + TILE * width * 2 + MAX_HEADS * TILE * 4 + state
        padded = TILE + ROW_PAD
        tile = TILE * (width + ROW_PAD) * 2
        ring = self.stages * TILE * width + tile if self.cache == "e4m3" else self.stages * tile
        return ring + SCORE_PARTS * MAX_HEADS * padded * 4 + MAX_HEADS * padded * 2 + state + 3 * 128


# --- the mma path's fragment maps: plain arithmetic on lane / warp indices (Python ints in the tests, Int32 in the
# kernel), so that a CPU test can run them through a model of ldmatrix and mma.sync (PTX ISA fragment layouts).


def q_fragment_position(lane, ks, j):
    """(head, column) of the low element of word j of lane's A fragment for k-step ks (the high element is the next
    column): mma.sync's A, row g + 8 (j % 2), columns 2 t + 8 (j // 2) of the k-step's 16."""
    return lane // 4 + 8 * (j % 2), MMA_K * ks + 2 * (lane % 4) + 8 * (j // 2)


def score_ldmatrix_row(lane, ks, pair):
    """(tile row, column) of the 16 bytes lane addresses in the score step's ldmatrix.x4 for k-step ks and the tile's
    rows 16 pair .. 16 pair + 15: matrix lane // 8 = (rows 0-7, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 0-7),
    (rows 8-15, k 8-15); matrices 0, 1 are B of n-tile 2 pair, 2, 3 of n-tile 2 pair + 1 (a KV row is a B column:
    no transpose)."""
    return 16 * pair + lane % 8 + 8 * (lane // 16), MMA_K * ks + 8 * ((lane // 8) % 2)


def p_ldmatrix_row(lane):
    """(head row, column) of the 16 bytes lane addresses in sPb for the P.V step's k-step 0 (k-step 1: 16 columns
    on): matrices (rows 0-7, columns 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) are A's words 0..3."""
    return lane % 8 + 8 * ((lane // 8) % 2), 8 * (lane // 16)


def c_fragment_position(lane, v: int):
    """(row, column) inside the 16 x 8 tile of accumulator v of lane: rows g, g + 8, columns 2 t, 2 t + 1."""
    return lane // 4 + 8 * (v // 2), 2 * (lane % 4) + v % 2


SPLIT_OVERHEAD_TILES = 4  # a CTA's fixed cost (query staging and fragments, the ring's fill, its partial) in tiles
MERGE_TILES_PER_SPLIT = 1 / 16  # `merge`'s cost per split of a sequence, in tiles (its loop over the partials)


def merge_vsplit(batch: int, heads: int, v_dim: int, latent: int, num_sms: int = 132) -> int:
    """How many CTAs share a (head, group of MERGE_SEQS sequences)'s output columns in `merge`: enough for about two
    CTAs an SM (batch 1, 12 heads: 8, the 128 columns in blocks of 16), never more than the column blocks. Each of
    them merges the group's splits itself (the same sums, from L2), so the absorption's W_UV reads spread over the
    GPU instead of queueing on a CTA a head."""
    blocks = -(-v_dim // (latent // MERGE_COLS // ABSORB_PARTS))
    groups = -(-batch // MERGE_SEQS)
    return max(1, min(blocks, -(-2 * num_sms // (heads * groups))))


def split_plan(batch: int, max_len: int, num_sms: int = 132, cfg: MlaConfig = MlaConfig()) -> tuple[int, int]:
    """(splits, chunk): each sequence's rows are cut into `splits` chunks of `chunk` rows (a multiple of TILE), the
    last possibly shorter; chunk x splits >= max_len and every split starts below max_len. The count minimizes a
    model of the time with every sequence at max_len: whole waves of ctas_per_sm x num_sms resident CTAs, each wave
    as long as a chunk's tiles plus a CTA's fixed cost, plus the merge's per-split cost; no chunk under
    min_split_rows; ties go to fewer splits. (Aiming at a CTA count instead left B = 64 with 5 splits, two waves the
    second of which was a fifth full: NOTES.md.) Depends only on the host values B, L, SMs (graph-safe)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch {batch} and max_len {max_len} must be >= 1")
    slots = cfg.ctas_per_sm * num_sms
    most = min(MAX_SPLITS, max(1, -(-max_len // cfg.min_split_rows)))

    def plan(splits: int) -> tuple[int, int]:
        chunk = -(-(-(-max_len // splits)) // TILE) * TILE
        return -(-max_len // chunk), chunk

    def cost(splits: int) -> float:
        splits, chunk = plan(splits)
        waves = -(-batch * splits // slots)
        return waves * (chunk // TILE + SPLIT_OVERHEAD_TILES) + splits * MERGE_TILES_PER_SPLIT

    return plan(min(range(1, most + 1), key=lambda n: (cost(n), n)))


if DSL.error is None:

    def _pack_x2(lo: Float32, hi: Float32, operand: str) -> Uint32:
        """cvt.rn.{bf16,f16}x2.f32 (operand "bf16" or "f16"): lo rounded into the low half (the lower k index of an
        MMA operand pair), hi into the high half (the instruction puts its first source in the high half)."""
        return Uint32(llvm.inline_asm(_T.i32(), [Float32(hi).ir_value(), Float32(lo).ir_value()],
                                      f"cvt.rn.{operand}x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False,
                                      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    def _unpack_x2(pair: Uint32, operand: str) -> tuple:
        """The low and the high half of a pair as fp32 (exact)."""
        if operand == "bf16":
            return (Float32(llvm.bitcast(_T.f32(), (pair << Uint32(16)).ir_value())),
                    Float32(llvm.bitcast(_T.f32(), (pair & Uint32(0xFFFF0000)).ir_value())))
        res = llvm.inline_asm(llvm.StructType.get_literal([_T.f32()] * 2), [Uint32(pair).ir_value()],
                              "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                              "=f,=f,r", has_side_effects=False, is_align_stack=False,
                              asm_dialect=llvm.AsmDialect.AD_ATT)
        return Float32(llvm.extractvalue(_T.f32(), res, [0])), Float32(llvm.extractvalue(_T.f32(), res, [1]))

    def _ldmatrix_x4(addr: Int32, trans: bool) -> list:
        """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8 x 8 bf16 matrices, lane l giving the shared
        address of row l % 8 of matrix l // 8 (16 contiguous bytes). Word i of lane (g, t) is matrix i's (row g,
        columns 2t, 2t + 1), or with .trans its (rows 2t, 2t + 1, column g): an A / B fragment register. Marked
        with side effects so it stays between the barriers that order the shared memory it reads."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([_T.i32()] * 4), [Int32(addr).ir_value()],
            f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
            "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Uint32(llvm.extractvalue(_T.i32(), res, [i])) for i in range(4)]

    class MlaDecodeKernel:
        """Both launches for one config and (H, C, R) baked in; B, the block table's width, the page size, the pool's
        page count, the split plan and the scale are runtime arguments."""

        def __init__(self, cfg: MlaConfig, heads: int, latent: int, rope: int):
            cfg.check(heads, latent, rope)
            self.cfg, self.h, self.c, self.r = cfg, heads, latent, rope
            self.w = latent + rope
            fp8 = cfg.cache == "e4m3"
            self.cache_type = Float8E4M3FN if fp8 else BFloat16  # the cache's elements in global memory
            self.tile_type = Float16 if fp8 else BFloat16  # ... in the shared tile: the MMAs' operand type
            self.operand = "f16" if fp8 else "bf16"

        @cute.jit
        def __call__(self, pQ: cute.Pointer, pQpe: cute.Pointer, pKV: cute.Pointer, pTable: cute.Pointer,
                     pLens: cute.Pointer, pPart: cute.Pointer, pLse: cute.Pointer, pUV: cute.Pointer,
                     pOut: cute.Pointer, batch: Int32, blocks: Int32, page_size: Int32, num_pages: Int32,
                     splits: Int32, chunk: Int32, scale: Float32, qpe_batch_stride: Int32, qpe_head_stride: Int32,
                     v_dim: Int32,
                     uv_head_stride: Int32, out_scale: Float32, vsplit: Int32, stream: cuda.CUstream):
            H, C, R, W = self.h, self.c, self.r, self.w
            # the query in its two pieces as the entry point has them: q_lat [H, B, C] fp32 (the bmm's output) and
            # q_pe [B, H, R] bf16 (a view of the q projection: runtime strides, its rows contiguous)
            mQ = cute.make_tensor(pQ, cute.make_layout((H, batch, C), stride=(batch * C, C, 1)))
            mQpe = cute.make_tensor(pQpe, cute.make_layout((batch, H, R),
                                                           stride=(qpe_batch_stride, qpe_head_stride, 1)))
            # page 0's rows [P, W]; `cache_row` moves to a row's page with 64-bit arithmetic
            mKV = cute.make_tensor(pKV, cute.make_layout((page_size, W), stride=(W, 1)))
            mTable = cute.make_tensor(pTable, cute.make_layout((batch, blocks), stride=(blocks, 1)))
            mLens = cute.make_tensor(pLens, cute.make_layout((batch,)))
            mPart = cute.make_tensor(pPart, cute.make_layout((batch, splits, H, C),
                                                             stride=(splits * H * C, H * C, C, 1)))
            mLse = cute.make_tensor(pLse, cute.make_layout((batch, splits, H), stride=(splits * H, H, 1)))
            mUV = cute.make_tensor(pUV, cute.make_layout((H, v_dim, C), stride=(uv_head_stride, C, 1)))
            mOut = cute.make_tensor(pOut, cute.make_layout((batch, H, v_dim), stride=(H * v_dim, v_dim, 1)))
            partial = self.partial_mma if cutlass.const_expr(self.cfg.path == "mma") else self.partial
            partial(mQ, mKV, mTable, mLens, mPart, mLse, mQpe, blocks * page_size, page_size, num_pages, chunk,
                    scale).launch(
                grid=[splits, batch, 1], block=[self.cfg.threads, 1, 1], stream=stream)
            self.merge(mPart, mLse, mUV, mOut, splits, batch, out_scale, vsplit).launch(
                grid=[H, vsplit, (batch + MERGE_SEQS - 1) // MERGE_SEQS], block=[C // MERGE_COLS, 1, 1], stream=stream)

        # --- pieces both `partial` paths share ------------------------------------------------------------------

        @cute.jit
        def query_at(self, mQ: cute.Tensor, mQpe: cute.Tensor, b: Int32, idx: Int32) -> Float32:
            """Element idx (0 <= idx < H W) of sequence b's query [H, W] = [q_lat | q_pe] flattened: q_lat's (fp32)
            below column C, q_pe's (bf16, exact in fp32) from C on. Both loads are issued (in bounds), one kept."""
            head, col = idx // self.w, idx % self.w
            lat = mQ[head, b, cutlass.min(col, Int32(self.c - 1))]
            pe = mQpe[b, head, cutlass.max(col - self.c, Int32(0))].to(Float32)
            return cutlass.select_(col < self.c, lat, pe)

        @cute.jit
        def split_rows(self, mLens: cute.Tensor, max_len: Int32, chunk: Int32):
            """(start, stop, ntiles): the CTA's split of its sequence's rows, [start, stop) in ntiles tiles (none for
            an empty split). The length is clamped into [0, max_len] (the block table's width x P), never trusted."""
            split, b, _ = cute.arch.block_idx()
            length = cutlass.min(cutlass.max(Int32(mLens[b]), Int32(0)), max_len)
            start = split * chunk
            stop = cutlass.min(start + chunk, length)
            rows = cutlass.max(stop - start, Int32(0))
            return start, stop, (rows + (TILE - 1)) // TILE

        @cute.jit
        def tile_row(self, base: Int32, stop: Int32) -> Int32:
            """The row of the sequence this thread moves for the tile at `base` (thread_chunks' row of the tile),
            clamped to the split's last row, so that no padding byte is ever read (the row's p is 0), and to 0, so
            that an empty split's look-ahead (stop <= base) still reads its block table in bounds."""
            row, _ = self.thread_chunks()
            return cutlass.max(cutlass.min(base + row, stop - 1), Int32(0))

        @cute.jit
        def page_of(self, mTable: cute.Tensor, t: Int32, page_size: Int32, num_pages: Int32) -> Int32:
            """The page of row t (0 <= t < the table's width x P) of the CTA's sequence: its block table's entry
            t // P, read on the device and clamped into [0, pages), never trusted."""
            _, b, _ = cute.arch.block_idx()
            return cutlass.min(cutlass.max(Int32(mTable[b, t // page_size]), Int32(0)), num_pages - 1)

        @cute.jit
        def cache_row(self, mKV: cute.Tensor, page: Int32, t: Int32, page_size: Int32) -> cute.Tensor:
            """Row t of the sequence, on `page`, as a [W] tensor: the pool's row page P + t % P. The page's offset is
            64-bit (a pool may exceed 2^31 elements), the row's inside its page 32-bit (check_args: P W < 2^31);
            every row starts 16 bytes aligned (the pool is, W is a multiple of 64)."""
            W = self.w
            elements = Int64(page) * Int64(page_size * W) + Int64((t % page_size) * W)
            addr = mKV.iterator.toint() + elements * Int64(self.cache_type.width // 8)
            return cute.make_tensor(cute.make_ptr(self.cache_type, addr, cute.AddressSpace.gmem, assumed_align=16),
                                    cute.make_layout((W,)))

        def tile_loads(self) -> int:
            """Loads (VEC elements each) per thread per tile (load_rows' mapping)."""
            return self.w // VEC // (32 * self.cfg.warps // TILE)

        @cute.jit
        def thread_chunks(self):
            """(row in the tile, its chunks of VEC elements) this thread moves in every tile (load_rows, store_rows,
            copy_tile, convert_tile): warp w owns rows w R .. w R + R - 1 (R = TILE / warps), LANES = 32 / R lanes a
            row; lane l takes chunks l % LANES + LANES i (i < tile_loads) of its row."""
            R = TILE // self.cfg.warps
            LANES = 32 // R
            tidx, _, _ = cute.arch.thread_idx()
            lane = cute.arch.lane_idx()
            chunk0 = lane % LANES
            return (tidx // 32) * R + lane // LANES, [chunk0 + LANES * i for i in range(self.tile_loads())]

        @cute.jit
        def load_rows(self, src: cute.Tensor, ring: cute.Tensor):
            """This thread's chunks of its tile row `src` (cache_row of tile_row) into ring (registers, [VEC,
            tile_loads]): one load instruction covers 128 contiguous bytes of each of a warp's rows, and a thread's
            loads differ by constant offsets from one address (L1 no-allocate: each byte is read once)."""
            _, chunks = self.thread_chunks()
            load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), self.cache_type,
                                       num_bits_per_copy=VEC * self.cache_type.width,
                                       l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
            for i, chunk in enumerate(chunks):
                cute.copy(load, cute.local_tile(src, (VEC,), (chunk,)), ring[None, i])

        @cute.jit
        def store_rows(self, ring: cute.Tensor, sRow: cute.Tensor):
            """ring (load_rows') into the tile's rows in shared memory (any row stride keeping 16-byte alignment): the
            fma path's bf16 tile (the mma path copies with cp.async, and e4m3 converts in convert_tile)."""
            row, chunks = self.thread_chunks()
            dst = sRow[row, None]
            for i, chunk in enumerate(chunks):
                cute.local_tile(dst, (VEC,), (chunk,)).store(ring[None, i].load())

        @cute.jit
        def online_softmax(self, s: Float32, h: Int32, sM: cute.Tensor, sL: cute.Tensor, sA: cute.Tensor):
            """One warp, head h, lane t the tile's (scaled, masked) score s of row t: p_t = exp(s_t - m') with
            m' = max(m, max_t s) (finite: a tile has at least one valid row); lane 0 sets alpha = exp(m - m')
            (0 on the first tile, m = -inf), l' = l alpha + sum_t p_t (fp32, butterfly order) and m'."""
            lane = cute.arch.lane_idx()
            top = s
            for off in (16, 8, 4, 2, 1):
                top = cutlass.max(top, cute.arch.shuffle_sync_bfly(top, offset=off))
            m_old = sM[h]
            m_new = cutlass.max(m_old, top)
            p = cute.math.exp(s - m_new)
            total = p
            for off in (16, 8, 4, 2, 1):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=off)
            if lane == 0:
                alpha = cute.math.exp(m_old - m_new)
                sA[h] = alpha
                sL[h] = sL[h] * alpha + total
                sM[h] = m_new
            return p

        @cute.jit
        def init_state(self, sM: cute.Tensor, sL: cute.Tensor, sA: cute.Tensor):
            """m = -inf, l = 0, alpha = 0 for all MAX_HEADS rows (the mma path reads rows up to 15)."""
            tidx, _, _ = cute.arch.thread_idx()
            if tidx < MAX_HEADS:
                sM[tidx] = Float32(-math.inf)
                sL[tidx] = Float32(0.0)
                sA[tidx] = Float32(0.0)

        @staticmethod
        @cute.jit
        def normalizer(total: Float32) -> Float32:
            """1 / l, or 0 for an empty split (l = 0): its o is 0, not 0 / 0."""
            return cutlass.select_(total > Float32(0.0), Float32(1.0) / total, Float32(0.0))

        @cute.jit
        def store_lse(self, mLse: cute.Tensor, sM: cute.Tensor, sL: cute.Tensor):
            """lse = m + log l per head; -inf for an empty split (mla_dcp.partial_attention's convention)."""
            tidx, _, _ = cute.arch.thread_idx()
            split, b, _ = cute.arch.block_idx()
            if tidx < self.h:
                total = sL[tidx]
                safe = cutlass.select_(total > Float32(0.0), total, Float32(1.0))
                mLse[b, split, tidx] = cutlass.select_(total > Float32(0.0), sM[tidx] + cute.math.log(safe),
                                                       Float32(-math.inf))

        # --- launch 1 on CUDA cores ---------------------------------------------------------------------------

        @cute.kernel
        def partial(self, mQ: cute.Tensor, mKV: cute.Tensor, mTable: cute.Tensor, mLens: cute.Tensor,
                    mPart: cute.Tensor, mLse: cute.Tensor, mQpe: cute.Tensor, max_len: Int32, page_size: Int32,
                    num_pages: Int32, chunk: Int32, scale: Float32):
            c, H, W = self.cfg, self.h, self.w
            NT, NW = c.threads, c.warps
            RW = TILE // NW  # rows per warp in the score step
            RG = min(c.score_rows, RW)  # of which this many at a time
            J = W // 64  # bf16 pairs per lane per row
            tidx, _, _ = cute.arch.thread_idx()
            split, b, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = tidx // 32
            neg_inf = Float32(-math.inf)
            start, stop, ntiles = self.split_rows(mLens, max_len, chunk)

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
                    sQ[idx // W, idx % W] = self.query_at(mQ, mQpe, b, idx)
            self.init_state(sM, sL, sA)
            acc = cute.make_rmem_tensor((H, 2), Float32)
            for h in cutlass.range_constexpr(H):
                acc[h, 0] = Float32(0.0)
                acc[h, 1] = Float32(0.0)
            cute.arch.sync_threads()

            c0 = 2 * tidx
            for it in cutlass.range(ntiles):
                base = start + it * TILE
                # 1. the tile into shared memory: all loads (each thread's row through its page), then all stores
                ring = cute.make_rmem_tensor((VEC, self.tile_loads()), BFloat16)
                t = self.tile_row(base, stop)
                self.load_rows(self.cache_row(mKV, self.page_of(mTable, t, page_size, num_pages), t, page_size), ring)
                self.store_rows(ring, sRow)
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
                        sP[h, lane] = self.online_softmax(sP[h, lane], h, sM, sL, sA)
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
                inv = self.normalizer(sL[h])
                mPart[b, split, h, c0] = acc[h, 0] * inv
                mPart[b, split, h, c0 + 1] = acc[h, 1] * inv
            self.store_lse(mLse, sM, sL)

        # --- launch 1 on tensor cores -------------------------------------------------------------------------

        @cute.jit
        def query_scale(self, mQ: cute.Tensor, mQpe: cute.Tensor, b: Int32, scratch: cute.Tensor) -> Float32:
            """The power of two the mma path multiplies its query by before rounding it to the operand type: 1 for
            bf16 (fp32's range); for f16 (largest finite 65504), 2^(13 - floor(log2 max|q|)) over the CTA's H x W
            query, so its largest magnitude lies in [2^13, 2^14) (1 for a zero query). A power of two scales exactly.
            One pass over the query, one barrier; `scratch` takes a float per warp (shared memory no one reads
            until the next barrier)."""
            result = Float32(1.0)
            if cutlass.const_expr(self.operand == "f16"):
                H, W, NT = self.h, self.w, self.cfg.threads
                tidx, _, _ = cute.arch.thread_idx()
                top = Float32(0.0)
                for i in cutlass.range_constexpr(-(-H * W // NT)):
                    idx = tidx + i * NT
                    x = self.query_at(mQ, mQpe, b, cutlass.min(idx, H * W - 1))
                    top = cutlass.max(top, cutlass.select_(idx < H * W, cutlass.max(x, -x), Float32(0.0)))
                for off in (16, 8, 4, 2, 1):
                    top = cutlass.max(top, cute.arch.shuffle_sync_bfly(top, offset=off))
                if tidx % 32 == 0:
                    scratch[0, 0, tidx // 32] = top
                cute.arch.sync_threads()
                top = scratch[0, 0, 0]
                for w in cutlass.range_constexpr(1, self.cfg.warps):
                    top = cutlass.max(top, scratch[0, 0, w])
                exponent = (Int32(llvm.bitcast(_T.i32(), top.ir_value())) >> 23) & Int32(0xFF)  # top >= 0
                biased = cutlass.min(cutlass.max(Int32(127 + 13 + 127) - exponent, Int32(1)), Int32(254))
                biased = cutlass.select_(top > Float32(0.0), biased, Int32(127))
                result = Float32(llvm.bitcast(_T.f32(), (biased << 23).ir_value()))
            return result

        @cute.jit
        def copy_tile(self, src: cute.Tensor, stage: cute.Tensor):
            """cp.async of this thread's chunks of its tile row `src` (cache_row of tile_row) into its row of `stage`
            (a tile of shared memory, any row stride keeping the copies aligned): thread_chunks' mapping, so a warp's
            copies cover 128 contiguous bytes of each of its rows. bf16: 16-byte copies that skip L1 (each byte is
            read once); e4m3: 8-byte copies (cp.async.cg takes 16 bytes only)."""
            row, chunks = self.thread_chunks()
            dst = stage[row, None]
            mode = cpasync.LoadCacheMode.ALWAYS if cutlass.const_expr(self.operand == "f16") else \
                cpasync.LoadCacheMode.GLOBAL
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), self.cache_type,
                                      num_bits_per_copy=VEC * self.cache_type.width)
            for chunk in chunks:
                cute.copy(g2s, cute.local_tile(src, (VEC,), (chunk,)), cute.local_tile(dst, (VEC,), (chunk,)))

        @cute.jit
        def convert_tile(self, raw: cute.Tensor, tile: cute.Tensor):
            """e4m3: this thread's chunks (copy_tile's) of a raw tile into an f16 tile, exactly (cvt.rn.f16x2.e4m3x2).
            A thread converts only what its own cp.async wrote (visible to it after cp.async.wait_group)."""
            row, chunks = self.thread_chunks()
            for chunk in chunks:
                cute.local_tile(tile[row, None], (VEC,), (chunk,)).store(
                    cute.local_tile(raw[row, None], (VEC,), (chunk,)).load().to(self.tile_type))

        @cute.jit
        def stage_query(self, mQ: cute.Tensor, mQpe: cute.Tensor, b: Int32, sQ: cute.Tensor):
            """Sequence b's query [H, W] into sQ (fp32 rows of W + QUERY_PAD): q_lat's C columns by cp.async, 16 bytes
            a copy, the threads side by side along each row (coalesced; one commit group), q_pe's R by plain loads
            converted to fp32 (exact; visible to all after the barrier that follows the group's wait)."""
            H, C, R, NT = self.h, self.c, self.r, self.cfg.threads
            CH = C // 4  # 16-byte chunks of a q_lat row
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                      num_bits_per_copy=128)
            tidx = cute.arch.thread_idx()[0]
            for i in cutlass.range_constexpr(-(-H * CH // NT)):
                idx = tidx + i * NT
                if idx < H * CH:
                    head, c4 = idx // CH, idx % CH
                    # the row's address by hand: 16-byte aligned (C fp32 a row, B C a head), which the runtime
                    # batch in the layout's head stride hides from the DSL
                    elements = Int64(head) * Int64(mQ.stride[0]) + Int64(b) * Int64(C)
                    row = cute.make_tensor(cute.make_ptr(Float32, mQ.iterator.toint() + elements * Int64(4),
                                                         cute.AddressSpace.gmem, assumed_align=16),
                                           cute.make_layout((C,)))
                    cute.copy(g2s, cute.local_tile(row, (4,), (c4,)), cute.local_tile(sQ[head, None], (4,), (c4,)))
            cute.arch.cp_async_commit_group()
            for i in cutlass.range_constexpr(-(-H * R // NT)):
                idx = tidx + i * NT
                if idx < H * R:
                    sQ[idx // R, C + idx % R] = mQpe[b, idx // R, idx % R].to(Float32)

        @cute.kernel
        def partial_mma(self, mQ: cute.Tensor, mKV: cute.Tensor, mTable: cute.Tensor, mLens: cute.Tensor,
                        mPart: cute.Tensor, mLse: cute.Tensor, mQpe: cute.Tensor, max_len: Int32, page_size: Int32,
                        num_pages: Int32, chunk: Int32, scale: Float32):
            """`partial` with the per-tile math on tensor cores (module doc, "mma path"). Lane (g, t) = (lane // 4,
            lane % 4) holds MMA rows (heads) g and g + 8 of every fragment."""
            c, H, C, W = self.cfg, self.h, self.c, self.w
            S = c.stages
            KS = W // MMA_K // SCORE_PARTS  # k-steps of a warp's k range
            NTS = TILE // MMA_N  # score n-tiles (8 rows each): every row of the tile
            NTW = C // MMA_N // c.warps  # P.V n-tiles of 8 latent columns per warp
            RS = W + ROW_PAD  # a padded tile's row stride (elements)
            PS = TILE + ROW_PAD  # sPb's and sS's row stride
            TILE_BYTES = TILE * RS * 2  # a padded tile (bf16 or f16)
            fp8 = self.operand == "f16"
            tidx, _, _ = cute.arch.thread_idx()
            split, b, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = tidx // 32  # also the warp's k range in the score step
            g = lane // 4  # the lane's MMA rows: heads g and g + 8
            start, stop, ntiles = self.split_rows(mLens, max_len, chunk)

            smem = cutlass.memory.SmemAllocator()
            # the ring of tiles cp.async fills; e4m3: raw rows, converted into one padded f16 tile
            if cutlass.const_expr(fp8):
                sRing = smem.allocate_tensor(self.cache_type, cute.make_layout((S, TILE, W), stride=(TILE * W, W, 1)),
                                             byte_alignment=16)
                sTile = smem.allocate_tensor(self.tile_type, cute.make_layout((TILE, W), stride=(RS, 1)),
                                             byte_alignment=16)
                free_tile = sTile.iterator.toint()  # first written by tile 0's conversion, after a barrier
            else:
                sRing = smem.allocate_tensor(self.cache_type, cute.make_layout((S, TILE, W), stride=(TILE * RS, RS, 1)),
                                             byte_alignment=16)
                sTile = sRing
                free_tile = sRing.iterator.toint() + (S - 1) * TILE_BYTES  # first filled in iteration 0, after one
            # padded rows: the accumulators' stores (heads g, g + 8 x columns 2t, 2t + 1) hit 16 banks, not 4
            sS = smem.allocate_tensor(Float32, cute.make_layout((SCORE_PARTS, MAX_HEADS, TILE),
                                                                stride=(MAX_HEADS * PS, PS, 1)), byte_alignment=16)
            sPb = smem.allocate_tensor(self.tile_type, cute.make_layout((MAX_HEADS, TILE), stride=(PS, 1)),
                                       byte_alignment=16)
            sM = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS,)), byte_alignment=16)
            sL = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS,)), byte_alignment=16)
            sA = smem.allocate_tensor(Float32, cute.make_layout((MAX_HEADS,)), byte_alignment=16)
            # the query, staged in a tile no copy writes before the loop's first barrier (H x (W + QUERY_PAD) fp32
            # fits a padded tile: 16 x 584 x 4 = 32 x 584 x 2 bytes at W = 576)
            sQ = cute.make_tensor(cute.make_ptr(Float32, free_tile, cute.AddressSpace.smem, assumed_align=16),
                                  cute.make_layout((H, W), stride=(W + QUERY_PAD, 1)))

            # the query's copies first, then the first S - 1 tiles': one commit group each, empty ones too, so that
            # "all but the newest S - 2 groups done" always means "this tile's rows have landed"
            self.stage_query(mQ, mQpe, b, sQ)
            for st in cutlass.range_constexpr(S - 1):
                if st < ntiles:
                    t = self.tile_row(start + st * TILE, stop)
                    self.copy_tile(self.cache_row(mKV, self.page_of(mTable, t, page_size, num_pages), t, page_size),
                                   sRing[st, None, None])
                cute.arch.cp_async_commit_group()
            # the page of this thread's row in the next tile to copy (S - 1 ahead), always read one tile early: the
            # block table's load latency passes under the prologue or a tile's math instead of stalling the copies
            page_ahead = self.page_of(mTable, self.tile_row(start + (S - 1) * TILE, stop), page_size, num_pages)
            qscale = self.query_scale(mQ, mQpe, b, sS)
            score_scale = scale / qscale
            cute.arch.cp_async_wait_group(S - 1)  # the query's group
            cute.arch.sync_threads()
            # the warp's k range of Q as A fragments in registers (q_fragment_position; 0 past H): hi = q rounded to
            # the operand type, lo = q - hi rounded: hi + lo carries ~16 (bf16) or ~22 (f16) significant bits, so
            # the scores keep near-fp32 accuracy (bf16 q alone fails the contract, NOTES.md). The query is scaled
            # by qscale (query_scale), the scores back
            qfrag = []  # [k-step][hi, lo][word]
            for ks in cutlass.range_constexpr(KS):
                hi_words, lo_words = [], []
                for j in cutlass.range_constexpr(4):
                    head, col = q_fragment_position(lane, warp * KS + ks, j)
                    row = cutlass.min(head, H - 1)
                    x0 = cutlass.select_(head < H, sQ[row, col], Float32(0.0)) * qscale
                    x1 = cutlass.select_(head < H, sQ[row, col + 1], Float32(0.0)) * qscale
                    hi = _pack_x2(x0, x1, self.operand)
                    hi0, hi1 = _unpack_x2(hi, self.operand)
                    hi_words.append(hi)
                    lo_words.append(_pack_x2(x0 - hi0, x1 - hi1, self.operand))
                qfrag.append((hi_words, lo_words))
            # rows past H stay 0. Only the TILE columns the P ldmatrix reads: the last row's padding is past sPb's
            # allocation, where sM lies (zeroing it raced with init_state's -inf: NOTES.md, mma path, GPU run)
            for i in cutlass.range_constexpr(-(-MAX_HEADS * TILE // c.threads)):
                idx = tidx + i * c.threads
                if idx < MAX_HEADS * TILE:
                    sPb[idx // TILE, idx % TILE] = self.tile_type(0.0)
            self.init_state(sM, sL, sA)
            acc = cute.make_rmem_tensor((NTW, 4), Float32)  # C fragments: (head g, 2t..2t+1), (g + 8, 2t..)
            for j in cutlass.range_constexpr(NTW):
                for v in cutlass.range_constexpr(4):
                    acc[j, v] = Float32(0.0)

            # ldmatrix row addresses (shared window, bytes) inside a tile: lane l points at row l % 8 of 8 x 8
            # matrix l // 8
            score_row, score_col = score_ldmatrix_row(lane, warp * KS, 0)
            score_off = (score_row * RS + score_col) * 2
            p_row, p_col = p_ldmatrix_row(lane)
            p_addr = sPb.iterator.toint() + (p_row * PS + p_col) * 2
            col0 = warp * NTW * MMA_N  # the warp's first latent column in the P.V step
            v_off = (lane * RS + col0) * 2  # transposed: matrix i = tile rows 8 i .. 8 i + 7
            for it in cutlass.range(ntiles):
                base = start + it * TILE
                # 1. this tile's rows have landed (this thread's copies; the barrier: everyone's). The barrier also
                # ends the previous tile's P.V, so the stage it read is free for the tile S - 1 ahead. e4m3: a
                # barrier first frees the f16 tile, then each thread converts the chunks it copied
                cute.arch.cp_async_wait_group(S - 2)
                if cutlass.const_expr(fp8):
                    cute.arch.sync_threads()
                    self.convert_tile(sRing[it % S, None, None], sTile)
                cute.arch.sync_threads()
                ahead = it + S - 1
                if ahead < ntiles:
                    t = self.tile_row(start + ahead * TILE, stop)
                    self.copy_tile(self.cache_row(mKV, page_ahead, t, page_size), sRing[ahead % S, None, None])
                cute.arch.cp_async_commit_group()
                page_ahead = self.page_of(mTable, self.tile_row(start + (ahead + 1) * TILE, stop), page_size,
                                          num_pages)
                tile_addr = sTile.iterator.toint() if cutlass.const_expr(fp8) else \
                    sRing.iterator.toint() + (it % S) * TILE_BYTES
                # 2. scores S[16 heads, the tile's 32 rows] over the warp's KS k-steps: per k-step two ldmatrix.x4
                # (16 rows each) give B of the 4 n-tiles; the hi and the lo products in separate accumulators (8
                # chains of KS MMAs)
                chains = [[Float32(0.0) for _ in range(4)] for _ in range(2 * NTS)]  # [n-tile x 2 + lo][value]
                for ks in cutlass.range_constexpr(KS):
                    for pair in cutlass.range_constexpr(NTS // 2):
                        kvb = _ldmatrix_x4(tile_addr + score_off + (pair * 16 * RS + ks * MMA_K) * 2, trans=False)
                        for half in cutlass.range_constexpr(2):
                            nt = 2 * pair + half
                            for lo in cutlass.range_constexpr(2):
                                chains[2 * nt + lo] = mma_m16n8k16(qfrag[ks][lo], [kvb[2 * half], kvb[2 * half + 1]],
                                                                   chains[2 * nt + lo], self.operand)
                for nt in cutlass.range_constexpr(NTS):
                    for v in cutlass.range_constexpr(4):
                        head, col = c_fragment_position(lane, v)
                        sS[warp, head, 8 * nt + col] = chains[2 * nt][v] + chains[2 * nt + 1][v]
                cute.arch.sync_threads()
                # 3. online softmax: warp w takes heads w, w + 4, ...; lane l row l; the parts in order; p rounded to
                # the operand type
                for hg in cutlass.range_constexpr(MAX_HEADS // c.warps):
                    h = warp + hg * c.warps
                    if h < H:
                        s = sS[0, h, lane]
                        for pp in cutlass.range_constexpr(1, SCORE_PARTS):
                            s = s + sS[pp, h, lane]
                        s = cutlass.select_(base + lane < stop, s * score_scale, Float32(-math.inf))
                        sPb[h, lane] = self.online_softmax(s, h, sM, sL, sA).to(self.tile_type)
                cute.arch.sync_threads()
                # 4. O[16 heads, the warp's columns] = O alpha + P[16, 32] V[32, columns]: A = P (ldmatrix.x4 of
                # the two k-steps), B = the tile's rows transposed (ldmatrix.x4.trans: rows 0..31, 8 columns). The
                # next iteration's first barrier orders these reads before sPb, sA and this tile are written again
                alpha = (sA[g], sA[g + 8])
                for j in cutlass.range_constexpr(NTW):
                    for v in cutlass.range_constexpr(4):
                        acc[j, v] = acc[j, v] * alpha[v // 2]
                pa = [_ldmatrix_x4(p_addr + ks * MMA_K * 2, trans=False) for ks in range(TILE // MMA_K)]
                for j in cutlass.range_constexpr(NTW):
                    vb = _ldmatrix_x4(tile_addr + v_off + j * MMA_N * 2, trans=True)
                    out = [acc[j, v] for v in range(4)]
                    for ks in cutlass.range_constexpr(TILE // MMA_K):
                        out = mma_m16n8k16(pa[ks], [vb[2 * ks], vb[2 * ks + 1]], out, self.operand)
                    for v in cutlass.range_constexpr(4):
                        acc[j, v] = out[v]
            cute.arch.sync_threads()  # no tile (an empty split): init_state's values, read below by other lanes
            # the normalized partial and its log-sum-exp; an empty split: 0 and -inf
            for r in cutlass.range_constexpr(2):
                head, col = c_fragment_position(lane, 2 * r)
                inv = self.normalizer(sL[head])
                if head < H:
                    for j in cutlass.range_constexpr(NTW):
                        mPart[b, split, head, col0 + j * MMA_N + col] = acc[j, 2 * r] * inv
                        mPart[b, split, head, col0 + j * MMA_N + col + 1] = acc[j, 2 * r + 1] * inv
            self.store_lse(mLse, sM, sL)

        @cute.kernel
        def merge(self, mPart: cute.Tensor, mLse: cute.Tensor, mUV: cute.Tensor, mOut: cute.Tensor, splits: Int32,
                  batch: Int32, out_scale: Float32, vsplit: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            h, vs, group = cute.arch.block_idx()
            C = self.c
            threads = C // MERGE_COLS
            smem = cutlass.memory.SmemAllocator()
            sW = smem.allocate_tensor(Float32, cute.make_layout((MAX_SPLITS,)), byte_alignment=16)
            sTop = smem.allocate_tensor(Float32, cute.make_layout((threads // 32,)), byte_alignment=16)
            sLat = smem.allocate_tensor(Float32, cute.make_layout((MERGE_SEQS, C), stride=(C, 1)), byte_alignment=16)
            b0 = group * MERGE_SEQS
            seqs = cutlass.min(batch - b0, Int32(MERGE_SEQS))
            c0 = tidx * MERGE_COLS
            row_bytes = C * 4
            for i in cutlass.range(seqs):
                b = b0 + i
                # top = max_s lse_s, the splits spread over the threads (a max is exact in any order); each thread
                # keeps its splits' lse in sW, where it turns them into weights below (the same thread: no barrier)
                top = Float32(-math.inf)
                for s in cutlass.range(tidx, splits, threads):
                    lse = mLse[b, s, h]
                    sW[s] = lse
                    top = cutlass.max(top, lse)
                for off in (16, 8, 4, 2, 1):
                    top = cutlass.max(top, cute.arch.shuffle_sync_bfly(top, offset=off))
                # the warp index from tidx, not warp_idx(): that is a full-warp shuffle, which lane 0 alone would
                # wait in forever (the first GPU run of this merge hung there)
                if tidx % 32 == 0:
                    sTop[tidx // 32] = top
                cute.arch.sync_threads()
                top = sTop[0]
                for w in cutlass.range_constexpr(1, threads // 32):
                    top = cutlass.max(top, sTop[w])
                top = cutlass.select_(top > Float32(-math.inf), top, Float32(0.0))
                for s in cutlass.range(tidx, splits, threads):
                    sW[s] = cute.math.exp(sW[s] - top)
                cute.arch.sync_threads()
                # the weighted sum in ascending split order (deterministic, the emulation's order); unrolled so that
                # several splits' loads are in flight at once: at batch 1 there are ~256 splits and 12 CTAs
                out = cute.make_rmem_tensor((MERGE_COLS,), Float32)
                for j in cutlass.range_constexpr(MERGE_COLS):
                    out[j] = Float32(0.0)
                total = Float32(0.0)
                # a split's MERGE_COLS columns in one 16-byte load (the partial rows are C fp32 from a 16-byte base)
                first = mPart.iterator.toint() + (Int64(b) * Int64(splits) * Int64(self.h) + Int64(h)) * \
                    Int64(row_bytes)
                for s in cutlass.range(splits, unroll=MERGE_UNROLL):
                    wgt = sW[s]
                    total = total + wgt
                    cols = cute.make_tensor(cute.make_ptr(Float32, first + Int64(s) * Int64(self.h * row_bytes) +
                                                          Int64(c0 * 4), cute.AddressSpace.gmem, assumed_align=16),
                                            cute.make_layout((MERGE_COLS,))).load()
                    for j in cutlass.range_constexpr(MERGE_COLS):
                        out[j] = out[j] + wgt * cols[j]
                divisor = cutlass.select_(total > Float32(0.0), total, Float32(1.0))
                for j in cutlass.range_constexpr(MERGE_COLS):
                    sLat[i, c0 + j] = out[j] / divisor
                # the next sequence rewrites sW and sTop; the absorption below reads every thread's sLat
                cute.arch.sync_threads()
            # out[b, h, v] = out_scale sum_c latent[b, c] W_UV[h, v, c] for this CTA's columns (every vsplit-th
            # block of `cols` of them): thread (col, part) takes column v0 + col and pieces part, part + PARTS, ... of
            # its row (a column's PARTS lanes read 128 consecutive bytes, all of a thread's pieces in flight at
            # once), each sequence summed over the thread's pieces in order, then over the parts by a butterfly
            cols = threads // ABSORB_PARTS
            col, part = tidx // ABSORB_PARTS, tidx % ABSORB_PARTS
            v_dim = mUV.shape[1]
            for v0 in cutlass.range(vs * cols, v_dim, vsplit * cols):
                v = cutlass.min(v0 + col, v_dim - 1)  # past the last column: load a real row, store nothing
                # the row's address by hand (as cache_row): 16-byte aligned, which the runtime head stride hides
                # from the layout (check_args: W_UV's base and head stride keep every row 16-byte aligned)
                elements = Int64(h) * Int64(mUV.stride[0]) + Int64(v) * Int64(C)
                row = cute.make_tensor(cute.make_ptr(BFloat16, mUV.iterator.toint() + elements * Int64(2),
                                                     cute.AddressSpace.gmem, assumed_align=16), cute.make_layout((C,)))
                pieces = [cute.local_tile(row, (8,), (part + ABSORB_PARTS * q,)).load()
                          for q in range(C // 8 // ABSORB_PARTS)]
                acc = cute.make_rmem_tensor((MERGE_SEQS,), Float32)
                for i in cutlass.range_constexpr(MERGE_SEQS):
                    acc[i] = Float32(0.0)
                for q in cutlass.range_constexpr(C // 8 // ABSORB_PARTS):
                    w8 = pieces[q].to(Float32)
                    w = [w8[j] for j in range(8)]  # extracted here, outside the branches that use them
                    for i in cutlass.range_constexpr(MERGE_SEQS):
                        if i < seqs:  # the CTA's sequences only (one at batch 1): a uniform branch
                            lat = cute.local_tile(sLat[i, None], (8,), (part + ABSORB_PARTS * q,)).load()
                            a = acc[i]
                            for j in cutlass.range_constexpr(8):
                                a = a + lat[j] * w[j]
                            acc[i] = a
                for i in cutlass.range_constexpr(MERGE_SEQS):
                    a = acc[i]
                    for off in (4, 2, 1):  # the column's parts: lanes 8 col .. 8 col + 7 of the warp
                        a = a + cute.arch.shuffle_sync_bfly(a, offset=off)
                    if i < seqs:
                        if part == 0:
                            if v0 + col < v_dim:
                                mOut[b0 + i, h, v] = a * out_scale


def launch_args(q_ptr: int, qpe_ptr: int, kv_ptr: int, table_ptr: int, lens_ptr: int, part_ptr: int, lse_ptr: int,
                uv_ptr: int, out_ptr: int, batch: int, blocks: int, page_size: int, num_pages: int, splits: int,
                chunk: int, scale: float, qpe_strides: tuple[int, int], v_dim: int, uv_head_stride: int,
                out_scale: float, vsplit: int, stream: int, cache: str = "bf16"):
    """The kernel's arguments for device addresses (q_lat fp32 [H, B, C] contiguous, q_pe bf16 [B, H, R] with rows
    contiguous and (batch, head) strides qpe_strides, the block table int32 [batch, blocks], the lengths int64, W_UV
    bf16 [H, V, C] with rows of C contiguous and heads uv_head_stride elements apart, out fp32 [B, H, V]), the runtime
    dims, the split plan, the scales and a stream; the cache pointer's type is the config's `cache`."""
    gmem = cute.AddressSpace.gmem
    return (_runtime_make_ptr(Float32, q_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(BFloat16, qpe_ptr, gmem, assumed_align=2),
            _runtime_make_ptr(Float8E4M3FN if cache == "e4m3" else BFloat16, kv_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Int32, table_ptr, gmem, assumed_align=4),
            _runtime_make_ptr(Int64, lens_ptr, gmem, assumed_align=8),
            _runtime_make_ptr(Float32, part_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Float32, lse_ptr, gmem, assumed_align=4),
            _runtime_make_ptr(BFloat16, uv_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Float32, out_ptr, gmem, assumed_align=4),
            Int32(batch), Int32(blocks), Int32(page_size), Int32(num_pages), Int32(splits), Int32(chunk),
            Float32(scale), Int32(qpe_strides[0]), Int32(qpe_strides[1]), Int32(v_dim), Int32(uv_head_stride),
            Float32(out_scale), Int32(vsplit), cuda.CUstream(stream))


def fake_args(cache: str = "bf16"):
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 16, 64, 16, 1, 1024, 192 ** -0.5, (12 * 192, 192), 128,
                       2 * 128 * 512, 1.0, 1, 0, cache)


def compile_kernel(cfg: MlaConfig, heads: int, latent: int, rope: int, options: str = ""):
    """cute.compile both launches for a config and dims, for the arch the DSL targets in this process."""
    require_dsl(DSL.error)
    return cute.compile(MlaDecodeKernel(cfg, heads, latent, rope), *fake_args(cfg.cache), options=options)


def compile_report(cfg: MlaConfig, heads: int, latent: int, rope: int, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    return compile_for_arch(MlaDecodeKernel(cfg, heads, latent, rope), *fake_args(cfg.cache), arch=arch,
                            dynamic_smem_bytes=cfg.smem_bytes(heads, latent, rope), **kw)
