"""Per-sequence cache slots: the MLA latent cache and the KDA conv windows and recurrent states."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from .batch import StepBatch
from .config import KimiK3Config
from .ops.mla_decode_fp8 import dequantize_kv, quantize_kv
from .parallel import TP

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}  # vLLM's kv_cache_dtype names; None: the activations'
# Rows a page of the MLA cache as the decode ops see it (kv_pages, block_table): FlashMLA's block size, a page size
# the mla_decode contracts admit (a slot's whole length as one page would fall outside them)
MLA_PAGE_SIZE = 64


class CacheFull(RuntimeError):
    pass


class ModelCache:
    """Slot-indexed caches for every layer of one TP rank.

    - MLA layer: `kv[l]` [slots, max_len rounded up to whole pages, kv_lora_rank + qk_rope_head_dim]
      (normalized c_kv | k_pe), replicated on every rank; `lengths[slot]` entries are valid. In the activation
      dtype, or with `kv_cache_dtype="fp8"` (vLLM's name) in float8_e4m3fn holding entry / kv_scale
      (ops/mla_decode_fp8.py): half the bytes; `store_kv` and `kv_entries` convert. The decode ops read it paged
      (ops/mla_decode.py): `kv_pages(l)` views it as pages of MLA_PAGE_SIZE rows, slot s owning the consecutive
      pages s * blocks_per_slot + j, and `block_table(slots)` lists them.
    - KDA layer: `conv[l]` [slots, 3P_local, conv width] in the activation dtype and
      `ssm[l]` [slots, H_local, V, K] fp32: the committed state after the slot's last kept token.

    Speculative verification (a VERIFY step: the last sampled token and K drafts per sequence) leaves
    `conv` and `ssm` untouched and writes the KDA state after each of its 1 + K positions t into
    - `spec_conv[l]` [slots, 1 + K, 3P_local, conv width] and `spec_ssm[l]` [slots, 1 + K, H_local, V, K] fp32,
    while the MLA cache takes all 1 + K entries. `commit(slots, kept)` then rolls each slot back to its
    last accepted position: KDA copies position kept - 1 into `conv`/`ssm`, MLA drops the entries past
    it (`lengths`). A verified slot runs no further step before its commit. The buffers hold 1 + K states
    per slot, as vLLM's default path does (one state slot per draft position); ReplaySSM (SPEC.md §8)
    trades them for per-position inputs and a replay at commit.
    """

    def __init__(self, cfg: KimiK3Config, tp: TP, num_slots: int, max_len: int, act_dtype: torch.dtype,
                 device: torch.device | str = "cpu", spec_tokens: int = 0, layers: Iterable[int] | None = None,
                 kv_cache_dtype: str = "auto", kv_scale: float = 1.0):
        """Caches for every layer of the config, or only for `layers` (a benchmark's few layers). kv_cache_dtype:
        "auto" (the activation dtype) or "fp8" (e4m3 entries of entry / kv_scale; vLLM's default scale is 1)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")
        if not (math.isfinite(kv_scale) and kv_scale > 0):
            raise ValueError(f"kv_scale {kv_scale!r}: a positive finite number")
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.blocks_per_slot = -(-max_len // MLA_PAGE_SIZE)
        self._slot_pages = torch.arange(self.blocks_per_slot, dtype=torch.int32, device=device)  # a slot's, from 0
        self.kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or act_dtype
        self.kv_scale = float(kv_scale)
        heads, dim = tp.local(cfg.kda_heads), cfg.kda_head_dim
        wc = cfg.linear_attn_config.short_conv_kernel_size
        self.kv: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for layer in range(cfg.num_hidden_layers) if layers is None else layers:
            if cfg.is_mla_layer(layer):
                self.kv[layer] = torch.zeros(num_slots, self.blocks_per_slot * MLA_PAGE_SIZE, cfg.mla_cache_dim,
                                             dtype=self.kv_dtype, device=device)
            else:
                self.conv[layer] = torch.zeros(num_slots, 3 * heads * dim, wc, dtype=act_dtype, device=device)
                self.ssm[layer] = torch.zeros(num_slots, heads, dim, dim, dtype=torch.float32, device=device)
        self.spec_tokens = 0
        self.spec_conv: dict[int, torch.Tensor] = {}
        self.spec_ssm: dict[int, torch.Tensor] = {}
        self.reserve_spec(spec_tokens)
        self.lengths = [0] * num_slots
        self._verified: dict[int, int] = {}  # slot -> tokens of its uncommitted verification step
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def kv_fp8(self) -> bool:
        return self.kv_dtype == torch.float8_e4m3fn

    def store_kv(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor) -> None:
        """Write MLA entries [T, C + R] at (slots, positions) of layer's cache, quantized for an fp8 cache."""
        self.kv[layer][slots, positions] = quantize_kv(entries, self.kv_scale) if self.kv_fp8 else entries

    def kv_pages(self, layer: int) -> torch.Tensor:
        """Layer's MLA cache as the decode ops' pages [slots x blocks_per_slot, MLA_PAGE_SIZE, C + R] (a view)."""
        kv = self.kv[layer]
        return kv.view(-1, MLA_PAGE_SIZE, kv.shape[-1])

    def block_table(self, slots: torch.Tensor) -> torch.Tensor:
        """The decode ops' block table of the sequences in `slots` [T]: [T, blocks_per_slot] int32, slot s's pages
        s x blocks_per_slot + j in order (index ops on the device: no host synchronisation, CUDA-graph safe)."""
        return slots.to(torch.int32).unsqueeze(-1) * self.blocks_per_slot + self._slot_pages

    def kv_entries(self, layer: int, slot: int, length: int) -> torch.Tensor:
        """A sequence's first `length` MLA entries [length, C + R] as fp32 values (an fp8 cache's dequantized)."""
        rows = self.kv[layer][slot, :length]
        return dequantize_kv(rows, self.kv_scale) if self.kv_fp8 else rows.float()

    def reserve_spec(self, spec_tokens: int) -> None:
        """Make room for verification steps of up to `spec_tokens` drafts per sequence."""
        if spec_tokens <= self.spec_tokens:
            return
        for layer, conv in self.conv.items():
            ssm = self.ssm[layer]
            self.spec_conv[layer] = conv.new_zeros(self.num_slots, 1 + spec_tokens, *conv.shape[1:])
            self.spec_ssm[layer] = ssm.new_zeros(self.num_slots, 1 + spec_tokens, *ssm.shape[1:])
        self.spec_tokens = spec_tokens

    def allocate(self) -> int:
        """A fresh slot with empty context (states zeroed)."""
        if not self._free:
            raise CacheFull(f"all {self.num_slots} cache slots are in use")
        slot = self._free.pop()
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].zero_()
        self.lengths[slot] = 0
        self._verified.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def check_room(self, slot: int, new_tokens: int) -> None:
        if slot in self._verified:
            raise RuntimeError(f"slot {slot}: its verified tokens are not committed (ModelCache.commit)")
        if self.lengths[slot] + new_tokens > self.max_len:
            raise CacheFull(f"slot {slot}: {self.lengths[slot]} + {new_tokens} tokens exceed max_len {self.max_len}")

    def advance(self, batch: StepBatch) -> None:
        """Account for a finished step's tokens; a verification step's tokens stay provisional until commit."""
        for slot, n in zip(batch.slots, batch.query_lens):
            self.lengths[slot] += n
            if batch.spec_tokens:
                self._verified[slot] = n

    def commit(self, slots: list[int], kept: list[int]) -> None:
        """After verification, keep each slot's first kept[i] verified tokens (the last sampled token and
        the accepted drafts): KDA continues from the state after position kept[i] - 1, MLA is truncated."""
        for slot, n in zip(slots, kept):
            if slot not in self._verified:
                raise ValueError(f"commit: slot {slot} has no verification step to commit")
            if not 1 <= n <= self._verified[slot]:
                raise ValueError(f"commit: slot {slot} keeps {n} of {self._verified[slot]} verified tokens")
            self.lengths[slot] -= self._verified.pop(slot) - n
        if not self.conv:
            return
        device = next(iter(self.conv.values())).device
        index = torch.tensor(slots, dtype=torch.int64, device=device)
        position = torch.tensor(kept, dtype=torch.int64, device=device) - 1
        for layer in self.conv:
            self.conv[layer][index] = self.spec_conv[layer][index, position]
            self.ssm[layer][index] = self.spec_ssm[layer][index, position]
