"""K3's attention layers on vLLM's caches: a KDA layer whose recurrent state vLLM allocates and hands out per
request (a Mamba-style state, `MambaSpec`), and an MLA layer whose latent cache is vLLM's paged KV cache
(`MLAAttentionSpec`, one [c_kv | k_pe] entry per token, 576 wide in K3).

Each wraps k3forge's own layer (`inner`, which owns the weights) and is called exactly as that layer is, with
`(x, batch, cache, ops)` by k3forge's model; it ignores k3forge's cache and reads vLLM's metadata for this
step (which cache slot, block table and token slots each request has) from vLLM's forward context.

The math is k3forge's: KDA decode goes through the dispatcher (`kda_decode`, where a contracted kernel can serve
it), KDA prefill through `kda_prefill`; MLA decode through the dispatcher (`mla_decode`), MLA prefill through
the layer's own causal absorbed attention. States in vLLM's layout:
- KDA: conv window [3P, Wc] in the activation dtype (the last Wc inputs of q|k|v, oldest first; vLLM's own
  K3 keeps Wc - 1 of them: k3forge's decode ops and its contracted kernel keep the whole window), and the
  recurrent state [H, V, K] fp32, V-major, exactly as vLLM's K3 stores it. P = H*K local heads times head dim.
- MLA: vLLM's paged cache viewed as [blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim], in the model's dtype
  or, with kv_cache_dtype "fp8", e4m3 entries (vLLM's uint8 bytes viewed; `mla_decode_fp8`). Decode hands its
  pages [blocks, block_size, entry], vLLM's block table and the sequence lengths, all on the device, straight to the
  paged `mla_decode` op (no copy of the contexts, no host synchronisation in the layer); prefill gathers each
  request's context through its pages. vLLM sizes a hybrid model's attention blocks to match the KDA state's page
  (128 rows in the tiny preset), a size the paged kernels are not contracted for: decode reads such blocks as kernel
  pages, the largest of KERNEL_PAGE_SIZES dividing them (`kernel_page`; the same memory viewed, the block table in
  its units by `in_kernel_pages`), so the contracted kernel serves the step instead of the standard op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec, MLAAttentionSpec

from . import k3

# The page sizes the paged MLA kernels are contracted for (contracts/mla_decode.yaml and mla_decode_fp8.yaml,
# shapes.page_size; tests/vllm holds them equal), largest first
KERNEL_PAGE_SIZES = (64, 16)
# vLLM's names for an e4m3 KV cache (it allocates the bytes as uint8): the MLA layer stores entry / FP8_KV_SCALE in
# e4m3 and decodes through `mla_decode_fp8`. The scale is vLLM's default (1.0: no calibrated scales are loaded),
# k3forge's ModelCache's too, so `k3forge generate --kv-cache-dtype fp8` computes the same tokens.
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
FP8_KV_SCALE = 1.0


def kernel_page(pages: torch.Tensor) -> int:
    """The rows of a page decode reads vLLM's blocks [blocks, size, entry] as: `size` where the kernels take it, else
    the largest of KERNEL_PAGE_SIZES dividing it, where the blocks lie back to back (so that they can be viewed as
    pages of that size); else `size` (the standard op serves those, a counted fallback)."""
    size = pages.shape[1]
    if size in KERNEL_PAGE_SIZES or pages.stride(0) != size * pages.stride(1):
        return size
    return next((p for p in KERNEL_PAGE_SIZES if size % p == 0), size)


def in_kernel_pages(block_table: torch.Tensor, ratio: int) -> torch.Tensor:
    """A block table [B, n] of blocks of `ratio` kernel pages each, in kernel pages [B, n * ratio]: entry j * ratio + s
    is block_table[:, j] * ratio + s, the page holding rows [s p, (s + 1) p) of block j once the blocks [blocks, ratio
    p, entry] are viewed as [blocks * ratio, p, entry] (a view: a block's rows are contiguous)."""
    if ratio == 1:
        return block_table
    steps = torch.arange(ratio, dtype=block_table.dtype, device=block_table.device)
    return (block_table.unsqueeze(-1) * ratio + steps).flatten(1)


@dataclass
class K3StepMetadata:
    """One step's requests as vLLM scheduled them (tokens of request i are
    [query_start_loc[i], query_start_loc[i + 1])), and where their caches are."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int, on the CPU
    seq_lens: torch.Tensor  # [num_reqs] int64 context + new tokens, on the device (the decode op's lengths)
    seq_lens_cpu: torch.Tensor  # the same on the CPU (the step's host-side shape: StepBatch, prefill)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, on the device
    slot_mapping: torch.Tensor  # [num_actual_tokens] flat cache slot of each token (attention groups)
    state_indices: torch.Tensor | None = None  # [num_reqs] int64 state slot of each request (KDA group)
    kernel_block_table: torch.Tensor | None = None  # block_table in kernel pages (in_kernel_pages), once a step

    @property
    def query_lens(self) -> list[int]:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()

    @property
    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens_cpu.tolist(), self.query_lens)]


class _Builder(AttentionMetadataBuilder[K3StepMetadata]):
    """vLLM's common metadata, kept as it is; the KDA group's builder adds each request's state slot."""

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> K3StepMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return K3StepMetadata(
            num_reqs=n,
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[:n + 1].to(torch.int64),
            seq_lens=m.seq_lens[:n].to(torch.int64),
            seq_lens_cpu=m.seq_lens[:n].to("cpu", torch.int64),
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping[:m.num_actual_tokens],
            state_indices=self._state_indices(m),
        )

    def _state_indices(self, m: CommonAttentionMetadata) -> torch.Tensor | None:
        return None


class _KDABuilder(_Builder):
    def _state_indices(self, m: CommonAttentionMetadata) -> torch.Tensor:
        table = mamba_get_block_table_tensor(m.block_table_tensor[:m.num_reqs], m.seq_lens[:m.num_reqs],
                                             self.kv_cache_spec, self.vllm_config.cache_config.mamba_cache_mode)
        return table[:, 0].to(torch.int64)


class K3ForgeKDABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "K3FORGE_KDA"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("k3forge's KDA layer computes in the layer; it has no attention impl")

    @staticmethod
    def get_builder_cls() -> type[_KDABuilder]:
        return _KDABuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True


class K3ForgeMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return "K3FORGE_MLA"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("k3forge's MLA layer computes in the layer; it has no attention impl")

    @staticmethod
    def get_builder_cls() -> type[_Builder]:
        return _Builder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True


def step_metadata(layer_name: str) -> K3StepMetadata | None:
    """This step's metadata for a layer; None in vLLM's dummy runs, which have none."""
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: the plugin runs none, so there is one
        meta = meta[0]
    if not meta:
        return None
    return meta.get(layer_name)


def _register(layer: nn.Module, vllm_config: VllmConfig, name: str) -> None:
    context = vllm_config.compilation_config.static_forward_context
    if name in context:
        raise ValueError(f"Duplicate layer name: {name}")
    context[name] = layer
    layer.layer_name = name


class KDAStateLayer(nn.Module, MambaBase):
    """A KDA layer on vLLM's per-request state slots."""

    def __init__(self, inner: "k3.KimiDeltaAttention", cfg: "k3.KimiK3Config", vllm_config: VllmConfig, name: str):
        nn.Module.__init__(self)
        self.inner = inner
        self.model_config, self.cache_config = vllm_config.model_config, vllm_config.cache_config
        self.shapes = kda_state_shapes(cfg, inner.tp.size)
        self.dtypes = kda_state_dtypes(vllm_config)
        _register(self, vllm_config, name)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_attn_backend(self) -> type[AttentionBackend]:
        return K3ForgeKDABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MambaSpec:
        if vllm_config.speculative_config is not None:
            raise NotImplementedError("k3forge's vLLM plugin does not run speculative decoding yet")
        return super().get_kv_cache_spec(vllm_config)

    def forward(self, x: torch.Tensor, batch: "k3.StepBatch", cache, ops) -> torch.Tensor:
        inner, meta = self.inner, step_metadata(self.layer_name)
        if meta is None:
            return x.new_zeros(x.shape[0], inner.o_proj.shape[0])
        conv, ssm = self.kv_cache
        slots = meta.state_indices.to(x.device)
        proj = ops.call("linear", x, inner.in_proj)
        w = inner.weights()
        if batch.kind == k3.StepKind.DECODE:
            out = ops.call("kda_decode", proj, conv, ssm, slots, w)
        else:
            outs = []
            for row, (start, n, ctx) in enumerate(zip(batch.starts, batch.query_lens, batch.context_lens)):
                s = int(slots[row])
                window, state = (conv[s], ssm[s]) if ctx else (conv[s].new_zeros(conv[s].shape),
                                                               ssm[s].new_zeros(ssm[s].shape))
                o, conv[s], ssm[s] = k3.kda_prefill(proj[start:start + n], window, state, w)
                outs.append(o)
            out = torch.cat(outs)
        return inner.tp.all_reduce(ops.call("linear", out, inner.o_proj))


class MLACacheLayer(nn.Module, AttentionLayerBase):
    """An MLA layer on vLLM's paged latent cache."""

    def __init__(self, inner: "k3.KimiMLA", cfg: "k3.KimiK3Config", vllm_config: VllmConfig, name: str):
        nn.Module.__init__(self)
        self.inner = inner
        self.entry_dim = cfg.mla_cache_dim
        self.cache_dtype = vllm_config.cache_config.cache_dtype
        self.fp8 = self.cache_dtype in FP8_CACHE_DTYPES
        if self.cache_dtype != "auto" and not self.fp8:
            raise NotImplementedError(f"kv_cache_dtype: {self.cache_dtype!r}; k3forge's MLA layer stores the "
                                      "latent cache in the model's dtype ('auto') or in e4m3 ('fp8', 'fp8_e4m3')")
        self.dtype = torch.uint8 if self.fp8 else vllm_config.model_config.dtype  # vLLM's storage of an fp8 cache
        _register(self, vllm_config, name)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return K3ForgeMLABackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=self.entry_dim, dtype=self.dtype, cache_dtype_str=self.cache_dtype)

    def _pages(self) -> torch.Tensor:
        """vLLM's cache of this layer as [blocks, block_size, entry] (e4m3 values for an fp8 cache)."""
        kv = self.kv_cache
        if kv.dim() != 4 or kv.shape[1] != 1 or kv.shape[3] != self.entry_dim:
            raise RuntimeError(f"{self.layer_name}: KV cache view {tuple(kv.shape)}, expected "
                               f"[blocks, 1, block_size, {self.entry_dim}]")
        return kv[:, 0].view(torch.float8_e4m3fn) if self.fp8 else kv[:, 0]

    def forward(self, x: torch.Tensor, batch: "k3.StepBatch", cache, ops) -> torch.Tensor:
        inner, meta = self.inner, step_metadata(self.layer_name)
        if meta is None:
            return x.new_zeros(x.shape[0], inner.o_proj.shape[0])
        t = x.shape[0]
        c_q, c_kv, k_pe = ops.call("linear", x, inner.fused_qkv_a).split([inner.q_lora, inner.kv_lora, inner.rope],
                                                                         dim=-1)
        c_q = ops.call("rms_norm", c_q, inner.q_a_norm, k3.LORA_NORM_EPS)
        c_kv = ops.call("rms_norm", c_kv, inner.kv_a_norm, k3.LORA_NORM_EPS)
        q = ops.call("linear", c_q, inner.q_b_proj).view(t, inner.heads, inner.nope + inner.rope)
        q_nope, q_pe = q.split([inner.nope, inner.rope], dim=-1)

        pages = self._pages()
        block_size = pages.shape[1]
        flat = meta.slot_mapping.to(torch.int64)
        entries = torch.cat([c_kv, k_pe], dim=-1)
        pages[flat // block_size, flat % block_size] = \
            k3.quantize_kv(entries, FP8_KV_SCALE) if self.fp8 else entries.to(pages.dtype)

        w_uk, w_uv = inner.absorbed()
        if batch.kind == k3.StepKind.DECODE:  # one token a request: the paged op reads the pages where they are
            page = kernel_page(pages)
            if meta.kernel_block_table is None:  # the step's first MLA layer converts it for them all
                meta.kernel_block_table = in_kernel_pages(meta.block_table, block_size // page)
            kv = pages.view(-1, page, pages.shape[2])
            if self.fp8:
                attn = ops.call("mla_decode_fp8", q_nope, q_pe, kv, FP8_KV_SCALE, meta.kernel_block_table,
                                meta.seq_lens, w_uk, w_uv, inner.scale)
            else:
                attn = ops.call("mla_decode", q_nope, q_pe, kv, meta.kernel_block_table, meta.seq_lens, w_uk, w_uv,
                                inner.scale)
        else:
            contexts = [self._context(pages, meta.block_table[i], n) for i, n in enumerate(meta.seq_lens_cpu.tolist())]
            if self.fp8:  # the prefill attends over the values the cache holds, as k3forge's ModelCache.kv_entries
                contexts = [k3.dequantize_kv(c, FP8_KV_SCALE) for c in contexts]
            attn = torch.cat([inner._prefill(q_nope[s:s + n], q_pe[s:s + n], c, w_uk, w_uv)
                              for s, n, c in zip(batch.starts, batch.query_lens, contexts)])
        gated = attn.to(x.dtype).reshape(t, -1) * torch.sigmoid(ops.call("linear", x, inner.g_proj))
        return inner.tp.all_reduce(ops.call("linear", gated, inner.o_proj))

    @staticmethod
    def _context(pages: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """A request's first `length` cached entries [length, entry], gathered through its pages (the decode op's
        addressing, `paged_rows`)."""
        return k3.paged_rows(pages, blocks, torch.arange(length, device=pages.device))


def kda_state_shapes(cfg: "k3.KimiK3Config", tp_size: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv window [3P, Wc], recurrent state [H, V, K]) of one request on one TP rank."""
    heads, dim = cfg.kda_heads // tp_size, cfg.kda_head_dim
    return (3 * heads * dim, cfg.linear_attn_config.short_conv_kernel_size), (heads, dim, dim)


def kda_state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv window dtype: the model's, recurrent state dtype: fp32 unless --mamba-ssm-cache-dtype says)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    cache = vllm_config.cache_config
    return MambaStateDtypeCalculator.kda_state_dtype(vllm_config.model_config.dtype, cache.mamba_cache_dtype,
                                                     cache.mamba_ssm_cache_dtype)
