"""Block Attention Residuals weights (SPEC.md §2); the mix itself is the op `attn_res` (ops/attn_res.py), and the mix
followed by a sublayer's input norm the op `attn_res_norm` (ops/attn_res_norm.py)."""

from __future__ import annotations

import torch

from .module import RMSNorm, Weighted
from .parallel import TP
from .weights import single


class AttnResWeights(Weighted):
    """`{name}_norm.weight` [D] and `{name}_proj.weight` [1, D], replicated on every rank."""

    def __init__(self, ckpt_prefix: str, name: str, hidden: int, eps: float, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        self.eps = eps
        self.declare(single("norm", f"{ckpt_prefix}{name}_norm.weight", (hidden,), torch.bfloat16, "ones"))
        self.declare(single("proj", f"{ckpt_prefix}{name}_proj.weight", (1, hidden), torch.bfloat16, "res_proj"))

    def forward(self, sources: list[torch.Tensor], ops) -> torch.Tensor:
        return ops.call("attn_res", sources, self.norm, self.proj, self.eps)

    def normed(self, sources: list[torch.Tensor], norm: RMSNorm, ops,
               addend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(self(sources)), the last source) as one op: a sublayer's input, where nothing else reads the mix.
        With `addend`, the last source is sources[-1] + addend (the layer's running partial sum's add, in the same
        op) and that sum is what comes back beside the input."""
        args = (sources, self.norm, self.proj, self.eps, norm.weight, norm.eps)
        if addend is None:
            return ops.call("attn_res_norm", *args), sources[-1]
        return ops.call("attn_res_norm", *args, addend)
