"""Per-sequence cache slots: the MLA latent cache and the KDA conv windows and recurrent states."""

from __future__ import annotations

import torch

from .config import KimiK3Config
from .parallel import TP


class CacheFull(RuntimeError):
    pass


class ModelCache:
    """Slot-indexed caches for every layer of one TP rank.

    - MLA layer: `kv[l]` [slots, max_len, kv_lora_rank + qk_rope_head_dim] (normalized c_kv | k_pe),
      replicated on every rank.
    - KDA layer: `conv[l]` [slots, 3P_local, conv width] in the activation dtype and
      `ssm[l]` [slots, H_local, V, K] fp32.
    """

    def __init__(self, cfg: KimiK3Config, tp: TP, num_slots: int, max_len: int, act_dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        heads, dim = tp.local(cfg.kda_heads), cfg.kda_head_dim
        wc = cfg.linear_attn_config.short_conv_kernel_size
        self.kv: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for layer in range(cfg.num_hidden_layers):
            if cfg.is_mla_layer(layer):
                self.kv[layer] = torch.zeros(num_slots, max_len, cfg.mla_cache_dim, dtype=act_dtype, device=device)
            else:
                self.conv[layer] = torch.zeros(num_slots, 3 * heads * dim, wc, dtype=act_dtype, device=device)
                self.ssm[layer] = torch.zeros(num_slots, heads, dim, dim, dtype=torch.float32, device=device)
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        """A fresh slot with empty context (states zeroed)."""
        if not self._free:
            raise CacheFull(f"all {self.num_slots} cache slots are in use")
        slot = self._free.pop()
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].zero_()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def check_room(self, slot: int, new_tokens: int) -> None:
        if self.lengths[slot] + new_tokens > self.max_len:
            raise CacheFull(f"slot {slot}: {self.lengths[slot]} + {new_tokens} tokens exceed max_len {self.max_len}")
