"""The router split across TP ranks (issue 20, item 1): each rank scores E / tp experts, one all-gather of candidates.

    ids, weights = moe_route_tp(x, gate_w_local, bias_local, top_k, renormalize, scaling, tp)

Rank r holds rows [r E / tp, (r + 1) E / tp) of the router weight and of the correction bias (`local_rows`). It
computes its experts' scores and choice keys as the single-rank reference does (SPEC.md §5, steps 1-3) and keeps
its local top-k candidates: the global top-k is a subset of the union of the ranks' top-k, since an expert beaten
by k experts of its own rank is beaten by at least k overall. The candidates (key, un-biased score, expert id)
travel in one all-gather of a [T, k, 3] fp32 tensor (ids below 2^24 are exact in fp32); every rank then takes the
same global top-k of the tp x k candidates and weighs them as the reference does (steps 5-7).

On a CUDA tensor where the CuTe DSL kernel can take the call, the candidates come from its fused local form
(`moe_route_local_cute`, model/kimi_k3/specialized/moe_route/: the GEMV, sigmoid and local top-k in one launch,
the same [T, k, 3] format); elsewhere (CPU, no DSL, outside its envelope) from `local_candidates` in torch.

Ties go to the lower expert id, at both levels (`top_k_lowest_id`), so the result is the single-rank selection
whenever the ranks' keys are the single-rank keys: the same ids in the same order. (`torch.topk`, which the
reference uses, leaves the order of equal keys unspecified.) Not wired into the model yet: the layer still
replicates the router.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import TP
from .moe_route import route_weights, router_scores

FIELDS = 3  # key, score, id


def local_rows(n: int, tp: TP) -> slice:
    """The rows of an [n, ...] router tensor that rank tp.rank holds."""
    if n % tp.size:
        raise ValueError(f"{n} experts do not split over {tp.size} ranks")
    size = n // tp.size
    return slice(tp.rank * size, (tp.rank + 1) * size)


def top_k_lowest_id(keys: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (along the last dim) of the k largest keys, in decreasing key order, equal keys by increasing id."""
    by_id = ids.argsort(dim=-1, stable=True)
    by_key = keys.gather(-1, by_id).argsort(dim=-1, descending=True, stable=True)
    return by_id.gather(-1, by_key[..., :k])


def local_candidates(x: torch.Tensor, gate_w_local: torch.Tensor, bias_local: torch.Tensor, top_k: int,
                     first_id: int) -> torch.Tensor:
    """This rank's top-k as [T, k, 3] fp32: (choice key, un-biased score, global expert id)."""
    scores = router_scores(x, gate_w_local)
    keys = scores + bias_local.float()
    ids = torch.arange(first_id, first_id + gate_w_local.shape[0], device=x.device).expand_as(keys)
    pick = top_k_lowest_id(keys, ids, top_k)
    return torch.stack([keys.gather(-1, pick), scores.gather(-1, pick), ids.gather(-1, pick).float()], dim=-1)


def rank_candidates(x: torch.Tensor, gate_w_local: torch.Tensor, bias_local: torch.Tensor, top_k: int,
                    first_id: int) -> torch.Tensor:
    """This rank's top-k as local_candidates returns them: from the fused kernel where it can take the call, else
    from local_candidates."""
    if x.is_cuda:
        # imported here: the kernel package loads the CuTe DSL, which CPU callers never need
        from ..specialized.moe_route import moe_route_local_cute, supports

        if supports(x, gate_w_local, bias_local, top_k):
            return moe_route_local_cute(x, gate_w_local, bias_local, top_k, first_id)
    return local_candidates(x, gate_w_local, bias_local, top_k, first_id)


def moe_route_tp(x: torch.Tensor, gate_w_local: torch.Tensor, bias_local: torch.Tensor, top_k: int,
                 renormalize: bool, scaling: float, tp: TP) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (ids [T, k] int64, weights [T, k] fp32) from this rank's E / tp experts and one all-gather;
    the same on every rank."""
    n_local = gate_w_local.shape[0]
    if bias_local.shape != (n_local,):
        raise ValueError(f"bias_local {tuple(bias_local.shape)} does not match gate_w_local's {n_local} rows")
    if not 1 <= top_k <= n_local:
        raise ValueError(f"top_k={top_k}: each rank must hold at least top_k experts, it holds {n_local}")
    if n_local * tp.size >= 2**24:
        raise ValueError("expert ids must stay exact in fp32 (below 2^24)")
    mine = rank_candidates(x, gate_w_local, bias_local, top_k, tp.rank * n_local)
    if tp.size > 1:
        parts = [torch.empty_like(mine) for _ in range(tp.size)]
        dist.all_gather(parts, mine.contiguous(), group=tp.group)
        mine = torch.cat(parts, dim=1)
    keys, scores, ids = mine.unbind(-1)
    ids = ids.long()
    pick = top_k_lowest_id(keys, ids, top_k)
    return ids.gather(-1, pick), route_weights(scores.gather(-1, pick), renormalize, scaling)
