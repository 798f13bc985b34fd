"""The Block AttnRes mix in one CuTe DSL launch (sm_90a): a softmax over m sources, per token.

    out[t] = sum_i alpha_i s_i[t],  alpha = softmax_i(<s_i[t], norm_w * proj_w> / rms(s_i[t]))
    rms(x) = sqrt(mean(x^2) + eps)        (reference: model/kimi_k3/ops/attn_res.py)

Why one launch. The standard is a torch composition of about ten kernels a call (a stack of the sources, its fp32
copy, a fused rms_norm, a sum, a softmax, a weighted sum, a cast); at decode each moves a few hundred KB at most,
so the call's time is its launches' (~28 µs a call in a decode step on the H200, 56 µs of a KDA layer's 205 µs at
batch 1; model/kimi_k3/bench/NOTES.md, run 4). The op reads each source once and writes the mix: m + 1 rows of D
bf16 a token, 129 KB at m = 9, D = 7168 (0.03 µs at 4.3 TB/s): whatever this launch costs is latency.

Layout. One CTA a token (grid T). D is cut into chunks of 8 elements (16 bytes of bf16); thread j of the CTA's
`threads` owns chunks j, j + threads, ... (`chunks_per_thread` of them: D / 8 = threads x chunks_per_thread, exactly).
A thread loads its chunks of every source (all loads issued before any use: m x chunks_per_thread 16-byte loads in
flight) and of norm_w and proj_w, then:
1. per source i, its partial sum of squares and its partial dot with w = norm_w * proj_w (fp32; w exact: a product
   of two bf16 values), in chunk order;
2. the CTA's sums: a butterfly in each warp, the warps' sums in shared memory, then thread i < m adds them in warp
   order and stores score_i = dot_i * rsqrt(ss_i / D + eps) (the reference's <s / rms(s), w> with the scale
   applied once to the dot, as attn_res_fused does);
3. every thread reads the m scores, takes alpha = softmax (max subtracted, exp, divided by the sum, in source
   order), loads its chunks of the sources again (from the L1 / L2: all m sources in fp32 would not fit the
   register file at m = 9) and writes its chunks of sum_i alpha_i s_i in fp32, rounded once to bf16.
Deterministic: fixed orders everywhere, no atomics. Every source is read from DRAM once.

The fused input norm (`AttnResNormKernel`, op attn_res_norm): every sublayer of a decoder layer normalizes the mix
before it reads it (SPEC.md §2: h = AttnRes(...), then RMSNorm(h)), and nothing else reads h. So the same CTA goes on
instead of storing h: it rounds its chunks of the mix to bf16 (h exactly as attn_res returns it, so the composition's
rounding is kept), sums their squares in fp32, and after a third barrier every thread scales its chunks by
rsqrt(sum / D + eps') and the norm weight, in the reference's order ((h * rstd) * w), and stores them as bf16. One
launch and one barrier instead of a second kernel (~2 µs between dependent kernels in a decode step's graph).

The partial sum's add (`AttnResNormKernel` with `addend`): a decoder layer adds to its running partial sum (the
previous FFN's output before the attention sublayer, the attention's output before the MLP) and then mixes the new
partial as the last source; the sum is needed again (the next add, a block). So the kernel may take the addend and
sum it into the last source itself, in fp32 rounded once to bf16 (torch's bf16 add exactly), store that sum as a
second output, and mix it: one launch instead of the add's. Step 3 takes the last source from the sum the thread
keeps in registers (4 a chunk, packed bf16), not from the two tensors again.

Arguments. The m sources arrive as a tuple of m pointers (each source its own tensor: the model keeps the block
sums and the running partial apart), rows of D contiguous elements, row stride D (the entry point checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.cute import dsl_import, import_cutlass, require_dsl

with dsl_import() as DSL:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr

VEC = 8  # bf16 elements a chunk (one 16-byte load)
WARP = 32
MAX_SOURCES = 9  # K3's 8 blocks before the last layer, plus the running partial
MAX_THREADS = 512


@dataclass(frozen=True)
class AttnResConfig:
    """Everything that changes the generated code besides m and D: how many 16-byte chunks of D a thread owns."""

    chunks_per_thread: int = 2

    @staticmethod
    def for_shape(hidden: int) -> AttnResConfig:
        """The fewest chunks a thread (the most threads, the most loads in flight across the CTA) that keep the CTA
        at whole warps and at most MAX_THREADS threads: 2 at K3's D = 7168 (448 threads)."""
        chunks = hidden // VEC
        for c in range(1, chunks + 1):
            if chunks % c == 0 and chunks // c <= MAX_THREADS and (chunks // c) % WARP == 0:
                return AttnResConfig(c)
        raise ValueError(f"hidden {hidden}: no whole-warp CTA of at most {MAX_THREADS} threads covers its "
                         f"{chunks} chunks of {VEC}")

    def threads(self, hidden: int) -> int:
        return hidden // VEC // self.chunks_per_thread

    def check(self, sources: int, hidden: int) -> None:
        """ValueError where (m, D) do not fit this config."""
        if not 1 <= sources <= MAX_SOURCES:
            raise ValueError(f"sources {sources}: 1..{MAX_SOURCES}")
        if hidden <= 0 or hidden % (VEC * self.chunks_per_thread):
            raise ValueError(f"hidden {hidden}: a positive multiple of {VEC * self.chunks_per_thread}")
        threads = self.threads(hidden)
        if threads % WARP or threads > MAX_THREADS:
            raise ValueError(f"hidden {hidden}: {threads} threads a CTA, not whole warps up to {MAX_THREADS}")


if DSL.error is None:

    class AttnResKernel:
        """out[T, D] = the AttnRes mix of m sources [T, D] for one config, m and D (baked in: they fix the unrolled
        loads and the register arrays); T is a runtime argument (the grid)."""

        def __init__(self, cfg: AttnResConfig, sources: int, hidden: int):
            cfg.check(sources, hidden)
            self.cfg, self.m, self.d = cfg, sources, hidden
            self.threads = cfg.threads(hidden)

        @cute.jit
        def __call__(self, pSources: tuple, pNorm: cute.Pointer, pProj: cute.Pointer, pOut: cute.Pointer,
                     tokens: Int32, eps: Float32, stream: cuda.CUstream):
            D = self.d
            rows = cute.make_layout((tokens, D), stride=(D, 1))
            mSources = [cute.make_tensor(pSources[i], rows) for i in range(self.m)]
            mNorm = cute.make_tensor(pNorm, cute.make_layout((D,)))
            mProj = cute.make_tensor(pProj, cute.make_layout((D,)))
            mOut = cute.make_tensor(pOut, rows)
            self.kernel(mSources, mNorm, mProj, mOut, eps).launch(grid=[tokens, 1, 1], block=[self.threads, 1, 1],
                                                                  stream=stream)

        @cute.kernel
        def kernel(self, mSources: list, mNorm: cute.Tensor, mProj: cute.Tensor, mOut: cute.Tensor, eps: Float32):
            token, _, _ = cute.arch.block_idx()
            mix = self.mix(mSources, mNorm, mProj, eps, token, cutlass.memory.SmemAllocator())
            for j, chunk in enumerate(self.chunks()):
                cute.local_tile(mOut[token, None], (VEC,), (chunk,)).store(mix[j].load().to(BFloat16))

        def chunks(self) -> list:
            """The thread's chunks of D, in order: j-th is tidx + j * threads."""
            tidx, _, _ = cute.arch.thread_idx()
            return [tidx + j * self.threads for j in range(self.cfg.chunks_per_thread)]

        @cute.jit
        def cta_sum(self, values: list, smem_sums: cute.Tensor) -> None:
            """Sum each of the values over the CTA into smem_sums[0, :] ... [warps - 1, :] (one row a warp, after a
            butterfly in each warp); the caller syncs, then adds the rows in warp order (deterministic)."""
            lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
            for i, v in enumerate(values):
                for off in (16, 8, 4, 2, 1):
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
                if lane == 0:
                    smem_sums[warp, i] = v

        @cute.jit
        def mix(self, mSources: list, mNorm: cute.Tensor, mProj: cute.Tensor, eps: Float32, token, smem,
                mAddend: cute.Tensor | None = None, mSum: cute.Tensor | None = None) -> list:
            """Steps 1-3 of the module doc for one token: the thread's chunks of the mix, fp32 (C register tensors of
            VEC), before any rounding. With `mAddend`, the last source is mSources[-1] + mAddend rounded to bf16,
            stored to `mSum` (the module doc's partial sum's add). Traced inline into each kernel that calls it; its
            shared memory comes from the kernel's one allocator `smem` (a second allocator would start at the same
            address)."""
            M, C, D = self.m, self.cfg.chunks_per_thread, self.d
            warps = self.threads // WARP
            tidx, _, _ = cute.arch.thread_idx()
            sSums = smem.allocate_tensor(Float32, cute.make_layout((warps, 2 * M), stride=(2 * M, 1)),
                                         byte_alignment=16)
            sScore = smem.allocate_tensor(Float32, cute.make_layout((M,)), byte_alignment=16)
            chunks = self.chunks()
            # every load first (the sources' as packed bf16, then the weights'), so that all are in flight together
            x = [[cute.local_tile(mSources[i][token, None], (VEC,), (chunks[j],)).load() for j in range(C)]
                 for i in range(M)]
            added = ([] if cutlass.const_expr(mAddend is None)
                     else [cute.local_tile(mAddend[token, None], (VEC,), (chunks[j],)).load() for j in range(C)])
            norm = [cute.local_tile(mNorm, (VEC,), (chunks[j],)).load().to(Float32) for j in range(C)]
            proj = [cute.local_tile(mProj, (VEC,), (chunks[j],)).load().to(Float32) for j in range(C)]
            w = [[norm[j][e] * proj[j][e] for e in range(VEC)] for j in range(C)]
            if cutlass.const_expr(mAddend is not None):
                for j in cutlass.range_constexpr(C):
                    x[M - 1][j] = (x[M - 1][j].to(Float32) + added[j].to(Float32)).to(BFloat16)
                    cute.local_tile(mSum[token, None], (VEC,), (chunks[j],)).store(x[M - 1][j])
            # 1. the thread's partial sum of squares and dot with w, per source, in chunk order (each source widened
            # to fp32 only here: all m sources in fp32 would not fit the register file at m = 9)
            partial = []
            for i in cutlass.range_constexpr(M):
                ss = Float32(0.0)
                dot = Float32(0.0)
                for j in cutlass.range_constexpr(C):
                    xf = x[i][j].to(Float32)
                    for e in cutlass.range_constexpr(VEC):
                        ss = ss + xf[e] * xf[e]
                        dot = dot + xf[e] * w[j][e]
                partial += [ss, dot]
            # 2. the CTA's sums: a butterfly in each warp, the warps' sums in shared memory, then thread i < m adds
            # them in warp order
            self.cta_sum(partial, sSums)
            cute.arch.sync_threads()
            if tidx < M:
                ss = sSums[0, 2 * tidx]
                dot = sSums[0, 2 * tidx + 1]
                for other in cutlass.range_constexpr(1, warps):
                    ss = ss + sSums[other, 2 * tidx]
                    dot = dot + sSums[other, 2 * tidx + 1]
                sScore[tidx] = dot * cute.math.rsqrt(ss / Float32(D) + eps)
            cute.arch.sync_threads()
            # 3. alpha = softmax over the sources (each thread the same arithmetic), then the mix in fp32
            scores = [sScore[i] for i in range(M)]
            top = scores[0]
            for i in cutlass.range_constexpr(1, M):
                top = cutlass.max(top, scores[i])
            weights = [cute.math.exp(scores[i] - top) for i in range(M)]
            total = weights[0]
            for i in cutlass.range_constexpr(1, M):
                total = total + weights[i]
            alpha = [weights[i] / total for i in range(M)]
            # the sources again for the mix, from the L1 / L2 (a barrier lies between: the loads are not merged with
            # step 1's, whose values did not stay in registers)
            mixes = []
            for j in cutlass.range_constexpr(C):
                mix = cute.make_rmem_tensor((VEC,), Float32)
                for i in cutlass.range_constexpr(M):
                    if cutlass.const_expr(i == M - 1 and mAddend is not None):
                        xf = x[i][j].to(Float32)  # the rounded sum, kept in registers
                    else:
                        xf = cute.local_tile(mSources[i][token, None], (VEC,), (chunks[j],)).load().to(Float32)
                    for e in cutlass.range_constexpr(VEC):
                        if cutlass.const_expr(i == 0):
                            mix[e] = alpha[0] * xf[e]
                        else:
                            mix[e] = mix[e] + alpha[i] * xf[e]
                mixes.append(mix)
            return mixes

    class AttnResNormKernel(AttnResKernel):
        """out[T, D] = rms_norm(the AttnRes mix, out_w, out_eps): the mix as AttnResKernel computes it, rounded to
        bf16, normalized by the same CTA (module doc). With `addend` (baked in), the last source is first summed
        with the addend [T, D] and the rounded sum stored to a second output (the partial sum's add, module doc);
        without it the addend and sum pointers are not read."""

        def __init__(self, cfg: AttnResConfig, sources: int, hidden: int, addend: bool = False):
            super().__init__(cfg, sources, hidden)
            self.addend = addend

        @cute.jit
        def __call__(self, pSources: tuple, pNorm: cute.Pointer, pProj: cute.Pointer, pOutW: cute.Pointer,
                     pOut: cute.Pointer, pAddend: cute.Pointer, pSum: cute.Pointer, tokens: Int32, eps: Float32,
                     out_eps: Float32, stream: cuda.CUstream):
            D = self.d
            rows = cute.make_layout((tokens, D), stride=(D, 1))
            mSources = [cute.make_tensor(pSources[i], rows) for i in range(self.m)]
            mNorm = cute.make_tensor(pNorm, cute.make_layout((D,)))
            mProj = cute.make_tensor(pProj, cute.make_layout((D,)))
            mOutW = cute.make_tensor(pOutW, cute.make_layout((D,)))
            mOut = cute.make_tensor(pOut, rows)
            mAddend = cute.make_tensor(pAddend, rows) if cutlass.const_expr(self.addend) else None
            mSum = cute.make_tensor(pSum, rows) if cutlass.const_expr(self.addend) else None
            self.kernel(mSources, mNorm, mProj, mOutW, mOut, mAddend, mSum, eps, out_eps).launch(
                grid=[tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mSources: list, mNorm: cute.Tensor, mProj: cute.Tensor, mOutW: cute.Tensor,
                   mOut: cute.Tensor, mAddend: cute.Tensor | None, mSum: cute.Tensor | None, eps: Float32,
                   out_eps: Float32):
            C, D = self.cfg.chunks_per_thread, self.d
            warps = self.threads // WARP
            token, _, _ = cute.arch.block_idx()
            chunks = self.chunks()
            smem = cutlass.memory.SmemAllocator()
            sNorm = smem.allocate_tensor(Float32, cute.make_layout((warps, 1), stride=(1, 1)), byte_alignment=16)
            out_w = [cute.local_tile(mOutW, (VEC,), (chunk,)).load().to(Float32) for chunk in chunks]  # in flight early
            mix = self.mix(mSources, mNorm, mProj, eps, token, smem, mAddend, mSum)
            h = [mix[j].load().to(BFloat16).to(Float32) for j in range(C)]  # attn_res's bf16 output, exactly
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(C):
                for e in cutlass.range_constexpr(VEC):
                    ss = ss + h[j][e] * h[j][e]
            self.cta_sum([ss], sNorm)
            cute.arch.sync_threads()
            total = sNorm[0, 0]
            for other in cutlass.range_constexpr(1, warps):
                total = total + sNorm[other, 0]
            rstd = cute.math.rsqrt(total / Float32(D) + out_eps)
            for j in cutlass.range_constexpr(C):
                y = cute.make_rmem_tensor((VEC,), Float32)
                for e in cutlass.range_constexpr(VEC):
                    y[e] = (h[j][e] * rstd) * out_w[j][e]
                cute.local_tile(mOut[token, None], (VEC,), (chunks[j],)).store(y.load().to(BFloat16))


def launch_args(source_ptrs: tuple[int, ...], norm_ptr: int, proj_ptr: int, out_ptr: int, tokens: int, eps: float,
                stream: int, out_norm: tuple[int, float] | None = None, added: tuple[int, int] = (0, 0)):
    """The kernel's arguments for device addresses (every source, norm_w, proj_w and out 16-byte aligned), the token
    count, eps and a CUDA stream handle; `out_norm` = (the fused norm weight's address, its eps) for
    AttnResNormKernel, and `added` = (the addend's address, the sum's) where it was built with `addend` (null
    otherwise: not read)."""
    gmem = cute.AddressSpace.gmem

    def ptr(address: int):
        return _runtime_make_ptr(BFloat16, address, gmem, assumed_align=16)

    sources = tuple(ptr(p) for p in source_ptrs)
    if out_norm is None:
        return sources, ptr(norm_ptr), ptr(proj_ptr), ptr(out_ptr), Int32(tokens), Float32(eps), cuda.CUstream(stream)
    out_w_ptr, out_eps = out_norm
    return (sources, ptr(norm_ptr), ptr(proj_ptr), ptr(out_w_ptr), ptr(out_ptr), *(ptr(a) for a in added),
            Int32(tokens), Float32(eps), Float32(out_eps), cuda.CUstream(stream))


def _kernel_and_fake_args(cfg: AttnResConfig, sources: int, hidden: int, normed: bool, addend: bool):
    """The kernel object (AttnResNormKernel where `normed`, with the partial sum's add where `addend`) and null
    pointers with its argument types, for compiling without a GPU."""
    if addend and not normed:
        raise ValueError("the addend is the normalized kernel's (attn_res_norm): normed=False takes none")
    if normed:
        return (AttnResNormKernel(cfg, sources, hidden, addend),
                launch_args((0,) * sources, 0, 0, 0, 1, 1e-5, 0, out_norm=(0, 1e-5)))
    return AttnResKernel(cfg, sources, hidden), launch_args((0,) * sources, 0, 0, 0, 1, 1e-5, 0)


def compile_kernel(cfg: AttnResConfig, sources: int, hidden: int, normed: bool = False, addend: bool = False,
                   options: str = ""):
    """cute.compile the kernel for (cfg, m, D), the mix or (`normed`) the normalized mix, with or without the
    partial sum's `addend`, for the arch the DSL targets in this process."""
    require_dsl(DSL.error)
    kernel, args = _kernel_and_fake_args(cfg, sources, hidden, normed, addend)
    return cute.compile(kernel, *args, options=options)


def compile_report(cfg: AttnResConfig, sources: int, hidden: int, normed: bool = False, addend: bool = False,
                   arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    kernel, args = _kernel_and_fake_args(cfg, sources, hidden, normed, addend)
    return compile_for_arch(kernel, *args, arch=arch, **kw)
