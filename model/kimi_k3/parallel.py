"""Tensor-parallel context: which rank this process is and how row-parallel outputs are reduced.

World size 1 needs no process group; every collective is then the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside 0..{self.size - 1}")

    def local(self, n: int) -> int:
        """This rank's share of a dimension of size n (the config has checked divisibility)."""
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel partial over ranks (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate rank-local slices along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s tensor on every rank (in place): a decision such as the sampled tokens is taken once,
        so the ranks never drift apart (and never disagree on when a sequence stops)."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=src)
        return x

    @classmethod
    def from_torch_distributed(cls) -> "TP":
        """The TP context of the initialized default process group (size 1 when there is none)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(rank=dist.get_rank(), size=dist.get_world_size(), group=dist.group.WORLD)
