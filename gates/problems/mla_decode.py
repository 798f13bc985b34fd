"""MLA decode attention over the latent cache, weight-absorbed (SPEC.md §4).

    out = mla_decode(q_nope, q_pe, kv_cache, slots, lengths, w_uk, w_uv, scale)     # [B, H, 128] fp32

Shapes from the contract: `heads` (rank-local H), `kv_lora_rank` (C), `rope_dim` (R); N = V = 128, scale =
192^-1/2 (K3's). The context is not a contract shape: "normal" inputs (every benchmark set) use CONTEXTS[0] =
4K, the other distributions pick the cache's max_len from CONTEXTS by seed (32K bench points need a context key
in the benchmark schema: left for the maintainers). Lengths differ across the batch, drawn in [1, max_len], with
one sequence at 1 and one at max_len (a single sequence alternates between the two by seed, "normal" aside: the
whole context). Slots are a random permutation of a cache with SPARE_SLOTS more slots than sequences (gathered,
never in order). Only each sequence's valid rows are drawn: rows past each length and the spare slots hold
POISON, finite so that the reference's masked softmax stays exact, large so that a kernel reading them into the
softmax (or reading another slot) is visibly wrong. The cache and q follow the distribution; weights are drawn like
trained ones.

The reference is the op's math in float64 (per sequence, over its valid rows only), returned as fp32: the
checker (compare.check_tensor) then measures the candidate against exact attention, not against another fp32
summation order.
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point, part_distribution, sample
from model.kimi_k3.ops.mla_decode import OP

SHAPE_KEYS = ("heads", "kv_lora_rank", "rope_dim")
NOPE = VALUE = 128
SCALE = 192 ** -0.5
CONTEXTS = (4096, 1000, 32768)
SPARE_SLOTS = 2
POISON = 256.0

check = check_tensor


def reference(q_nope, q_pe, kv_cache, slots, lengths, w_uk, w_uv, scale, kv_scale: float = 1.0) -> torch.Tensor:
    """The op in float64 over each sequence's valid rows (each entry times kv_scale: the FP8 cache's); [B, H, V]
    fp32."""
    c = w_uk.shape[-1]
    outs = []
    for i in range(q_nope.shape[0]):
        entries = kv_cache[slots[i], : int(lengths[i])].double() * kv_scale  # [n, C + R]
        q_lat = torch.einsum("hn,hnc->hc", q_nope[i].double(), w_uk.double())
        query = torch.cat([q_lat, q_pe[i].double()], dim=-1)
        probs = torch.softmax(query @ entries.T * scale, dim=-1)  # [H, n]
        outs.append(torch.einsum("hc,hvc->hv", probs @ entries[:, :c], w_uv.double()))
    return torch.stack(outs).float()


def _lengths(b: int, max_len: int, seed: int, gen: torch.Generator, dist: str) -> torch.Tensor:
    if b == 1:  # "normal" (the benchmarks' sets): the whole context
        return torch.tensor([1 if seed % 2 and dist != "normal" else max_len], dtype=torch.int64)
    lengths = torch.randint(1, max_len + 1, (b,), generator=gen, dtype=torch.int64)
    lengths[0], lengths[1] = 1, max_len
    return lengths[torch.randperm(b, generator=gen)]


def generate_input(point: Point, seed: int, dist: str) -> Case:
    # the benchmarks draw every set "normal": those sets share the headline context, so a point's timing and its
    # floor (cost, seed 0) describe one kind of call; the other distributions vary the context by seed
    max_len = CONTEXTS[0] if dist == "normal" else CONTEXTS[seed % len(CONTEXTS)]
    return make_case(point.batch * (1 + point.spec_tokens), max_len, point["heads"], point["kv_lora_rank"],
                     point["rope_dim"], seed, dist, point.torch_dtype)


def make_case(b: int, max_len: int, h: int, c: int, r: int, seed: int, dist: str = "normal",
              dtype: torch.dtype = torch.bfloat16, full_lengths: bool = False) -> Case:
    """One call's inputs at any context (generate_input's at the contract's; the kernel's bench at its own points):
    B sequences in a cache of max_len rows, lengths as the module doc says, or every one max_len (full_lengths: the
    floor's case, a bench's other series)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = b + SPARE_SLOTS
    q_nope = sample((b, h, NOPE), dist, gen, dtype)
    q_pe = sample((b, h, r), dist, gen, dtype)
    slots = torch.randperm(num_slots, generator=gen)[:b].to(torch.int64)
    lengths = (torch.full((b,), max_len, dtype=torch.int64) if full_lengths
               else _lengths(b, max_len, seed, gen, dist))
    # only the rows a call may read are drawn, each sequence's first `length` ("mixed": a slot's distribution by its
    # index, as `sample` gives rows); the rest, spare slots included, is POISON. Drawing whole 32K caches took ~30 s
    # a case on one thread (a heavy-tailed value costs three normal draws)
    kv_cache = torch.full((num_slots, max_len, c + r), POISON, dtype=dtype)
    for i in range(b):
        slot, n = int(slots[i]), int(lengths[i])
        if dist == "normal":  # drawn in bf16 directly: the benchmarks' large caches
            kv_cache[slot, :n] = torch.randn(n, c + r, generator=gen, dtype=torch.bfloat16).to(dtype)
        else:
            kv_cache[slot, :n] = sample((n, c + r), part_distribution(dist, slot), gen, dtype)
    w_uk = (torch.randn(h, NOPE, c, generator=gen) * NOPE ** -0.5).to(dtype)
    w_uv = (torch.randn(h, VALUE, c, generator=gen) * c ** -0.5).to(dtype)
    return Case(args=(q_nope, q_pe, kv_cache, slots, lengths, w_uk, w_uv, SCALE))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
