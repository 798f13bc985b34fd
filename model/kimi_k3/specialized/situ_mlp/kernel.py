"""SiTU of a gate-up projection's output in one CuTe DSL launch (sm_90a): the activation between situ_mlp's two GEMMs.

    h[t, j] = SiTU(g[t, j], g[t, I + j]),  SiTU(a, b) = [beta tanh(a / beta) sigmoid(a)] [beta_lin tanh(b / beta_lin)]
    (reference: model/kimi_k3/ops/situ_mlp.py; g [T, 2I] bf16 is the gate-up GEMM's output, h [T, I] bf16)

Why a kernel. The standard runs SiTU as torch elementwise ops: 13 launches between the two cuBLAS GEMMs, each moving
a few KB at decode (the shared experts: 32.2 µs in 15 kernels of a KDA layer's 147.8 µs at batch 1, run 6). This
launch replaces the 13.

Layout. I is cut into chunks of 8 elements (16 bytes of bf16); thread j of a CTA owns chunk `blockIdx.y * threads + j`
of token `blockIdx.x`: one 16-byte load of the gate's chunk, one of the up projection's (I columns further), the
arithmetic in fp32 in the reference's order, one 16-byte store, rounded once to bf16. Threads past I / 8 (the last
CTA of a row) do nothing.
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
MAX_THREADS = 256


@dataclass(frozen=True)
class SituConfig:
    """Everything that changes the generated code besides I: the CTA's threads (whole warps)."""

    threads: int = 128

    @staticmethod
    def for_shape(intermediate: int) -> SituConfig:
        """One CTA a token where I / 8 chunks fit MAX_THREADS (K3's shared experts: I = 768 at TP8 -> 96 threads,
        384 at TP16 -> 64), rounded up to whole warps; else MAX_THREADS and more CTAs a token."""
        chunks = intermediate // VEC
        return SituConfig(min(MAX_THREADS, -(-chunks // WARP) * WARP))

    def ctas_per_token(self, intermediate: int) -> int:
        return -(-(intermediate // VEC) // self.threads)

    def check(self, intermediate: int) -> None:
        """ValueError where I does not fit this config."""
        if self.threads % WARP or not WARP <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads {self.threads}: whole warps, {WARP}..{MAX_THREADS}")
        if intermediate <= 0 or intermediate % VEC:
            raise ValueError(f"intermediate {intermediate}: a positive multiple of {VEC}")


if DSL.error is None:

    class SituKernel:
        """h[T, I] = SiTU(g[:, :I], g[:, I:]) for one config and I (baked in: the up half's offset and the guard);
        T, beta and beta_lin are runtime arguments."""

        def __init__(self, cfg: SituConfig, intermediate: int):
            cfg.check(intermediate)
            self.cfg, self.i = cfg, intermediate

        @cute.jit
        def __call__(self, pGateUp: cute.Pointer, pOut: cute.Pointer, tokens: Int32, beta: Float32,
                     beta_lin: Float32, stream: cuda.CUstream):
            width = self.i
            mGateUp = cute.make_tensor(pGateUp, cute.make_layout((tokens, 2 * width), stride=(2 * width, 1)))
            mOut = cute.make_tensor(pOut, cute.make_layout((tokens, width), stride=(width, 1)))
            self.kernel(mGateUp, mOut, beta, beta_lin).launch(
                grid=[tokens, self.cfg.ctas_per_token(width), 1], block=[self.cfg.threads, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mGateUp: cute.Tensor, mOut: cute.Tensor, beta: Float32, beta_lin: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            token, part, _ = cute.arch.block_idx()
            chunk = part * self.cfg.threads + tidx
            if chunk < self.i // VEC:
                row = mGateUp[token, None]
                a = cute.local_tile(row, (VEC,), (chunk,)).load().to(Float32)
                b = cute.local_tile(row, (VEC,), (chunk + self.i // VEC,)).load().to(Float32)
                h = cute.make_rmem_tensor((VEC,), Float32)
                for e in cutlass.range_constexpr(VEC):
                    # the reference's order: (beta tanh(a / beta)) sigmoid(a), times beta_lin tanh(b / beta_lin)
                    sigmoid = Float32(1.0) / (Float32(1.0) + cute.math.exp(-a[e]))
                    h[e] = beta * cute.math.tanh(a[e] / beta) * sigmoid * (beta_lin * cute.math.tanh(b[e] / beta_lin))
                cute.local_tile(mOut[token, None], (VEC,), (chunk,)).store(h.load().to(BFloat16))


def launch_args(gate_up_ptr: int, out_ptr: int, tokens: int, beta: float, beta_lin: float, stream: int):
    """The kernel's arguments for device addresses (both 16-byte aligned), the token count, the two betas and a CUDA
    stream handle."""
    gmem = cute.AddressSpace.gmem
    return (_runtime_make_ptr(BFloat16, gate_up_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(BFloat16, out_ptr, gmem, assumed_align=16),
            Int32(tokens), Float32(beta), Float32(beta_lin), cuda.CUstream(stream))


def fake_args():
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 1, 4.0, 25.0, 0)


def compile_kernel(cfg: SituConfig, intermediate: int, options: str = ""):
    """cute.compile the kernel for (cfg, I), for the arch the DSL targets in this process."""
    require_dsl(DSL.error)
    return cute.compile(SituKernel(cfg, intermediate), *fake_args(), options=options)


def compile_report(cfg: SituConfig, intermediate: int, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    return compile_for_arch(SituKernel(cfg, intermediate), *fake_args(), arch=arch, **kw)
