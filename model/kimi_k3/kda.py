"""KDA layer, full-rank output gate variant (SPEC.md §3), with its checkpoint bindings.

Rank-local: H/tp heads. q, k, v, g_proj, f_a and b_proj are packed into one `in_proj` as vLLM packs
`in_proj_qkvgfab` (f_a replicated on every rank, zero rows to a multiple of 16); the three short-conv
weights into one `conv_weight` [3P, 1, Wc].
"""

from __future__ import annotations

import torch

from .batch import StepBatch, StepKind
from .cache import ModelCache
from .config import KimiK3Config
from .module import Weighted
from .ops.kda import KDAColumns, KDAWeights, kda_prefill
from .parallel import TP
from .weights import Binding, CkptTensor, Part, single

A_LOG_STORED = 128  # K3 stores A_log zero-padded to a multiple of this (96 heads -> [128]); [H] also loads


class KimiDeltaAttention(Weighted):
    def __init__(self, cfg: KimiK3Config, layer: int, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        self.layer = layer
        pre = f"model.layers.{layer}.self_attn."
        lac = cfg.linear_attn_config
        d, h, k = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
        p, rank, wc = h * k, k, lac.short_conv_kernel_size
        self.cols = KDAColumns(heads=tp.local(h), head_dim=k, rank=rank)
        self.lower_bound, self.norm_eps = lac.gate_lower_bound, cfg.rms_norm_eps
        bf16, fp32 = torch.bfloat16, torch.float32

        def sharded(name: str, shape: tuple[int, ...], dtype=bf16, init="linear") -> Part:
            return Part(CkptTensor(pre + name, shape, dtype, init), shard_dim=0)

        in_parts = (
            *(sharded(f"{c}_proj.weight", (p, d)) for c in "qkv"),
            sharded("g_proj.weight", (p, d)),
            Part(CkptTensor(pre + "f_a_proj.weight", (rank, d), bf16)),  # replicated
            sharded("b_proj.weight", (h, d)),
        )
        used = 4 * self.cols.p + rank + self.cols.heads
        self.declare(Binding("in_proj", in_parts, pad_rows=self.cols.width - used))
        self.declare(Binding("conv_weight",
                             tuple(sharded(f"{c}_conv1d.weight", (p, 1, wc), fp32, "conv") for c in "qkv")))
        self.declare(single("f_b", pre + "f_b_proj.weight", (p, rank), bf16, shard_dim=0))
        a_log_len = -(-h // A_LOG_STORED) * A_LOG_STORED
        self.declare(Binding("A_log",
                             (Part(CkptTensor(pre + "A_log", (a_log_len,), fp32, f"a_log:{h}"), 0, extent=h),)))
        self.declare(single("dt_bias", pre + "dt_bias", (p,), fp32, "dt_bias", shard_dim=0))
        self.declare(single("o_norm", pre + "o_norm.weight", (k,), fp32, "ones"))
        self.declare(single("o_proj", pre + "o_proj.weight", (d, p), bf16, shard_dim=1))

    def weights(self) -> KDAWeights:
        return KDAWeights(
            conv_weight=self.conv_weight.view(self.conv_weight.shape[0], -1),
            f_b=self.f_b,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            o_norm=self.o_norm,
            lower_bound=self.lower_bound,
            norm_eps=self.norm_eps,
        )

    def forward(self, x: torch.Tensor, batch: StepBatch, cache: ModelCache, ops) -> torch.Tensor:
        proj = ops.call("linear", x, self.in_proj)
        conv, ssm, w = cache.conv[self.layer], cache.ssm[self.layer], self.weights()
        if batch.kind == StepKind.DECODE:
            out = ops.call("kda_decode", proj, conv, ssm, batch.slot_tensor(x.device), w)
        elif batch.kind == StepKind.VERIFY:
            if cache.spec_tokens < batch.spec_tokens:
                raise ValueError(f"KDA layer {self.layer}: verifying {batch.spec_tokens} drafts needs "
                                 f"ModelCache.reserve_spec({batch.spec_tokens}) (it holds {cache.spec_tokens})")
            out = ops.call("kda_verify", proj.view(batch.batch_size, 1 + batch.spec_tokens, -1), conv, ssm,
                           batch.slot_tensor(x.device), w, cache.spec_conv[self.layer],
                           cache.spec_ssm[self.layer]).flatten(0, 1)
        else:
            outs = []
            for slot, start, n in zip(batch.slots, batch.starts, batch.query_lens):
                o, conv[slot], ssm[slot] = kda_prefill(proj[start:start + n], conv[slot], ssm[slot], w)
                outs.append(o)
            out = torch.cat(outs)
        return self.tp.all_reduce(ops.call("linear", out, self.o_proj))
