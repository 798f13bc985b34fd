"""The harness's late writer (sm_90a, CuTe DSL): a kernel that lets the next kernel start, then writes that kernel's
inputs, as a decode step's previous kernel does under programmatic dependent launch (PDL).

    late_write(src, dst, spin_ns)   # dst's bytes <- src's, ~spin_ns after the next kernel may have started

Why. A kernel launched with PDL may start once every CTA of the kernel before it has called
`griddepcontrol.launch_dependents` (or exited), and must call `griddepcontrol.wait` before it reads anything that
kernel writes. Torch's copies never trigger early, so behind them a PDL kernel starts only at their end and a read
before the wait is never seen. This kernel triggers first thing, then spins for `spin_ns` on the global timer, then
copies: a dependent that reads its activations before waiting reads what `dst` held before (poison, in the numerics
check), one that waits reads `src`'s bytes. A dependent launched without PDL waits for this kernel's end either way.

Layout. `src` and `dst` are byte spans of equal length at any alignment (a view's storage span, gaps included):
CTAS x THREADS threads copy one byte each per step of a grid-stride loop; the check's spans are at most a few MB,
so the copy's speed does not matter, its ordering does.
"""

from __future__ import annotations

import functools

import torch

from kernels.bytes import copy_bytes
from kernels.cute import dsl_import, import_cutlass, require_dsl

with dsl_import() as DSL:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import Int64, Uint8
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr

CTAS, THREADS = 8, 256  # few CTAs: the dependent's CTAs must find SMs free to start on while this one spins
SPIN_NS = 20_000  # long enough for a dependent's CTAs to start and issue their first loads


if DSL.error is None:

    class LateWriter:
        """dst[:nbytes] = src[:nbytes] after griddepcontrol.launch_dependents and a spin of spin_ns; nbytes and
        spin_ns are runtime arguments."""

        @cute.jit
        def __call__(self, pSrc: cute.Pointer, pDst: cute.Pointer, nbytes: Int64, spin_ns: Int64,
                     stream: cuda.CUstream):
            mSrc = cute.make_tensor(pSrc, cute.make_layout(nbytes))
            mDst = cute.make_tensor(pDst, cute.make_layout(nbytes))
            self.kernel(mSrc, mDst, nbytes, spin_ns).launch(grid=[CTAS, 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mSrc: cute.Tensor, mDst: cute.Tensor, nbytes: Int64, spin_ns: Int64):
            cute.arch.griddepcontrol_launch_dependents()  # first: the next kernel may start from here on
            start = cute.arch.globaltimer()
            while cute.arch.globaltimer() - start < spin_ns:
                pass
            copy_bytes(mSrc, mDst, nbytes, CTAS, THREADS)


def launch_args(src_ptr: int, dst_ptr: int, nbytes: int, spin_ns: int, stream: int):
    """The kernel's arguments for two device byte addresses, the span's length, the spin and a CUDA stream handle."""
    gmem = cute.AddressSpace.gmem
    return (_runtime_make_ptr(Uint8, src_ptr, gmem, assumed_align=1), _runtime_make_ptr(Uint8, dst_ptr, gmem,
            assumed_align=1), Int64(nbytes), Int64(spin_ns), cuda.CUstream(stream))


def fake_args():
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 1, SPIN_NS, 0)


@functools.cache
def compiled():
    """The kernel compiled for this process's GPU (one compile: nothing in it depends on the spans)."""
    require_dsl(DSL.error)
    return cute.compile(LateWriter(), *fake_args())


def compile_report(arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (with the PTX)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    return compile_for_arch(LateWriter(), *fake_args(), arch=arch, **kw)


def late_write(src: torch.Tensor, dst: torch.Tensor, spin_ns: int = SPIN_NS) -> None:
    """Launch the late writer on the current stream: dst's bytes <- src's (two uint8 spans of one length)."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.numel() != dst.numel():
        raise ValueError(f"late_write: two uint8 spans of one length, got {src.dtype} {src.numel()} and "
                         f"{dst.dtype} {dst.numel()}")
    if dst.numel():
        compiled()(*launch_args(src.data_ptr(), dst.data_ptr(), dst.numel(), spin_ns,
                                torch.cuda.current_stream(dst.device).cuda_stream))
