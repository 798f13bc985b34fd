"""Block Attention Residuals (spec §2): a softmax mix of earlier block sums and the running partial sum."""

from __future__ import annotations

import torch

from .module import Weighted
from .parallel import TP
from .weights import single


def attn_res(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """sources: m tensors [T, D]. Scores l_i = <s_i / rms(s_i), norm_w * proj_w>; the output mixes the
    un-normalized sources in fp32 with softmax(l) and is returned in the sources' dtype."""
    s = torch.stack([x.float() for x in sources])  # [m, T, D]
    w = norm_w.float() * proj_w.float().reshape(-1)
    logits = (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps) * w).sum(-1)  # [m, T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * s).sum(0).to(sources[0].dtype)


class AttnResWeights(Weighted):
    """`{name}_norm.weight` [D] and `{name}_proj.weight` [1, D], replicated on every rank."""

    def __init__(self, ckpt_prefix: str, name: str, hidden: int, eps: float, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        self.eps = eps
        self.declare(single("norm", f"{ckpt_prefix}{name}_norm.weight", (hidden,), torch.bfloat16, "ones"))
        self.declare(single("proj", f"{ckpt_prefix}{name}_proj.weight", (1, hidden), torch.bfloat16, "res_proj"))

    def forward(self, sources: list[torch.Tensor], ops) -> torch.Tensor:
        return ops.call("attn_res", sources, self.norm, self.proj, self.eps)
