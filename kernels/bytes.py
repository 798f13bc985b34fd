"""Byte spans of tensors and a grid-stride byte copy for CuTe DSL kernels: what copies a tensor's storage whatever its
layout (a strided, offset view's gaps included), at any alignment.

    span(t)                                    # t's bytes, first element to last, as a uint8 view of its storage
    copy_bytes(mSrc, mDst, nbytes, ctas, threads)   # inside a @cute.kernel: thread-per-byte grid-stride copy
"""

from __future__ import annotations

import functools

import torch


def span(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`'s storage from its first element to one past its last (a view's gaps included), as uint8."""
    if t.numel() == 0:
        return t.new_empty(0, dtype=torch.uint8)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.new_empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                  (extent * t.element_size(),), (1,))


@functools.cache
def _copy_bytes():
    from kernels.cute import import_cutlass

    _, cute = import_cutlass()
    from cutlass import Int64

    @cute.jit
    def copy(mSrc: cute.Tensor, mDst: cute.Tensor, nbytes: Int64, ctas: int, threads: int):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = Int64(bidx * threads + tidx)
        while i < nbytes:
            mDst[i] = mSrc[i]
            i += ctas * threads

    return copy


def copy_bytes(mSrc, mDst, nbytes, ctas: int, threads: int) -> None:
    """mDst[i] = mSrc[i] for i < nbytes, one byte a thread a step over a grid of `ctas` x `threads` (called inside a
    @cute.kernel launched with that grid; the DSL is imported on the first call, so `span` needs torch only)."""
    _copy_bytes()(mSrc, mDst, nbytes, ctas, threads)
