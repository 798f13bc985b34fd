"""MLA decode attention over the paged latent cache, weight-absorbed (SPEC.md §4).

    out = mla_decode(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale)     # [B, H, 128] fp32

Shapes from the contract: `heads` (rank-local H), `kv_lora_rank` (C), `rope_dim` (R), `page_size` (P, rows a page
of the cache); N = V = 128, scale = 192^-1/2 (K3's). The context is not a contract shape: "normal" inputs (every
benchmark set) use CONTEXTS[0] = 4K, the other distributions pick the context from CONTEXTS by seed (32K bench
points need a context key in the benchmark schema: left for the maintainers). The block table has a context's
worth of blocks per sequence (ceil(context / P), int32 as vLLM keeps it). Lengths differ across the batch, drawn in
[1, context], with one sequence at 1 and one at the context (a single sequence alternates between the two by seed,
"normal" aside: the whole context).

The pool holds each sequence's used pages (ceil(length / P)) and SPARE_PAGES more, and each sequence's pages are
a random draw from it: never in order, never shared. Only each sequence's valid rows are drawn; every other row
holds POISON: the rest of a sequence's last page, the spare pages. Table entries past a sequence's used blocks
point alternately at a spare page and one past the pool's end: a kernel that reads a row through them, or any row
past a length into its softmax, is visibly wrong (POISON is finite so that the reference's masked softmax stays
exact, large so that reading it shows). The cache and q follow the distribution; weights are drawn like trained
ones.

The reference is the op's math in float64 (per sequence, over its valid rows only, found through its pages by the
op's own `page_index`), returned as fp32: the checker (compare.check_tensor) then measures the candidate against
exact attention, not against another fp32 summation order.
"""

from __future__ import annotations

import torch

from gates.core.compare import check_tensor
from gates.problems import Case, Cost, Point, part_distribution, sample
from model.kimi_k3.ops.mla_decode import OP, page_index, paged_rows

SHAPE_KEYS = ("heads", "kv_lora_rank", "rope_dim", "page_size")
NOPE = VALUE = 128
SCALE = 192 ** -0.5
CONTEXTS = (4096, 1000, 32768)
SPARE_PAGES = 2
POISON = 256.0

check = check_tensor


def reference(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale, kv_scale: float = 1.0) -> torch.Tensor:
    """The op in float64 over each sequence's valid rows (each entry times kv_scale: the FP8 cache's); [B, H, V]
    fp32."""
    c = w_uk.shape[-1]
    outs = []
    for i in range(q_nope.shape[0]):
        positions = torch.arange(int(lengths[i]), device=kv_cache.device)
        entries = paged_rows(kv_cache, block_table[i], positions).double() * kv_scale  # [n, C + R]
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
                     point["rope_dim"], seed, dist, point.torch_dtype, page_size=point["page_size"])


def page_pool(lengths: torch.Tensor, max_len: int, page_size: int, gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """(pages, block_table [B, ceil(max_len / P)] int32): sequence i's ceil(length_i / P) pages are the next ones of
    a random permutation of the pool (SPARE_PAGES more than all sequences use), reversed where they came out in
    order (a kernel ignoring the table would read them right), so no two sequences share a page and none has its
    pages in order; its entries past them alternate between a spare page and `pages`, one past the pool's end."""
    used = (lengths + page_size - 1) // page_size
    pages = int(used.sum()) + SPARE_PAGES
    order = torch.randperm(pages, generator=gen).to(torch.int32)
    spare = order[pages - SPARE_PAGES:]
    blocks = torch.arange(-(-max_len // page_size))
    beyond = torch.tensor(pages, dtype=torch.int32)
    table = torch.where(blocks % 2 == 0, spare[(blocks // 2) % SPARE_PAGES], beyond).repeat(len(lengths), 1)
    first = 0
    for i, n in enumerate(used.tolist()):
        mine = order[first:first + n]
        table[i, :n] = mine.flip(0) if n > 1 and bool((mine.diff() == 1).all()) else mine
        first += n
    return pages, table


def make_case(b: int, max_len: int, h: int, c: int, r: int, seed: int, dist: str = "normal",
              dtype: torch.dtype = torch.bfloat16, full_lengths: bool = False, page_size: int = 64) -> Case:
    """One call's inputs at any context and page size (generate_input's at the contract's; the kernel's bench at
    its own points): B sequences whose block tables admit max_len rows, lengths as the module doc says, or every
    one max_len (full_lengths: the floor's case, a bench's other series)."""
    gen = torch.Generator().manual_seed(seed)
    q_nope = sample((b, h, NOPE), dist, gen, dtype)
    q_pe = sample((b, h, r), dist, gen, dtype)
    lengths = (torch.full((b,), max_len, dtype=torch.int64) if full_lengths
               else _lengths(b, max_len, seed, gen, dist))
    pages, block_table = page_pool(lengths, max_len, page_size, gen)
    # only the rows a call may read are drawn, each sequence's first `length` ("mixed": a sequence's distribution by
    # its index, as `sample` gives rows; "normal" in bf16 directly: the benchmarks' large caches); the rest, spare
    # pages included, is POISON. Drawing whole 32K caches took ~30 s a case on one thread (a heavy-tailed value
    # costs three normal draws)
    kv_cache = torch.full((pages, page_size, c + r), POISON, dtype=dtype)
    for i in range(b):
        n = int(lengths[i])
        if dist == "normal":
            rows = torch.randn(n, c + r, generator=gen, dtype=torch.bfloat16).to(dtype)
        else:
            rows = sample((n, c + r), part_distribution(dist, i), gen, dtype)
        kv_cache[page_index(block_table[i], torch.arange(n), page_size, pages)] = rows
    w_uk = (torch.randn(h, NOPE, c, generator=gen) * NOPE ** -0.5).to(dtype)
    w_uv = (torch.randn(h, VALUE, c, generator=gen) * c ** -0.5).to(dtype)
    return Case(args=(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, SCALE))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
