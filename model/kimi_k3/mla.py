"""MLA layer (SPEC.md §4): q-LoRA, NoPE, output gate; weight-absorbed attention for prefill and decode over a
latent cache of [normalized c_kv | k_pe] per token (576 wide in K3), with its checkpoint bindings."""

from __future__ import annotations

import torch

from .batch import StepBatch, StepKind
from .cache import ModelCache
from .config import KimiK3Config
from .module import Weighted
from .ops.mla_decode import absorbed_attention
from .parallel import TP
from .streams import forked, joined, side_stream
from .weights import Binding, CkptTensor, Part, single

# Moonshot's modeling code builds the q/kv LoRA norms with KimiRMSNorm's default eps (vLLM uses 1e-5);
# the modeling code defines what the checkpoint means (SPEC.md §10).
LORA_NORM_EPS = 1e-6


# fp32 scores (and their masked and softmaxed copies) a prefill holds at once; longer contexts take their queries
# in smaller groups, so a 128K-token context needs no more memory than a short one.
PREFILL_SCORE_BYTES = 1 << 30
SCORE_COPIES = 3


class KimiMLA(Weighted):
    def __init__(self, cfg: KimiK3Config, layer: int, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        self.layer = layer
        pre = f"model.layers.{layer}.self_attn."
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.heads = tp.local(h)
        self.q_lora, self.kv_lora, self.rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim**-0.5
        bf16 = torch.bfloat16

        self.declare(Binding("fused_qkv_a", (
            Part(CkptTensor(pre + "q_a_proj.weight", (self.q_lora, d), bf16)),
            Part(CkptTensor(pre + "kv_a_proj_with_mqa.weight", (self.kv_lora + self.rope, d), bf16)),
        )))
        self.declare(single("q_a_norm", pre + "q_a_layernorm.weight", (self.q_lora,), bf16, "ones"))
        self.declare(single("kv_a_norm", pre + "kv_a_layernorm.weight", (self.kv_lora,), bf16, "ones"))
        self.declare(single("q_b_proj", pre + "q_b_proj.weight", (h * cfg.qk_head_dim, self.q_lora), bf16, shard_dim=0))
        self.declare(single("kv_b_proj", pre + "kv_b_proj.weight", (h * (self.nope + self.v_dim), self.kv_lora), bf16,
                            shard_dim=0))
        self.declare(single("g_proj", pre + "g_proj.weight", (h * self.v_dim, d), bf16, shard_dim=0))
        self.declare(single("o_proj", pre + "o_proj.weight", (d, h * self.v_dim), bf16, shard_dim=1))

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora], views of kv_b_proj."""
        kv_b = self.kv_b_proj.view(self.heads, self.nope + self.v_dim, self.kv_lora)
        return kv_b[:, :self.nope], kv_b[:, self.nope:]

    def forward(self, x: torch.Tensor, batch: StepBatch, cache: ModelCache, ops) -> torch.Tensor:
        # Two branches leave the line the attention waits on, each on a side stream: the kv branch (norm, cache
        # write), which the attention joins, and the output gate (a GEMV that reads x alone and streams 22 MB at
        # TP8), forked after q_b so it runs beside the latency-bound attention and joined before its multiply.
        # Forking the gate at the layer's start competed with the q projections for bandwidth: the step at batch
        # 1 took 11.03 ms that way, 10.97 ms forked here, 11.21 ms with neither (bench NOTES, session 24).
        t = x.shape[0]
        kv_side, gate_side = side_stream(x.device, "mla_kv"), side_stream(x.device, "mla_gate")
        c_q, c_kv, k_pe = ops.call("linear", x, self.fused_qkv_a).split([self.q_lora, self.kv_lora, self.rope], dim=-1)
        slots, positions = batch.token_slots(x.device), batch.token_positions(x.device)
        with forked(kv_side):
            c_kv = ops.call("rms_norm", c_kv, self.kv_a_norm, LORA_NORM_EPS)
            cache.store_kv(self.layer, slots, positions, torch.cat([c_kv, k_pe], dim=-1))
        c_q = ops.call("rms_norm", c_q, self.q_a_norm, LORA_NORM_EPS)
        q = ops.call("linear", c_q, self.q_b_proj).view(t, self.heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        with forked(gate_side):
            gate = torch.sigmoid(ops.call("linear", x, self.g_proj))
        joined(kv_side)

        w_uk, w_uv = self.absorbed()
        if batch.kind in (StepKind.DECODE, StepKind.VERIFY):
            # One absorbed-attention row per token, over its sequence's pages; a verified block is causal: token t
            # of a sequence sees its context and the block up to itself.
            lengths = batch.per_pass("mla_lengths", lambda: positions + 1)
            kv, table = cache.kv_pages(self.layer), batch.per_pass("mla_block_table", lambda: cache.block_table(slots))
            if cache.kv_fp8:
                attn = ops.call("mla_decode_fp8", q_nope, q_pe, kv, cache.kv_scale, table, lengths, w_uk, w_uv,
                                self.scale)
            else:
                attn = ops.call("mla_decode", q_nope, q_pe, kv, table, lengths, w_uk, w_uv, self.scale)
        else:
            attn = torch.cat([
                self._prefill(q_nope[s:s + n], q_pe[s:s + n], cache.kv_entries(self.layer, slot, ctx + n), w_uk, w_uv)
                for slot, s, n, ctx in zip(batch.slots, batch.starts, batch.query_lens, batch.context_lens)
            ])
        joined(gate_side, gate)
        gated = attn.to(x.dtype).reshape(t, -1) * gate
        return self.tp.all_reduce(ops.call("linear", gated, self.o_proj))

    def _prefill(self, q_nope, q_pe, entries, w_uk, w_uv) -> torch.Tensor:
        """Causal attention of n new queries over a sequence's whole cached context [L, C + R] (fp32 values),
        absorbed like decode, in groups of queries whose scores fit PREFILL_SCORE_BYTES."""
        n, total = q_nope.shape[0], entries.shape[0]  # every query attends to the same sequence's entries
        group = max(1, PREFILL_SCORE_BYTES // (SCORE_COPIES * 4 * self.heads * total))
        keys = torch.arange(total, device=entries.device)
        out = []
        for s in range(0, n, group):
            positions = torch.arange(total - n + s, total - n + min(n, s + group), device=entries.device)
            out.append(absorbed_attention(q_nope[s:s + group], q_pe[s:s + group], entries,
                                          keys <= positions.unsqueeze(-1), w_uk, w_uv, self.scale))
        return torch.cat(out)
