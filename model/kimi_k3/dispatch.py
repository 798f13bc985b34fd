"""Per-step choice of implementation for each decode-path op."""

from __future__ import annotations

from .batch import StepBatch
from .ops.registry import OPS


class Dispatcher:
    """Runs each op's standard implementation (the reference where there is none)."""

    def __init__(self) -> None:
        self.batch: StepBatch | None = None

    def begin_step(self, batch: StepBatch) -> None:
        self.batch = batch

    def call(self, name: str, *args, **kwargs):
        return OPS[name].standard_or_reference()(*args, **kwargs)
