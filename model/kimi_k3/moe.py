"""Latent MoE (SPEC.md §5) and the dense layer-0 MLP (§6), with their checkpoint bindings.

Routed experts are split across TP ranks on their intermediate dimension (zero-padded to the config's
alignment, TP16: 192 -> 256) and kept as the checkpoint stores them: MXFP4 (`weight_packed` + E8M0
`weight_scale`) or dense bf16. The router, latent down/up projections and the latent norm are replicated.
"""

from __future__ import annotations

import torch

from .config import MXFP4_GROUP, KimiK3Config
from .module import Weighted
from .parallel import TP
from .streams import forked, joined, side_stream
from .weights import Binding, CkptTensor, Part, single


class LatentMoE(Weighted):
    def __init__(self, cfg: KimiK3Config, layer: int, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        pre = f"model.layers.{layer}.block_sparse_moe."
        d, lat, n_exp = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
        inter, shared = cfg.moe_intermediate_size, cfg.shared_intermediate_size
        self.top_k, self.renormalize, self.scaling = (cfg.num_experts_per_token, cfg.moe_renormalize,
                                                      cfg.routed_scaling_factor)
        self.beta, self.beta_lin, self.eps = cfg.activation_situ_beta, cfg.activation_situ_linear_beta, cfg.rms_norm_eps
        bf16, u8 = torch.bfloat16, torch.uint8

        self.declare(single("gate", pre + "gate.weight", (n_exp, d), bf16, "router"))
        self.declare(single("e_bias", pre + "gate.e_score_correction_bias", (n_exp,), torch.float32, "small"))
        self.declare(single("down_proj", pre + "routed_expert_down_proj.weight", (lat, d), bf16))
        self.declare(single("latent_norm", pre + "routed_expert_norm.weight", (lat,), bf16, "ones"))
        self.declare(single("up_proj", pre + "routed_expert_up_proj.weight", (d, lat), bf16))
        self.declare(Binding("shared_gate_up", tuple(
            Part(CkptTensor(f"{pre}shared_experts.{n}_proj.weight", (shared, d), bf16), shard_dim=0)
            for n in ("gate", "up")
        )))
        self.declare(single("shared_down", pre + "shared_experts.down_proj.weight", (d, shared), bf16, shard_dim=1))

        local = cfg.expert_intermediate_local(tp.size)
        # Each tensor is (checkpoint suffix, full shape, dtype, shard dim, rank-local size after padding).
        if cfg.experts_quantized:
            g = MXFP4_GROUP
            w13_tensors = [("weight_packed", (inter, lat // 2), u8, 0, local),
                           ("weight_scale", (inter, lat // g), u8, 0, local)]
            w2_tensors = [("weight_packed", (lat, inter // 2), u8, 1, local // 2),
                          ("weight_scale", (lat, inter // g), u8, 1, local // g)]
        else:
            w13_tensors = [("weight", (inter, lat), bf16, 0, local)]
            w2_tensors = [("weight", (lat, inter), bf16, 1, local)]

        def expert_part(e: int, w: str, suffix, shape, dtype, dim, size) -> Part:
            init = "mxfp4" if dtype == u8 else "linear"
            return Part(CkptTensor(f"{pre}experts.{e}.{w}.{suffix}", shape, dtype, init), dim, size)

        for t in w13_tensors:
            self.declare_stacked([Binding(f"w13_{t[0]}", (expert_part(e, "w1", *t), expert_part(e, "w3", *t)), index=e)
                                  for e in range(n_exp)])
        for t in w2_tensors:
            self.declare_stacked([Binding(f"w2_{t[0]}", (expert_part(e, "w2", *t),), index=e) for e in range(n_exp)])
        self.suffixes = tuple(t[0] for t in w13_tensors)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # Three branches read x alone: the shared experts, the router and the latent down projection. On a GPU the
        # first two run on side streams, forked from the current one and joined to it (a CUDA graph captures the
        # three branches), while the down projection runs here: the GEMVs stream weights and the router's selection
        # is latency-bound, so they overlap (bench NOTES, session 21: the router beside the down projection took
        # the step at batch 1 from 11.80 to 11.21 ms).
        shared_side, router_side = side_stream(x.device, "moe_shared"), side_stream(x.device, "moe_router")
        with forked(shared_side):
            shared = ops.call("situ_mlp", x, self.shared_gate_up, self.shared_down, self.beta, self.beta_lin)
        with forked(router_side):
            ids, weights = ops.call("moe_route", x, self.gate, self.e_bias, self.top_k, self.renormalize, self.scaling)
        z = ops.call("linear", x, self.down_proj)
        joined(router_side, ids, weights)
        w13 = tuple(getattr(self, f"w13_{t}") for t in self.suffixes)
        w2 = tuple(getattr(self, f"w2_{t}") for t in self.suffixes)
        y = ops.call("moe_experts", z, ids, weights, w13, w2, self.beta, self.beta_lin)
        # the experts' fp32 partials summed first; the norm rounds once, to what the up projection reads
        y = ops.call("rms_norm", self.tp.all_reduce(y), self.latent_norm, self.eps, x.dtype)
        joined(shared_side, shared)
        return ops.call("linear", y, self.up_proj) + self.tp.all_reduce(shared)


class DenseMLP(Weighted):
    """Layer 0: down(SiTU(gate x, up x)); gate/up split on the output dim, down on the input dim."""

    def __init__(self, cfg: KimiK3Config, layer: int, tp: TP, act_dtype: torch.dtype):
        super().__init__(tp, act_dtype)
        pre = f"model.layers.{layer}.mlp."
        d, inter, bf16 = cfg.hidden_size, cfg.intermediate_size, torch.bfloat16
        self.beta, self.beta_lin = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.declare(Binding("gate_up", tuple(
            Part(CkptTensor(f"{pre}{n}_proj.weight", (inter, d), bf16), shard_dim=0) for n in ("gate", "up")
        )))
        self.declare(single("down", pre + "down_proj.weight", (d, inter), bf16, shard_dim=1))

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.tp.all_reduce(ops.call("situ_mlp", x, self.gate_up, self.down, self.beta, self.beta_lin))
