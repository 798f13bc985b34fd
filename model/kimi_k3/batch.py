"""What one forward step computes: tokens grouped by sequence, each sequence bound to a cache slot."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch


class StepKind(str, Enum):
    PREFILL = "prefill"  # every sequence brings new prompt tokens
    DECODE = "decode"  # one new token per sequence, all with cached context
    VERIFY = "verify"  # 1 + spec_tokens tokens per sequence (speculative verification)
    MIXED = "mixed"  # prefill and decode sequences in one step


@dataclass(frozen=True)
class StepBatch:
    """Flat token layout: sequence i owns tokens [starts[i], starts[i] + query_lens[i])."""

    slots: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens already cached for each sequence before this step
    spec_tokens: int = 0  # > 0 marks a verification step
    _tensors: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)
    _pass: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.query_lens) == len(self.context_lens)):
            raise ValueError("StepBatch: slots, query_lens and context_lens differ in length")
        if any(q < 1 for q in self.query_lens):
            raise ValueError("StepBatch: every sequence needs at least one new token")
        if self.spec_tokens and any(q != 1 + self.spec_tokens for q in self.query_lens):
            raise ValueError("StepBatch: a verification step has 1 + spec_tokens tokens per sequence")

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def kind(self) -> StepKind:
        if self.spec_tokens:
            return StepKind.VERIFY
        decode = [q == 1 and c > 0 for q, c in zip(self.query_lens, self.context_lens)]
        if all(decode):
            return StepKind.DECODE
        return StepKind.MIXED if any(decode) else StepKind.PREFILL

    @property
    def starts(self) -> list[int]:
        out, pos = [], 0
        for q in self.query_lens:
            out.append(pos)
            pos += q
        return out

    def slot_tensor(self, device: torch.device | str) -> torch.Tensor:
        return self._on(device, "slots", lambda: self.slots)

    def token_slots(self, device: torch.device | str) -> torch.Tensor:
        """Each token's cache slot [T]."""
        return self._on(device, "token_slots",
                        lambda: [s for s, n in zip(self.slots, self.query_lens) for _ in range(n)])

    def token_positions(self, device: torch.device | str) -> torch.Tensor:
        """Each token's position in its sequence [T] (the cached context counts)."""
        return self._on(device, "token_positions",
                        lambda: [c + i for c, n in zip(self.context_lens, self.query_lens) for i in range(n)])

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Open one forward pass over the batch: `per_pass` tensors are made once in it and shared by its layers."""
        self._pass.clear()
        self._pass[None] = True  # open
        try:
            yield
        finally:
            self._pass.clear()

    def per_pass(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor the same for every layer of a pass (an MLA block table, say), made by the pass's first layer
        that asks: one set of index kernels a step, not one a layer. Kept for the open pass only, never across
        passes: a CUDA graph captures the pass, so the tensor must be made by kernels inside it (one made in a
        warm-up pass would be replayed stale when the batch's index tensors take the next step's values).
        Outside a pass (a layer run alone) it is made at every call."""
        if not self._pass:
            return make()
        if name not in self._pass:
            self._pass[name] = make()
        return self._pass[name]

    def _on(self, device: torch.device | str, name: str, values) -> torch.Tensor:
        """An int64 index tensor on `device`, made once per batch: a step captured in a CUDA graph after a warm-up
        run then copies nothing from the host (a host-to-device copy cannot be captured). Read-only by contract."""
        key = (name, str(torch.device(device)))
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(values(), dtype=torch.int64, device=device)
        return self._tensors[key]
