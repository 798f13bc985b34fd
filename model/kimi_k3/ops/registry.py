"""The decode-path ops every layer calls through the dispatcher, with their reference implementations.

Each op has a reference (plain PyTorch, the numerics ground truth) and may have a standard
implementation (what a stock serving engine runs; on CPU the reference serves as standard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..attn_res import attn_res
from ..mla import mla_decode
from ..moe import moe_experts, route
from .kda import kda_decode


@dataclass(frozen=True)
class Op:
    name: str
    reference: Callable
    standard: Callable | None = None

    def standard_or_reference(self) -> Callable:
        return self.standard or self.reference


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("attn_res", attn_res),
        Op("kda_decode", kda_decode),
        Op("mla_decode", mla_decode),
        Op("moe_route", route),
        Op("moe_experts", moe_experts),
    )
}
