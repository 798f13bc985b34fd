"""How each model parameter is built from checkpoint tensors, for one TP rank.

A layer declares `Binding`s next to the parameters it owns: which checkpoint tensors (`CkptTensor`, with
their full shapes) feed a parameter, along which dimension each is split across ranks, and how the rank's
slices are packed (concatenated, padded, stacked for experts). The same declarations drive the random
checkpoint writer, the loader's missing/extra/shape checks and `k3forge config show`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .parallel import TP


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor (and shapes)."""


@dataclass(frozen=True)
class CkptTensor:
    """One tensor as the Hugging Face checkpoint stores it (full, unsharded shape)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str = "linear"  # how the random-checkpoint writer draws it (see checkpoint.py)


@dataclass(frozen=True)
class Part:
    """A rank's slice of one checkpoint tensor."""

    tensor: CkptTensor
    shard_dim: int | None = None  # None: replicated, every rank reads all of it
    local_size: int | None = None  # zero-pad the rank's slice to this size along shard_dim
    extent: int | None = None  # only the first `extent` entries along shard_dim are real (A_log's padding)

    def _rank_len(self, tp: TP) -> int:
        return (self.extent or self.tensor.shape[self.shard_dim]) // tp.size

    def local_shape(self, tp: TP) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] = self.local_size or self._rank_len(tp)
        return tuple(shape)

    def read(self, get_slice: Callable[[str], object], tp: TP) -> torch.Tensor:
        """Read only this rank's slice of the tensor (safetensors slices lazily)."""
        sl = get_slice(self.tensor.name)
        if self.shard_dim is None:
            return sl[:]
        n = self._rank_len(tp)
        index = [slice(None)] * len(self.tensor.shape)
        index[self.shard_dim] = slice(tp.rank * n, (tp.rank + 1) * n)
        t = sl[tuple(index)]
        if self.local_size and self.local_size > n:
            pad_shape = list(t.shape)
            pad_shape[self.shard_dim] = self.local_size - n
            t = torch.cat([t, t.new_zeros(pad_shape)], dim=self.shard_dim)
        return t


@dataclass(frozen=True)
class Binding:
    """A parameter (or one row of a stacked parameter) = its parts concatenated along dim 0, then zero rows."""

    param: str
    parts: tuple[Part, ...]
    index: int | None = None  # row of a stacked parameter, e.g. one expert of [E, ...]
    pad_rows: int = 0

    def local_shape(self, tp: TP) -> tuple[int, ...]:
        shapes = [p.local_shape(tp) for p in self.parts]
        rows = sum(s[0] for s in shapes) + self.pad_rows
        return (rows, *shapes[0][1:])

    def read(self, get_slice: Callable[[str], object], tp: TP) -> torch.Tensor:
        tensors = [p.read(get_slice, tp) for p in self.parts]
        if self.pad_rows:
            tensors.append(tensors[0].new_zeros((self.pad_rows, *tensors[0].shape[1:])))
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def single(param: str, name: str, shape: tuple[int, ...], dtype: torch.dtype, init: str = "linear",
           shard_dim: int | None = None) -> Binding:
    """The common case: one parameter from one checkpoint tensor."""
    return Binding(param, (Part(CkptTensor(name, shape, dtype, init), shard_dim),))


@dataclass
class BindingSet:
    """Bindings of a module tree with their parameter and checkpoint prefixes applied."""

    items: list[Binding] = field(default_factory=list)

    def add(self, bindings: list[Binding], param_prefix: str, ckpt_prefix: str) -> None:
        for b in bindings:
            parts = tuple(
                Part(CkptTensor(ckpt_prefix + p.tensor.name, p.tensor.shape, p.tensor.dtype, p.tensor.init),
                     p.shard_dim, p.local_size, p.extent)
                for p in b.parts
            )
            self.items.append(Binding(param_prefix + b.param, parts, b.index, b.pad_rows))

    def checkpoint_tensors(self) -> dict[str, CkptTensor]:
        out: dict[str, CkptTensor] = {}
        for b in self.items:
            for p in b.parts:
                out[p.tensor.name] = p.tensor
        return out
