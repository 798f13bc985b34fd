"""Fused KDA decode step, CuTe DSL, Hopper (sm_90a).

One launch does the whole decode step of a KDA layer after the input projection, for every sequence
and local head: the short-conv window update of q, k, v with SiLU; the f_b projection of the gate's
low-rank input; the safe decay gate; beta = sigmoid; L2 normalization of q (scaled by K^-1/2) and k;
the fp32 delta-rule state update in place in the sequence's cache slot; o = S q; and the gated RMSNorm
(o_norm weight, sigmoid of the output gate). Semantics, layouts and rounding points are those of
`model.kimi_k3.ops.kda.kda_decode` (the reference).

Work decomposition: `v_split` CTAs of 256 threads (8 warps) per (head, sequence), launched as one
thread-block cluster (grid = (H x v_split, B)); each CTA owns 128 / v_split state rows and, from v_split 4
on (`share_decays`), 128 / v_split of the head's decays; it repeats the q/k conv and norms. `default_v_split`
picks 8 while that is one CTA per SM, down to 1 (no cluster) once (head, sequence) pairs fill the GPU.
- The CTA's fp32 state rows of (slot, head) are streamed into shared memory with 16-byte `cp.async.cg`
  copies issued first, so the state load overlaps everything else: conv, f_b GEMV, gate and norms run
  while the state is in flight, and take no registers from it.
- Lane l owns columns 4l..4l+3 of each of its warp's rows, so each warp-wide 16-byte access covers one
  full 512-byte row (coalesced global, conflict-free shared).
- Row dot products (S k, S q) reduce across the warp with a transpose-butterfly: 16 row partials
  reduce in 15+1 shuffles and leave row (l >> 1) in lane l (fewer rows per warp, fewer steps).
- The updated state goes straight back from registers with 16-byte stores.
- The f_b GEMV (R=128 -> this CTA's 128 / decay_split decays): warp w computes 16 / decay_split rows,
  half-warps read full 256-byte f_b rows, same butterfly reduction, with TwoSum compensation so that r
  rounds like the exact product (as the reference rounds it).
- In a cluster, the decays (with share_decays) and the gated RMSNorm's sum of squares are sent by `st.async`
  into every peer's shared memory, each completing a transaction barrier there: no release cluster barrier,
  which would first wait for all of the CTA's global stores.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kernels.cute import compile_for_arch, dsl_import, import_cutlass, require_dsl
from model.kimi_k3.ops.kda import L2_EPS, KDAColumns

with dsl_import() as DSL:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr

NUM_THREADS = 256
NUM_WARPS = NUM_THREADS // 32
H200_SMS = 132


@dataclass(frozen=True)
class KDADecodeConfig:
    """Everything that changes the generated code; the compile cache is keyed on it (plus the arch)."""

    heads: int
    head_dim: int = 128
    rank: int = 128
    conv_width: int = 4
    proj_stride: int = 0  # elements between rows of proj; 0 = the packed width
    slot_dtype: str = "int32"
    act_dtype: str = "bfloat16"
    # CTAs per (head, sequence), launched as one thread-block cluster; each owns 128 / v_split state rows
    # and they add their shares of the gated-RMSNorm sum of squares through distributed shared memory.
    v_split: int = 1
    # In a cluster, each CTA computes 128 / v_split of the head's decays and sends them to its peers, instead
    # of every CTA computing all 128: the exchange pays for itself from v_split 4 on (NOTES.md, run 10).
    share_decays: bool = True
    # State rows per warp per pipeline chunk: each chunk is its own cp.async group, computed and stored as
    # soon as it lands while later chunks are still in flight. 0 = one chunk (all rows of the warp).
    chunk_rows: int = 0
    # cudaFuncAttributePreferredSharedMemoryCarveout in percent; -1 leaves the driver's default.
    smem_carveout: int = 100
    # Occupancy hint (nvvm.minctasm); 0 = none. The kernel needs 64 registers without a cap, so 3 CTAs of
    # ~66 KiB shared memory fit an SM either way; a cap of 3 makes ptxas spill (80 registers, 8 B).
    min_ctas_per_sm: int = 0

    def __post_init__(self):
        if self.head_dim != 128:
            raise ValueError(f"head_dim {self.head_dim}: this kernel is built for 128 "
                             "(8 warps x 16 rows, 32 lanes x 4)")
        if self.rank != 128:
            raise ValueError(f"rank {self.rank}: the f_b GEMV mapping needs 128 (16 lanes x 8 bf16 per row)")
        if self.conv_width != 4:
            raise ValueError(f"conv_width {self.conv_width}: only 4 is supported (one 8-byte window per channel)")
        if self.heads < 1:
            raise ValueError("heads must be >= 1")
        if self.v_split not in (1, 2, 4, 8):
            raise ValueError(f"v_split {self.v_split}: 1, 2, 4 or 8 (8 is the largest portable cluster)")
        object.__setattr__(self, "share_decays", bool(self.share_decays) and self.v_split > 1)
        rpw = self.head_dim // self.v_split // 8
        if self.chunk_rows == rpw:
            object.__setattr__(self, "chunk_rows", 0)
        if self.chunk_rows not in (0, 1, 2, 4, 8) or (self.chunk_rows and rpw % self.chunk_rows):
            raise ValueError(f"chunk_rows {self.chunk_rows}: 0 or a power of two dividing {rpw}")
        if self.slot_dtype not in ("int32", "int64"):
            raise ValueError(f"slot_dtype {self.slot_dtype!r}")
        if self.act_dtype != "bfloat16":
            raise ValueError(f"act_dtype {self.act_dtype!r}: only bfloat16")
        if self.proj_stride == 0:
            object.__setattr__(self, "proj_stride", self.width)
        if self.proj_stride < 4 * self.p + self.rank + self.heads or self.proj_stride % 8:
            raise ValueError(f"proj_stride {self.proj_stride}: must cover the packed columns and be a multiple of 8")

    @classmethod
    def for_problem(cls, heads: int, batch: int, sm_count: int = H200_SMS, **shape) -> KDADecodeConfig:
        """The launch config the entry point uses for `batch` sequences of `heads` local heads (measured on the
        H200, NOTES.md); tune it with dataclasses.replace. `shape`: head_dim, rank, conv_width, proj_stride,
        slot_dtype."""
        v_split = default_v_split(heads, batch, sm_count)
        return cls(heads=heads, v_split=v_split, share_decays=v_split >= 4, chunk_rows=0, **shape)

    @property
    def p(self) -> int:
        return self.heads * self.head_dim

    @property
    def width(self) -> int:
        return KDAColumns(self.heads, self.head_dim, self.rank).width

    @property
    def rows(self) -> int:
        """State rows (V) per CTA."""
        return self.head_dim // self.v_split

    @property
    def decay_split(self) -> int:
        """CTAs the head's decays are split over: v_split when they are shared, else 1."""
        return self.v_split if self.share_decays else 1

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA: state tile, q|k, v, decay, reduction scratch; with a cluster, the
        CTAs' partials and the two barriers the decays' and the partials' arrivals complete."""
        k = self.head_dim
        cluster = self.v_split * 4 + 16 if self.v_split > 1 else 0
        return self.rows * k * 4 + 2 * k * 4 + self.rows * 4 + k * 4 + 16 * 4 + cluster


def _sigmoid(x):
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


def _select(cond, a, b):
    return Float32(cutlass.select_(cond, a, b))


def _two_sum(a, b):
    """Knuth's TwoSum: s = fl(a + b) and its rounding error e, with a + b = s + e exactly."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


def _add_compensated(x, y):
    """Add two (sum, error) pairs as Ogita, Rump and Oishi's Sum2 does: the sums' rounding errors are
    carried, so sum + error is as accurate as a sum in twice the precision."""
    s, t = _two_sum(x[0], y[0])
    return s, x[1] + y[1] + t


def _componentwise(f, *xs):
    """f over values, or component by component over tuples of values."""
    if isinstance(xs[0], tuple):
        return tuple(f(*cs) for cs in zip(*xs))
    return f(*xs)


def _transpose_reduce(vals, lane, offsets, final=(), add=operator.add):
    """Butterfly 'transpose' reduction of len(vals) = 2**len(offsets) per-lane partials.

    At each step of `offsets` the lane keeps the half of its values selected by its lane bit `off` and
    adds the partner's copy of that half; afterwards the lane holds one value, of index
    sum_s bit_s(lane) * len/2**(s+1), summed over the lanes that differ in the `offsets` bits. The
    `final` offsets then sum it over the remaining lane bits (plain butterfly). A value may be a tuple
    (each component is shuffled), added by `add`.
    """

    def shuffle(x, off):
        return _componentwise(lambda c: cute.arch.shuffle_sync_bfly(c, offset=off), x)

    for off in offsets:
        half = len(vals) // 2
        upper = (lane & off) != 0
        nxt = []
        for i in range(half):
            lo, hi = vals[i], vals[i + half]
            keep = _componentwise(lambda h_, l_: _select(upper, h_, l_), hi, lo)
            send = _componentwise(lambda l_, h_: _select(upper, l_, h_), lo, hi)
            nxt.append(add(keep, shuffle(send, off)))
        vals = nxt
    x = vals[0]
    for off in final:
        x = add(x, shuffle(x, off))
    return x


def _reduce_plan(rows_per_warp: int):
    """(offsets, final, shift) for reducing `rows_per_warp` row partials over a warp's 32 lanes:
    lane l ends with row l >> shift."""
    m = rows_per_warp.bit_length() - 1
    assert 1 << m == rows_per_warp and 0 <= m <= 4
    shift = 5 - m
    offsets = tuple(16 >> t for t in range(m))
    final = tuple(1 << t for t in reversed(range(shift)))
    return offsets, final, shift


def _send_f32(smem_ptr, val, mbar_ptr, peer_rank):
    """st.async of an f32 to the same shared-memory offset in CTA `peer_rank` of the cluster; its arrival
    completes 4 bytes of the transaction count of the peer's barrier at `mbar_ptr`. The sender waits for
    nothing (a release cluster barrier would first wait for all of this CTA's global stores)."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    bits = Int32(llvm.bitcast(T.i32(), Float32(val).ir_value()))
    cute.arch.store_async_dsmem(smem_ptr, bits, mbar_ptr, peer_rank)


def _conv_load(gConv, mConvW, mProj, b, c, wc: int):
    """Issue channel c's loads: its window (8 B), its taps (16 B) and the new input proj[b, c]."""
    win = cute.make_rmem_tensor((wc,), BFloat16)
    cute.autovec_copy(gConv[c, None], win)
    wts = cute.make_rmem_tensor((wc,), Float32)
    cute.autovec_copy(mConvW[c, None], wts)
    return win, wts, mProj[b, c]


def _conv_compute(win, wts, x, wc: int):
    """The channel's new window (old one shifted, x appended; the caller stores it) and
    SiLU(window . taps) in fp32, never rounded to bf16 (the reference's `conv_update` says why)."""
    new = cute.make_rmem_tensor((wc,), BFloat16)
    for i in range(wc - 1):
        new[i] = win[i + 1]
    new[wc - 1] = x
    y = new[0].to(Float32) * wts[0]
    for i in range(1, wc):
        y = y + new[i].to(Float32) * wts[i]
    return new, y / (Float32(1.0) + cute.math.exp(-y))


if DSL.error is None:

    class KDADecodeKernel:
        """CuTe DSL kernel object: `__call__` (jit) builds the tensors and launches `kernel`."""

        def __init__(self, cfg: KDADecodeConfig):
            self.cfg = cfg

        @cute.jit
        def __call__(
            self,
            pProj: cute.Pointer,
            pConv: cute.Pointer,
            pState: cute.Pointer,
            pSlots: cute.Pointer,
            pConvW: cute.Pointer,
            pFb: cute.Pointer,
            pAlog: cute.Pointer,
            pDt: cute.Pointer,
            pOnorm: cute.Pointer,
            pOut: cute.Pointer,
            batch: Int32,
            lower_bound: Float32,
            norm_eps: Float32,
            stream: cuda.CUstream,
        ):
            c = self.cfg
            H, K, R, Wc, Wp = c.heads, c.head_dim, c.rank, c.conv_width, c.proj_stride
            P = H * K
            mProj = cute.make_tensor(pProj, cute.make_layout((batch, Wp), stride=(Wp, 1)))
            mSlots = cute.make_tensor(pSlots, cute.make_layout((batch,)))
            mConvW = cute.make_tensor(pConvW, cute.make_layout((3 * P, Wc), stride=(Wc, 1)))
            mFb = cute.make_tensor(pFb, cute.make_layout((P, R), stride=(R, 1)))
            mAlog = cute.make_tensor(pAlog, cute.make_layout((H,)))
            mDt = cute.make_tensor(pDt, cute.make_layout((P,)))
            mOnorm = cute.make_tensor(pOnorm, cute.make_layout((K,)))
            mOut = cute.make_tensor(pOut, cute.make_layout((batch, P), stride=(P, 1)))
            self.kernel(mProj, pConv, pState, mSlots, mConvW, mFb, mAlog, mDt, mOnorm, mOut,
                        lower_bound, norm_eps).launch(
                grid=[H * c.v_split, batch, 1], block=[NUM_THREADS, 1, 1], stream=stream,
                cluster=[c.v_split, 1, 1] if cutlass.const_expr(c.v_split > 1) else None,
                min_blocks_per_mp=c.min_ctas_per_sm,
                preferred_smem_carveout=c.smem_carveout if cutlass.const_expr(c.smem_carveout >= 0) else None)

        @cute.kernel
        def kernel(
            self,
            mProj: cute.Tensor,
            pConv: cute.Pointer,
            pState: cute.Pointer,
            mSlots: cute.Tensor,
            mConvW: cute.Tensor,
            mFb: cute.Tensor,
            mAlog: cute.Tensor,
            mDt: cute.Tensor,
            mOnorm: cute.Tensor,
            mOut: cute.Tensor,
            lower_bound: Float32,
            norm_eps: Float32,
        ):
            c = self.cfg
            H, K, R, Wc, S, DS = c.heads, c.head_dim, c.rank, c.conv_width, c.v_split, c.decay_split
            P = H * K
            ROWS = c.rows  # state rows of this CTA
            RPW = ROWS // NUM_WARPS  # rows per warp: 16, 8, 4, 2
            CH = c.chunk_rows if c.chunk_rows else RPW  # rows per warp per pipeline chunk
            NCH = RPW // CH
            offsets, final, shift = _reduce_plan(CH)
            tidx, _, _ = cute.arch.thread_idx()
            bx, b, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            warp = tidx // 32
            h = bx // S
            rank = bx % S
            if cutlass.const_expr(S > 1):
                rank = cute.arch.block_idx_in_cluster()
            row0 = rank * ROWS

            smem = cutlass.memory.SmemAllocator()
            sS = smem.allocate_tensor(Float32, cute.make_layout((ROWS, K), stride=(K, 1)), byte_alignment=128)
            sQK = smem.allocate_tensor(Float32, cute.make_layout((2 * K,)), byte_alignment=16)
            sV = smem.allocate_tensor(Float32, cute.make_layout((ROWS,)), byte_alignment=16)
            sDecay = smem.allocate_tensor(Float32, cute.make_layout((K,)), byte_alignment=16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((16,)), byte_alignment=16)
            sClu = mbar_norm = mbar_decay = None
            if cutlass.const_expr(S > 1):
                # Every CTA sends its RMSNorm partial (slot = its rank) to all CTAs of the cluster, and with
                # share_decays first its K / DS of the head's decays, by st.async: the K decays' 4 x K bytes
                # complete one barrier's transaction count, the S partials' 4 x S bytes the other's.
                sClu = smem.allocate_tensor(Float32, cute.make_layout((S,)), byte_alignment=16)
                mbar_decay = smem.allocate_array(Int64, 2, byte_alignment=8)
                mbar_norm = mbar_decay + 1
                if tidx == 0:
                    cute.arch.mbarrier_init(mbar_decay, 1)
                    cute.arch.mbarrier_init(mbar_norm, 1)
                    cute.arch.mbarrier_init_fence()
                    if cutlass.const_expr(DS > 1):
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar_decay, K * 4)
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar_norm, S * 4)
                # A peer's shared memory may be written only once that peer has started and initialised its
                # barrier (CUDA's rule for distributed shared memory): arrive now, wait before the send.
                cute.arch.cluster_arrive_relaxed()

            slot = Int64(mSlots[b])

            # 1. Issue the slot-independent loads: f_a, this CTA's K / DS rows of the head's f_b (warp w rows
            #    dec0 + DPW w .., half-warp `sub` odd/even rows, lane `ch` 8 of the R inputs), scalars.
            DPW = K // DS // NUM_WARPS  # decays per warp: 16, 8, 4, 2
            NI = DPW // 2  # f_b rows per half-warp
            M = NI.bit_length() - 1
            dec0 = rank * (K // DS) if DS > 1 else 0  # DS is a Python int: decided at trace time
            sub = lane // 16
            ch = lane % 16
            fa = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(cute.local_tile(mProj[b, None], (8,), ((4 * P) // 8 + ch,)), fa)
            fbs = []
            for i in cutlass.range_constexpr(NI):
                fb = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(mFb[h * K + dec0 + warp * DPW + 2 * i + sub, None], (8,), (ch,)),
                                  fb)
                fbs.append(fb)
            # the f_b row whose sum this lane holds after the reduction; one lane of each row writes the decay
            frow = dec0 + warp * DPW + 2 * ((lane >> (4 - M)) & (NI - 1)) + sub
            decay_writer = (lane & ((1 << (4 - M)) - 1)) == 0
            dtb = mDt[h * K + frow]
            alog = mAlog[h]
            beta_logit = mProj[b, 4 * P + R + h]
            # output gate / norm weight of this lane's output row in every chunk
            gates = []
            wnorms = []
            for cc in cutlass.range_constexpr(NCH):
                orow_c = row0 + warp * RPW + cc * CH + (lane >> shift)
                gates.append(mProj[b, 3 * P + h * K + orow_c])
                wnorms.append(mOnorm[orow_c])

            # 2. Stream this CTA's state rows of (slot, head) into shared memory (cp.async, 16 B, L2 only),
            #    one commit group per chunk of rows.
            state_addr = pState.toint() + (slot * H + Int64(h)) * (K * K * 4) + Int64(row0) * (K * 4)
            gS = cute.make_tensor(
                cute.make_ptr(Float32, state_addr, cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((ROWS, K), stride=(K, 1)))
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                      num_bits_per_copy=128)
            for cc in cutlass.range_constexpr(NCH):
                for i in cutlass.range_constexpr(CH):
                    row = warp * RPW + cc * CH + i
                    cute.copy(g2s, cute.local_tile(gS[row, None], (4,), (lane,)),
                              cute.local_tile(sS[row, None], (4,), (lane,)))
                cute.arch.cp_async_commit_group()

            # 3. Short conv. Every CTA of the cluster needs all of q and k (for the L2 norms): threads
            #    0..K-1 own q channels, K..2K-1 k channels; their windows are written back by one CTA once
            #    every peer's RMSNorm partial has arrived (peers read them first). v only for this CTA's rows,
            #    written at once.
            conv_addr = pConv.toint() + slot * (3 * P * Wc * 2)
            gConv = cute.make_tensor(
                cute.make_ptr(BFloat16, conv_addr, cute.AddressSpace.gmem, assumed_align=8),
                cute.make_layout((3 * P, Wc), stride=(Wc, 1)))
            j = tidx % K
            grp = tidx // K
            ca = grp * P + h * K + j
            cv = 2 * P + h * K + row0 + tidx % ROWS  # v channel (used by threads < ROWS; loaded by all)
            la = _conv_load(gConv, mConvW, mProj, b, ca, Wc)
            lv = _conv_load(gConv, mConvW, mProj, b, cv, Wc)

            # f_b GEMV and the decay gate while the state and the windows are in flight. r is summed with
            # compensation so that, rounded to fp32 and then bf16, it is the exact product's rounding, as in
            # the reference: a plain fp32 sum rounds a few r per step the other way, and exp(A_log) turns such
            # a flip into a visibly different decay of a whole state column. Products of two bf16 are exact.
            parts = []
            for i in cutlass.range_constexpr(NI):
                acc, err = fbs[i][0].to(Float32) * fa[0].to(Float32), None
                for e in cutlass.range_constexpr(1, 8):
                    acc, t_ = _two_sum(acc, fbs[i][e].to(Float32) * fa[e].to(Float32))
                    err = t_ if err is None else err + t_
                parts.append((acc, err))
            r_sum, r_err = _transpose_reduce(parts, lane, (8, 4, 2, 1)[:M], (8, 4, 2, 1)[M:], add=_add_compensated)
            r = r_sum + r_err
            z = r.to(BFloat16).to(Float32) + dtb
            g = lower_bound * _sigmoid(cute.math.exp(alog) * z)
            decay = cute.math.exp(g)
            if cutlass.const_expr(S > 1):
                # The peers have started and initialised their barriers once the start barrier completes.
                cute.arch.cluster_wait()
            if cutlass.const_expr(DS > 1):
                if decay_writer:
                    for peer in cutlass.range_constexpr(S):
                        _send_f32(sDecay.iterator + frow, decay, mbar_decay, peer)
            elif decay_writer:
                sDecay[frow] = decay
            beta = _sigmoid(beta_logit.to(Float32))

            win_a, act = _conv_compute(la[0], la[1], la[2], Wc)
            if cutlass.const_expr(S == 1):
                cute.autovec_copy(win_a, gConv[ca, None])
            if tidx < ROWS:
                win_v, act_v = _conv_compute(lv[0], lv[1], lv[2], Wc)
                cute.autovec_copy(win_v, gConv[cv, None])
                sV[tidx] = act_v

            # 4. L2 norms of q and k (fp32), q scaled by K^-1/2.
            ss = cute.arch.warp_reduction_sum(act * act)
            if lane == 0:
                sRed[warp] = ss
            cute.arch.sync_threads()
            qss = sRed[0] + sRed[1] + sRed[2] + sRed[3]
            kss = sRed[4] + sRed[5] + sRed[6] + sRed[7]
            is_q = tidx < K
            nrm = _select(is_q, qss, kss)
            scale = _select(is_q, Float32(K ** -0.5), Float32(1.0))
            sQK[tidx] = act / cute.math.sqrt(nrm + Float32(L2_EPS)) * scale
            cute.arch.sync_threads()

            # 5. Recurrence on this lane's 4 columns of the warp's rows.
            qv = cute.make_rmem_tensor((4,), Float32)
            kv = cute.make_rmem_tensor((4,), Float32)
            dv = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(cute.local_tile(sQK, (4,), (lane,)), qv)
            cute.autovec_copy(cute.local_tile(sQK, (4,), (K // 4 + lane,)), kv)
            if cutlass.const_expr(DS > 1):
                while not cute.arch.mbarrier_test_wait(mbar_decay, 0):  # spin: try_wait's suspend hint may wake late
                    pass
            cute.autovec_copy(cute.local_tile(sDecay, (4,), (lane,)), dv)
            # 5. Recurrence, chunk by chunk as the rows land (each thread waits for its own copies only).
            sq_acc = Float32(0.0)
            obs = []
            owner = (lane & ((1 << shift) - 1)) == 0
            for cc in cutlass.range_constexpr(NCH):
                cute.arch.cp_async_wait_group(NCH - 1 - cc)
                parts = []
                for i in cutlass.range_constexpr(CH):
                    row = warp * RPW + cc * CH + i
                    st = cute.make_rmem_tensor((4,), Float32)
                    cute.autovec_copy(cute.local_tile(sS[row, None], (4,), (lane,)), st)
                    acc = (st[0] * dv[0]) * kv[0]
                    for e in cutlass.range_constexpr(1, 4):
                        acc = acc + (st[e] * dv[e]) * kv[e]
                    parts.append(acc)
                sk = _transpose_reduce(parts, lane, offsets, final)
                lrow = warp * RPW + cc * CH + (lane >> shift)
                u = beta * (sV[lrow] - sk)
                # Re-read the rows from shared memory in the second pass rather than keeping them live
                # across the reduction (fewer registers).
                cute.arch.sync_warp()
                parts = []
                for i in cutlass.range_constexpr(CH):
                    row = warp * RPW + cc * CH + i
                    ui = cute.arch.shuffle_sync(u, i << shift)
                    st = cute.make_rmem_tensor((4,), Float32)
                    cute.autovec_copy(cute.local_tile(sS[row, None], (4,), (lane,)), st)
                    sn = cute.make_rmem_tensor((4,), Float32)
                    for e in cutlass.range_constexpr(4):
                        sn[e] = st[e] * dv[e] + ui * kv[e]
                    cute.autovec_copy(sn, cute.local_tile(gS[row, None], (4,), (lane,)))
                    acc = sn[0] * qv[0]
                    for e in cutlass.range_constexpr(1, 4):
                        acc = acc + sn[e] * qv[e]
                    parts.append(acc)
                o = _transpose_reduce(parts, lane, offsets, final)
                ob = o.to(BFloat16).to(Float32)
                obs.append(ob)
                sq_acc = sq_acc + _select(owner, ob * ob, Float32(0.0))

            # 6. Gated RMSNorm over the head's V outputs (bf16-rounded o, fp32 math).
            sq = cute.arch.warp_reduction_sum(sq_acc)
            if lane == 0:
                sRed[NUM_WARPS + warp] = sq
            cute.arch.sync_threads()
            tot = sRed[NUM_WARPS]
            for wi in cutlass.range_constexpr(1, NUM_WARPS):
                tot = tot + sRed[NUM_WARPS + wi]
            if cutlass.const_expr(S > 1):
                # Every CTA sends its partial to every CTA of the cluster (slot = its rank), then all wait.
                if tidx < S:
                    _send_f32(sClu.iterator + rank, tot, mbar_norm, tidx)
                while not cute.arch.mbarrier_test_wait(mbar_norm, 0):  # spin: try_wait's suspend hint may wake late
                    pass
                tot = sClu[0]
                for ri in cutlass.range_constexpr(1, S):
                    tot = tot + sClu[ri]
                if (j // ROWS) == rank:  # all peers have read the old q/k windows: write them back
                    cute.autovec_copy(win_a, gConv[ca, None])
            rstd = cute.math.rsqrt(tot / Float32(K) + norm_eps)
            for cc in cutlass.range_constexpr(NCH):
                y = obs[cc] * rstd * wnorms[cc] * _sigmoid(gates[cc].to(Float32))
                if owner:
                    mOut[b, h * K + row0 + warp * RPW + cc * CH + (lane >> shift)] = y.to(BFloat16)


def default_v_split(heads: int, batch: int, sm_count: int = H200_SMS) -> int:
    """CTAs per (head, sequence): split the state rows over a cluster while (head, sequence) pairs are
    too few to give every SM work (8 while that is still one CTA per SM); whole tiles once they are plenty."""
    pairs = heads * batch
    if pairs * 8 <= sm_count:
        return 8
    if pairs * 4 <= 2 * sm_count:
        return 4
    if pairs * 2 <= 3 * sm_count:
        return 2
    return 1


def slot_type(name: str):
    """The DSL integer type of a slot dtype name ('int32', 'int64')."""
    return {"int32": Int32, "int64": Int64}[name]


def launch_args(cfg: KDADecodeConfig, proj: int, conv_state: int, ssm_state: int, slots: int, conv_weight: int,
                f_b: int, a_log: int, dt_bias: int, o_norm: int, out: int, batch: int, lower_bound: float,
                norm_eps: float, stream: int):
    """The kernel's arguments for device addresses, the batch size, the gate's lower bound, the norm's epsilon
    and a CUDA stream handle."""
    gmem = cute.AddressSpace.gmem
    slot_t = slot_type(cfg.slot_dtype)
    return (
        _runtime_make_ptr(BFloat16, proj, gmem, assumed_align=16),
        _runtime_make_ptr(BFloat16, conv_state, gmem, assumed_align=16),
        _runtime_make_ptr(Float32, ssm_state, gmem, assumed_align=16),
        _runtime_make_ptr(slot_t, slots, gmem, assumed_align=slot_t.width // 8),
        _runtime_make_ptr(Float32, conv_weight, gmem, assumed_align=16),
        _runtime_make_ptr(BFloat16, f_b, gmem, assumed_align=16),
        _runtime_make_ptr(Float32, a_log, gmem, assumed_align=4),
        _runtime_make_ptr(Float32, dt_bias, gmem, assumed_align=4),
        _runtime_make_ptr(Float32, o_norm, gmem, assumed_align=4),
        _runtime_make_ptr(BFloat16, out, gmem, assumed_align=4),
        Int32(batch), Float32(lower_bound), Float32(norm_eps), cuda.CUstream(stream),
    )


def fake_args(cfg: KDADecodeConfig):
    """Null pointers and scalars with the kernel's argument types, for compiling without a GPU."""
    return launch_args(cfg, *([0] * 10), 1, -5.0, 1e-5, 0)


def compile_kernel(cfg: KDADecodeConfig, options: str = ""):
    """cute.compile the kernel for cfg (for the arch the DSL targets in this process)."""
    require_dsl(DSL.error)
    return cute.compile(KDADecodeKernel(cfg), *fake_args(cfg), options=options)


def compile_report(cfg: KDADecodeConfig, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, smem)."""
    require_dsl(DSL.error)
    return compile_for_arch(KDADecodeKernel(cfg), *fake_args(cfg), arch=arch, dynamic_smem_bytes=cfg.smem_bytes,
                            **kw)
