"""GPU: a KDA decode candidate whose first kernel is launched with programmatic dependent launch (PDL) and copies the
projection (its activation, which the kernel before it writes in a decode step) BEFORE griddepcontrol.wait, then
runs the reference on the copy. Every call made alone is right (nothing before it triggers early); behind a kernel
that lets it start and then writes the projection (the numerics' late writer), it reads what was there before.
`waits_then_reads` is the same with the wait first: right everywhere, and the check must pass it.
"""

from __future__ import annotations

import functools

import torch

from kernels.bytes import copy_bytes, span
from kernels.cute import import_cutlass
from model.kimi_k3.ops.kda_decode import kda_decode

cutlass, cute = import_cutlass()
import cuda.bindings.driver as cuda  # noqa: E402 - after import_cutlass has set the target
from cutlass import Int64, Uint8  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

CTAS, THREADS = 8, 256


class PdlCopy:
    def __init__(self, wait_first: bool):
        self.wait_first = wait_first

    @cute.jit
    def __call__(self, pSrc: cute.Pointer, pDst: cute.Pointer, nbytes: Int64, stream: cuda.CUstream):
        mSrc = cute.make_tensor(pSrc, cute.make_layout(nbytes))
        mDst = cute.make_tensor(pDst, cute.make_layout(nbytes))
        self.kernel(mSrc, mDst, nbytes).launch(grid=[CTAS, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                               use_pdl=True)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mDst: cute.Tensor, nbytes: Int64):
        if cutlass.const_expr(self.wait_first):
            cute.arch.griddepcontrol_wait()
        copy_bytes(mSrc, mDst, nbytes, CTAS, THREADS)
        if cutlass.const_expr(not self.wait_first):
            cute.arch.griddepcontrol_wait()


def _args(src: int, dst: int, nbytes: int, stream: int):
    gmem = cute.AddressSpace.gmem
    return (make_ptr(Uint8, src, gmem, assumed_align=1), make_ptr(Uint8, dst, gmem, assumed_align=1),
            Int64(nbytes), cuda.CUstream(stream))


@functools.cache
def _compiled(wait_first: bool):
    return cute.compile(PdlCopy(wait_first), *_args(0, 0, 1, 0))


def pdl_copy(t: torch.Tensor, wait_first: bool) -> torch.Tensor:
    """A copy of `t` (same shape and strides) made by the PDL kernel, over its storage span (kernels/, not the
    gate's late writer: the production replay reports a candidate that imports the gate)."""
    src = span(t)
    dst = torch.empty_like(src)
    _compiled(wait_first)(*_args(src.data_ptr(), dst.data_ptr(), src.numel(),
                                 torch.cuda.current_stream(t.device).cuda_stream))
    return t.new_empty(0).set_(dst.untyped_storage(), 0, t.shape, t.stride())


def kda_decode_reads_before_wait(proj, conv_state, ssm_state, slots, w):
    return kda_decode(pdl_copy(proj, wait_first=False), conv_state, ssm_state, slots, w)


def kda_decode_waits_then_reads(proj, conv_state, ssm_state, slots, w):
    return kda_decode(pdl_copy(proj, wait_first=True), conv_state, ssm_state, slots, w)
