"""AttnRes mix as one batched computation: a CPU-portable torch composition, NOT a GPU kernel.

It exists so that the whole path contract -> dispatch -> fallback -> gate runs in CPU CI with a real
specialized op: the tests' CPU example (`tests/gates/fixtures/cpu_example/attn_res.yaml`) validates it on arch
`cpu` only. The repository's `contracts/attn_res.yaml` is the GPU kernel's (`specialized/attn_res/`).

The reference normalizes every source before scoring it, materializing several [m, T, D] temporaries.
Here the RMS scale is applied to the score instead, since <s / rms(s), w> = <s, w> / rms(s): the scores
are one matrix-vector product and the mix one batched product, so only the stacked sources are
materialized. Same math in fp32, summed in a different order.
"""

from __future__ import annotations

import torch


def attn_res_fused(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """sources: m tensors [T, D] -> softmax-over-sources mix [T, D] in the sources' dtype (see attn_res)."""
    s = torch.stack(sources).float()  # [m, T, D]
    w = norm_w.float() * proj_w.float().reshape(-1)
    mean_square = torch.linalg.vector_norm(s, dim=-1).square() / s.shape[-1]  # [m, T]
    alpha = torch.softmax((s @ w) * torch.rsqrt(mean_square + eps), dim=0)
    return torch.einsum("mt,mtd->td", alpha, s).to(sources[0].dtype)
