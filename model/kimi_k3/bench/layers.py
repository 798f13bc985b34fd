"""K3 decoder layers at real rank shapes with random weights in the checkpoint's formats, ready to time.

A benchmark layer is a `DecoderLayer` built for one TP rank (`RankOfTP`: the rank-local shapes of a TP group
whose collectives are not run, so one GPU times one rank's work without its all-reduces), its parameters drawn
on the GPU in the checkpoint's own formats (bf16 projections, MXFP4 experts as packed E2M1 codes and E8M0 scales,
fp32 KDA tensors), and its own cache (KDA state and conv window, or the MLA latent cache filled to the context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..batch import StepBatch
from ..cache import ModelCache
from ..config import KimiK3Config
from ..dispatch import Dispatcher
from ..model import DecoderLayer
from ..module import Weighted
from ..parallel import TP

KINDS = ("kda", "mla", "dense")
E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # of uniform random codes


@dataclass(frozen=True)
class RankOfTP(TP):
    """Rank 0's shapes of a TP group of `size`, with every collective the identity: what one GPU of the group
    computes between its collectives. Reports say the collectives are excluded."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x


def layer_ids(cfg: KimiK3Config, kind: str) -> list[int]:
    """The model's layers of a kind: KDA attention with the latent MoE, MLA with the MoE, or layer 0 (dense MLP)."""
    if kind == "dense":
        return [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if kind == "mla":
        return [i for i in cfg.mla_layer_ids if cfg.is_moe_layer(i)]
    if kind == "kda":
        return [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i) and cfg.is_moe_layer(i)]
    raise ValueError(f"layer kind {kind!r}: one of {', '.join(KINDS)}")


@torch.no_grad()
def fill_random_(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Draw every parameter in place, scaled so activations stay O(1): bf16 and fp32 tensors by their
    checkpoint init kind (model/kimi_k3/checkpoint.py), MXFP4 experts as uniform random E2M1 codes with the E8M0
    scale that gives each product the 1/sqrt(fan-in) spread of the dense weights."""
    from ..checkpoint import _draw

    for module in layer.modules():
        if not isinstance(module, Weighted):
            continue
        tensors = {b.param: b.parts[0].tensor for b in module.weight_bindings}
        for name, p in module.named_parameters(recurse=False):
            spec = tensors[name]
            if name.endswith("weight_packed"):
                p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=p.device, dtype=torch.uint8))
            elif name.endswith("weight_scale"):
                fan_in = p.shape[-1] * 32
                p.fill_(round(127 + math.log2(1 / (math.sqrt(fan_in) * E2M1_RMS))))
            else:
                local = replace(spec, shape=tuple(p.shape))
                p.copy_(_draw(local, gen, p.device).to(p.dtype))


@dataclass
class BenchLayer:
    """One decoder layer, its cache and its inputs for a decode step of `batch` sequences at `context` tokens."""

    layer: DecoderLayer
    cache: ModelCache
    step: StepBatch
    partial: torch.Tensor
    ffn_prev: torch.Tensor
    blocks: list[torch.Tensor]

    def run(self, ops: Dispatcher) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(self.partial, self.ffn_prev, list(self.blocks), self.step, self.cache, ops)

    def closure(self, ops: Dispatcher) -> Callable[[], object]:
        return lambda: self.run(ops)


def build_layer(cfg: KimiK3Config, layer_id: int, tp_size: int, batch: int, context: int, device: torch.device,
                seed: int, spec_tokens: int = 0, dtype: torch.dtype = torch.bfloat16, group: TP | None = None,
                kv_cache_dtype: str = "auto") -> BenchLayer:
    """A layer with random weights; sequences 0..batch-1 in slots 0..batch-1 with `context` cached tokens (random
    KDA states and conv windows, random MLA entries, in e4m3 with kv_cache_dtype "fp8") and random activations.
    With `spec_tokens` = K the step verifies 1 + K tokens per sequence. `group`: a real TP group of `tp_size` ranks
    whose collectives the layer runs (every rank draws the same activations); by default rank 0's shapes with the
    collectives excluded."""
    gen = torch.Generator(device).manual_seed(seed)
    tp = group or RankOfTP(size=tp_size)
    with torch.device(device):
        layer = DecoderLayer(cfg, layer_id, tp, dtype)
    fill_random_(layer, gen)
    tokens = 1 + spec_tokens
    cache = ModelCache(cfg, tp, batch, context + tokens, dtype, device, spec_tokens, layers=[layer_id],
                       kv_cache_dtype=kv_cache_dtype)
    for t in (*cache.conv.values(), *cache.ssm.values()):
        t.copy_(torch.randn(t.shape, generator=gen, device=device) * 0.1)
    for t in cache.kv.values():
        t.copy_(torch.randn(t.shape, generator=gen, device=device))
    d = cfg.hidden_size
    n_blocks = -(-layer_id // cfg.attn_res_block_size)

    def act() -> torch.Tensor:
        return torch.randn(batch * tokens, d, generator=gen, device=device).to(dtype)

    step = StepBatch(tuple(range(batch)), (tokens,) * batch, (context,) * batch, spec_tokens)
    return BenchLayer(layer, cache, step, act(), act(), [act() for _ in range(n_blocks)])


def layer_bytes(layer: DecoderLayer) -> int:
    """Every parameter's bytes (experts included): what building the layer allocates, for fitting layers to memory."""
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def planned_bytes(cfg: KimiK3Config, layer_id: int, tp_size: int, batch: int, context: int, spec_tokens: int = 0,
                  dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto") -> int:
    """Device bytes one `build_layer` takes (parameters and cache), computed on the meta device."""
    tp = RankOfTP(size=tp_size)
    with torch.device("meta"):
        layer = DecoderLayer(cfg, layer_id, tp, dtype)
        cache = ModelCache(cfg, tp, batch, context + 1 + spec_tokens, dtype, "meta", spec_tokens, layers=[layer_id],
                           kv_cache_dtype=kv_cache_dtype)
    caches = [*cache.kv.values(), *cache.conv.values(), *cache.ssm.values(), *cache.spec_conv.values(),
              *cache.spec_ssm.values()]
    return layer_bytes(layer) + sum(t.numel() * t.element_size() for t in caches)


def standard_copy_bytes(cfg: KimiK3Config, layer_id: int, tp_size: int) -> int:
    """Bytes the `auto` backend adds for one layer: the MXFP4 experts' standard (humming on Hopper) keeps a repacked
    copy of the expert weights, as large as the checkpoint's packed codes and scales."""
    if not cfg.is_moe_layer(layer_id):
        return 0
    with torch.device("meta"):
        layer = DecoderLayer(cfg, layer_id, RankOfTP(size=tp_size), torch.bfloat16)
    return sum(p.numel() * p.element_size() for name, p in layer.ffn.named_parameters()
               if name.startswith(("w13", "w2")))
