"""The Kimi K3 text model (SPEC.md §2, §7): embedding, 93 decoder layers joined by Block Attention Residuals
(no ordinary residual stream), final AttnRes, norm and the untied lm_head. Rank-local for a TP rank."""

from __future__ import annotations

import torch
from torch import nn

from .attn_res import AttnResWeights
from .batch import StepBatch
from .cache import ModelCache
from .config import KimiK3Config
from .dispatch import Dispatcher
from .kda import KimiDeltaAttention
from .mla import KimiMLA
from .module import RMSNorm, Weighted
from .moe import DenseMLP, LatentMoE
from .parallel import TP
from .weights import BindingSet, single


class VocabParallel(Weighted):
    """Embedding and lm_head rows split across ranks (vocab_size / tp each)."""

    def __init__(self, cfg: KimiK3Config, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        v, d = cfg.vocab_size, cfg.hidden_size
        self.rows = tp.local(v)
        self.declare(single("embed", "model.embed_tokens.weight", (v, d), torch.bfloat16, "embed", shard_dim=0))
        self.declare(single("lm_head", "lm_head.weight", (v, d), torch.bfloat16, "lm_head", shard_dim=0))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.tp.rank * self.rows
        mine = (local >= 0) & (local < self.rows)
        out = self.embed[local.clamp(0, self.rows - 1)] * mine.unsqueeze(-1).to(self.embed.dtype)
        return self.tp.all_reduce(out)

    def logits(self, h: torch.Tensor, ops) -> torch.Tensor:
        return self.tp.all_gather_last(ops.call("lm_head", h, self.lm_head))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiK3Config, layer: int, tp: TP, act_dtype: torch.dtype):
        super().__init__()
        pre, d, eps = f"model.layers.{layer}.", cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.attn_res = AttnResWeights(pre, "self_attention_res", d, eps, tp, act_dtype)
        self.input_layernorm = RMSNorm(pre + "input_layernorm.weight", d, eps, tp, act_dtype)
        attn_cls = KimiMLA if cfg.is_mla_layer(layer) else KimiDeltaAttention
        self.self_attn = attn_cls(cfg, layer, tp, act_dtype)
        self.mlp_res = AttnResWeights(pre, "mlp_res", d, eps, tp, act_dtype)
        self.post_attention_layernorm = RMSNorm(pre + "post_attention_layernorm.weight", d, eps, tp, act_dtype)
        ffn_cls = LatentMoE if cfg.is_moe_layer(layer) else DenseMLP
        self.ffn = ffn_cls(cfg, layer, tp, act_dtype)
        self.block_size = cfg.attn_res_block_size

    def forward(self, partial: torch.Tensor, ffn_prev: torch.Tensor | None, blocks: list[torch.Tensor],
                batch: StepBatch, cache: ModelCache, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer under Block AttnRes (SPEC.md §2): the partial sum and the previous layer's FFN
        output in, (partial sum, this layer's FFN output) out; a block-writing layer appends to `blocks`."""
        i = self.layer
        writes = i % self.block_size == 0
        n_prev = -(-i // self.block_size)  # blocks completed before this layer
        # partial += ffn_prev inside the mix's op where there is a mix (the op returns the sum)
        if n_prev:
            x, partial = self.attn_res.normed(blocks[:n_prev] + [partial], self.input_layernorm, ops, ffn_prev)
        else:
            partial = partial if ffn_prev is None else partial + ffn_prev
            x = self.input_layernorm(partial, ops)
        if writes:
            blocks.append(partial)
        a = self.self_attn(x, batch, cache, ops)
        if writes:  # a new block starts: the partial sum restarts at the attention's output
            partial = a
            x2, _ = self.mlp_res.normed(blocks[:n_prev + 1] + [partial], self.post_attention_layernorm, ops)
        else:
            x2, partial = self.mlp_res.normed(blocks[:n_prev] + [partial], self.post_attention_layernorm, ops, a)
        return partial, self.ffn(x2, ops)


class KimiK3Model(nn.Module):
    def __init__(self, cfg: KimiK3Config, tp: TP = TP(), act_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        cfg.check_tp(tp.size)
        self.cfg, self.tp, self.act_dtype = cfg, tp, act_dtype
        self.vocab = VocabParallel(cfg, tp, act_dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, act_dtype) for i in range(cfg.num_hidden_layers))
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.output_res = AttnResWeights("model.", "output_attn_res", d, eps, tp, act_dtype)
        self.norm = RMSNorm("model.norm.weight", d, eps, tp, act_dtype)
        self.ops = Dispatcher.for_model(self)  # standard path; Engine(decode_backend=...) replaces it

    def bindings(self) -> BindingSet:
        """Every parameter's checkpoint binding, with parameter paths relative to this model."""
        out = BindingSet()
        for path, module in self.named_modules():
            if isinstance(module, Weighted):
                out.add(module.weight_bindings, f"{path}." if path else "", "")
        return out

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, batch: StepBatch, cache: ModelCache) -> torch.Tensor:
        """Run one step over the batch's tokens [T]; return the final hidden states [T, D] (before the norm)."""
        for slot, n in zip(batch.slots, batch.query_lens):
            cache.check_room(slot, n)
        hidden = self.hidden_states(token_ids, batch, cache)
        cache.advance(batch)
        return hidden

    @torch.no_grad()
    def hidden_states(self, token_ids: torch.Tensor, batch: StepBatch, cache: ModelCache) -> torch.Tensor:
        """`forward`'s tensor work alone, without the cache's host-side accounting of lengths: what a CUDA graph of
        a decode step captures (the caller accounts for the step's tokens)."""
        self.ops.begin_step(batch)
        partial = self.vocab.embed_tokens(token_ids).to(self.act_dtype)
        blocks: list[torch.Tensor] = []
        ffn_out = None
        with batch.forward_pass():
            for layer in self.layers:
                partial, ffn_out = layer(partial, ffn_out, blocks, batch, cache, self.ops)
        partial = partial + ffn_out
        return self.output_res(blocks + [partial], self.ops)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] from final hidden states (the final norm is applied here, as in vLLM)."""
        return self.vocab.logits(self.norm(hidden, self.ops), self.ops)
