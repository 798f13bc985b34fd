"""The training forward: the model's own layers and every op's reference, differentiable, over a batch of
sequences of one length.

`KimiK3Model.forward` serves (no autograd, one cache slot per sequence, prefill one sequence at a time). Here the
decoder layers run as they are (`DecoderLayer.forward`: the Block AttnRes wiring, norms, MLA, the latent MoE and
the dense MLP, through `TrainOps`, which calls each op's reference), with two differences:

- a KDA layer runs the batch at once: its sequences side by side as channels of the short convolution and as
  heads of the chunked recurrence (`ops/kda.py`: `conv_prefill`, `prepare`, `chunked`, `finish`), which are
  independent per channel and per head; the recurrence is recomputed in the backward pass instead of keeping its
  chunk-by-chunk tensors (activation checkpointing), and runs in fp32 under autocast;
- MLA writes its latent cache into a fresh `ModelCache` per batch (autograd follows the writes);
- the routed experts (dense in training) run every expert on every token in three batched products, weighted by
  a [T, E] matrix that is zero off the routed ids: the reference's sum with zero terms added, without its loop
  over experts, its host sync on the ids and its index_add (probe 1 on the H200: ~15 K tokens/s with them);
- on CUDA, the KDA recurrence runs FLA's chunked kernel (`chunk_kda`, Triton, with its own backward) once a
  check at the first call has found it equal to `ops/kda.py`'s `chunked` on this device; else, with a log line,
  `chunked`.

tests/model/test_train.py checks the logits equal `KimiK3Model.forward`'s prefill and decode steps.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict

import torch
from torch.utils.checkpoint import checkpoint

from ..batch import StepBatch
from ..cache import ModelCache
from ..kda import KimiDeltaAttention
from ..model import DecoderLayer, KimiK3Model
from ..ops.kda import chunked, conv_prefill, finish, prepare
from ..ops.registry import OPS
from ..ops.situ_mlp import situ

log = logging.getLogger(__name__)
FLA_CHECK_RTOL = 5e-3  # FLA's chunk kernels use tf32/bf16 products inside: ~1e-3 relative L2 from fp32


class TrainOps:
    """What the layers call in training: each op's reference. Counts the router's choices per MoE layer (keyed by
    its correction bias, which the loop moves toward balanced loads)."""

    def __init__(self):
        self.loads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_step(self, batch: StepBatch) -> None:
        """Nothing to choose: every call runs the reference."""

    def call(self, name: str, *args, **kwargs):
        dense = name == "moe_experts" and len(args[3]) == 1  # training's bf16 experts (MXFP4 ones: the reference)
        out = all_experts(*args) if dense else OPS[name].reference(*args, **kwargs)
        if name == "moe_route":
            bias, ids = args[2], out[0]
            counts = torch.bincount(ids.flatten(), minlength=bias.numel())
            _, before = self.loads.get(id(bias), (bias, 0))
            self.loads[id(bias)] = (bias, before + counts)
        return out

    def take_loads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(correction bias, expert counts) of every MoE layer since the last call."""
        out, self.loads = list(self.loads.values()), {}
        return out


def all_experts(z, ids, weights, w13, w2, beta, beta_lin) -> torch.Tensor:
    """`moe_experts`'s result for dense experts, every expert on every token: [T, L] fp32."""
    gate = torch.zeros(z.shape[0], w13[0].shape[0], dtype=torch.float32, device=z.device)
    gate = gate.scatter_add(1, ids, weights.float())  # [T, E], zero off the routed ids
    a, b = torch.einsum("tl,eil->eti", z, w13[0]).chunk(2, dim=-1)
    h = torch.einsum("eti,eli->etl", situ(a, b, beta, beta_lin), w2[0])
    return torch.einsum("te,etl->tl", gate, h.float())


@functools.cache
def fla_chunk_kda(device: torch.device):
    """FLA's chunk_kda when it is importable here and agrees with `chunked` on a random batch, else None."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception as e:  # no triton / fla on this machine
        log.warning("training KDA: FLA's chunk_kda not importable (%s: %s); using ops/kda.py's chunked form",
                    type(e).__name__, e)
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    b, t, h, d = 2, 96, 2, 128
    q, k = (torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=gen, device=device), dim=-1)
            for _ in range(2))
    v = torch.randn(b, t, h, d, generator=gen, device=device)
    g = -torch.rand(b, t, h, d, generator=gen, device=device) * 0.2
    beta = torch.rand(b, t, h, generator=gen, device=device)
    got = fla_recurrence(chunk_kda, q * d**-0.5, k, v, g, beta)
    state = q.new_zeros(b * h, d, d)
    heads = [x.transpose(0, 1).reshape(t, b * h, *x.shape[3:]) for x in (q * d**-0.5, k, v, g, beta)]
    want = chunked(*heads, state, 32)[0].view(t, b, h, d).transpose(0, 1)
    err = ((got - want).norm() / want.norm()).item()
    if not err <= FLA_CHECK_RTOL:
        log.warning("training KDA: FLA's chunk_kda is %.2e (relative L2) from chunked on %s, over %.0e; using "
                    "chunked", err, device, FLA_CHECK_RTOL)
        return None
    log.info("training KDA: FLA's chunk_kda, %.2e (relative L2) from chunked on %s", err, device)
    return chunk_kda


def fla_recurrence(chunk_kda, q, k, v, g, beta) -> torch.Tensor:
    """The recurrence of `chunked` (zero initial state) by FLA: q (already scaled), k, v, g (log decay) [B, T, H, K],
    beta (after its sigmoid) [B, T, H] -> o [B, T, H, V] fp32."""
    o, _ = chunk_kda(q, k, v, g, beta, scale=1.0, output_final_state=False)
    return o.float()


def kda_batched(attn: KimiDeltaAttention, x: torch.Tensor, batch: StepBatch, chunk: int, ops) -> torch.Tensor:
    """A KDA layer over B fresh sequences of T tokens, x [B*T, D] -> [B*T, D] (the layer's prefill, batched)."""
    b, t = batch.batch_size, batch.query_lens[0]
    cols, w = attn.cols, attn.weights()
    proj = ops.call("linear", x, attn.in_proj)
    qkv = proj[:, cols.qkv].view(b, t, -1)
    c, wc = qkv.shape[-1], w.conv_weight.shape[-1]
    folded = qkv.transpose(0, 1).reshape(t, b * c)  # the sequences' channels side by side
    conv, _ = conv_prefill(folded, folded.new_zeros(b * c, wc), w.conv_weight.repeat(b, 1))
    q, k, v, g, beta = prepare(proj, conv.view(t, b, c).transpose(0, 1).reshape(b * t, c), cols, w)

    def as_heads(y: torch.Tensor) -> torch.Tensor:  # [B*T, H, ...] -> [T, B*H, ...]
        return y.reshape(b, t, *y.shape[1:]).transpose(0, 1).reshape(t, b * cols.heads, *y.shape[2:])

    fla = fla_chunk_kda(x.device) if x.is_cuda else None
    with torch.autocast(x.device.type, enabled=False):
        if fla is not None:
            o = fla_recurrence(fla, *(y.float().reshape(b, t, *y.shape[1:]) for y in (q, k, v, g, beta)))
            o = o.reshape(b * t, cols.heads, -1)
        else:
            state = q.new_zeros(b * cols.heads, cols.head_dim, cols.head_dim)
            o, _ = checkpoint(chunked, *map(as_heads, (q, k, v, g, beta)), state, chunk, use_reentrant=False)
            o = o.view(t, b, cols.heads, -1).transpose(0, 1).reshape(b * t, cols.heads, -1)
    return attn.tp.all_reduce(ops.call("linear", finish(o, proj, cols, w), attn.o_proj))


class _Layer:
    """A decoder layer as `DecoderLayer.forward` reads it, its KDA attention batched (`kda_batched`)."""

    def __init__(self, layer: DecoderLayer, chunk: int):
        self._layer = layer
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            self.self_attn = lambda x, batch, cache, ops: kda_batched(attn, x, batch, chunk, ops)

    def __getattr__(self, name: str):
        return getattr(self._layer, name)


def hidden_states(model: KimiK3Model, ids: torch.Tensor, ops, chunk: int = 64) -> torch.Tensor:
    """Final hidden states [B*T, D] (before the final norm) of fresh sequences ids [B, T], differentiable."""
    b, t = ids.shape
    batch = StepBatch(tuple(range(b)), (t,) * b, (0,) * b)
    cache = ModelCache(model.cfg, model.tp, b, t, model.act_dtype, ids.device, layers=model.cfg.mla_layer_ids)
    partial = model.vocab.embed_tokens(ids.flatten()).to(model.act_dtype)
    blocks: list[torch.Tensor] = []
    ffn_out = None
    for layer in model.layers:
        partial, ffn_out = DecoderLayer.forward(_Layer(layer, chunk), partial, ffn_out, blocks, batch, cache, ops)
    return model.output_res(blocks + [partial + ffn_out], ops)


def logits(model: KimiK3Model, ids: torch.Tensor, ops, chunk: int = 64) -> torch.Tensor:
    """fp32 logits [B, T, V] of fresh sequences ids [B, T], differentiable."""
    h = hidden_states(model, ids, ops, chunk)
    return model.vocab.logits(model.norm(h, ops), ops).view(*ids.shape, -1)


def trainable(model: KimiK3Model) -> dict[str, list[torch.nn.Parameter]]:
    """The parameters the optimizer updates, as {'decay': matrices, 'no_decay': vectors and per-head scalars};
    the router's correction biases are left out (they move by the balancing rule, not by gradients)."""
    groups = defaultdict(list)
    for name, p in model.named_parameters():
        if name.endswith("e_bias") or not p.is_floating_point():
            continue
        p.requires_grad_(True)
        groups["decay" if p.dim() >= 2 and "conv" not in name else "no_decay"].append(p)
    return dict(groups)
