"""mla_decode: weight-absorbed MLA attention over the paged latent cache, one query token per sequence (SPEC.md §4).

    out = mla_decode(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale)       # [B, H, V] fp32

The cache is paged the way vLLM keeps it: kv_cache [pages, P, C + R] holds P rows a page, block_table
[B, max_blocks] (int32 as vLLM keeps it, or int64) lists each sequence's pages in order, and row t of sequence b is
kv_cache[block_table[b, t // P], t % P] (`page_index`). A cache of one slot of L rows per sequence is the case
P = L, block_table = slots[:, None]. Entries of a table past a sequence's used blocks are never needed; where a
whole-table gather reads them anyway (the reference, the standard), an entry outside [0, pages) is clamped into
range, as the kernel clamps every entry it reads, and the rows it gives lie past the length, masked.

`absorbed_attention` is the math decode and the layer's prefill share.
"""

from __future__ import annotations

import torch

from .op import Cost, Op, nbytes


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor,
                       w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention in the latent space: q_nope [T, H, N] through W_UK [H, N, C] and q_pe [T, H, R] score the cached
    [c_kv | k_pe] entries, [T, L, C + R] (one sequence per query) or [L, C + R] (one sequence shared by every
    query: a single GEMM); query t sees the entries where valid [T, L]; values are the entries' c_kv through
    W_UV [H, V, C]. Returns [T, H, V] fp32. Equals materialized attention with k_nope = W_UK c_kv and
    v = W_UV c_kv (tests/model/test_layers.py)."""
    c = w_uk.shape[-1]
    q_lat = torch.einsum("thn,hnc->thc", q_nope.float(), w_uk.float())
    query = torch.cat([q_lat, q_pe.float()], dim=-1)  # [T, H, C + R]
    scores = query @ entries.transpose(-1, -2) * scale  # [T, H, L]
    probs = torch.softmax(scores.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    latent = probs @ entries[..., :c]  # [T, H, C]
    return torch.einsum("thc,hvc->thv", latent, w_uv.float())


def check_paged(kv_cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """ValueError, one line naming the argument, unless kv_cache is [pages, P, C + R] with a page and a row,
    block_table an int32 or int64 [B, max_blocks] with a block, and lengths [B]. Shapes and dtypes only: reading
    the values would synchronise with the device."""
    if kv_cache.dim() != 3 or kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [pages, P, C + R] with at least one page and row")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[1] < 1:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [B, max_blocks] with at least one block "
                         "(a slot per sequence is slots[:, None])")
    if lengths.dim() != 1 or lengths.shape[0] != block_table.shape[0]:
        raise ValueError(f"lengths {tuple(lengths.shape)} must be [B], B = block_table's {block_table.shape[0]}")


def page_index(block_table: torch.Tensor, positions: torch.Tensor, page_size: int,
               num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where rows `positions` (int64 [n], each below max_blocks x P) of the sequences of block_table ([B,
    max_blocks], or one sequence's [max_blocks]) lie in a cache [pages, P, W]: (pages [..., n], rows in their page
    [n]), so that kv_cache[index] are the rows [..., n, W] and assigning to it writes them. Table entries are
    clamped into [0, pages), as the kernel clamps them."""
    pages = block_table[..., positions // page_size].clamp(0, num_pages - 1).long()
    return pages, positions % page_size


def paged_rows(kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows `positions` of each sequence of block_table, [..., n, W] in the cache's dtype (`page_index`)."""
    return kv_cache[page_index(block_table, positions, kv_cache.shape[1], kv_cache.shape[0])]


def table_rows(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions): every row block_table addresses, [B, max_blocks x P, W] in the cache's dtype, and their
    positions [max_blocks x P]: `page_index`'s rows, gathered a whole page at a time (one index_select, the cheapest
    gather: no host synchronisation, no loop over the batch, CUDA-graph safe)."""
    (b, blocks), (pages, page_size, width) = block_table.shape, kv_cache.shape
    rows = kv_cache.index_select(0, block_table.clamp(0, pages - 1).flatten()).view(b, blocks * page_size, width)
    return rows, torch.arange(blocks * page_size, device=block_table.device)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Weight-absorbed decode attention, one query token per sequence.

    q_nope [B, H, N], q_pe [B, H, R]; kv_cache [pages, P, C + R] ([c_kv | k_pe]) and block_table [B, max_blocks]
    (module doc); lengths [B] valid rows (the current token included, at most max_blocks x P); w_uk [H, N, C] maps
    c_kv to k_nope, w_uv [H, V, C] to v. Returns [B, H, V] fp32.
    """
    check_paged(kv_cache, block_table, lengths)
    rows, positions = table_rows(kv_cache, block_table)  # [B, max_blocks x P, C + R]
    return absorbed_attention(q_nope, q_pe, rows.float(), positions < lengths.unsqueeze(-1), w_uk, w_uv, scale)


def signature(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale):
    return (q_nope.shape[1], w_uk.shape[-1], q_pe.shape[-1], kv_cache.shape[1]), (w_uk.dtype, kv_cache.dtype)


def cost(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale):
    """The valid cache rows of every query and the table entries of their pages (read on the host: planning and
    reporting only), the absorbed weights, the queries and the fp32 output."""
    rows = int(lengths.sum())
    blocks = int(((lengths + kv_cache.shape[1] - 1) // kv_cache.shape[1]).sum())
    t, h, c = q_nope.shape[0], q_nope.shape[1], w_uk.shape[-1]
    width = kv_cache.shape[-1]
    return Cost(bytes=rows * width * kv_cache.element_size() + blocks * block_table.element_size()
                + nbytes(q_nope, q_pe, w_uk, w_uv, lengths) + t * h * w_uv.shape[1] * 4,
                flops=2 * h * (t * q_nope.shape[2] * c + rows * (width + c) + t * c * w_uv.shape[1]))


OP = Op("mla_decode", mla_decode, shapes=("heads", "kv_lora_rank", "rope_dim", "page_size"),
        dtypes=("weights", "kv_cache"), signature_of=signature, cost_of=cost,
        gpu_standard="model.kimi_k3.ops.mla_decode_standard:mla_decode_standard",
        standard_label="PyTorch composition on cuBLAS (bf16 batched GEMMs, fp32 softmax); no library MLA decode "
                       "installed here (mla_decode_standard.py says what was tried)")
