"""MLA absorbed decode and prefill vs materialized attention, the MoE block vs a per-token loop, AttnRes by
hand."""

import copy
import math

import pytest
import torch

from model.kimi_k3 import mla, mxfp4
from model.kimi_k3.batch import StepBatch
from model.kimi_k3.cache import ModelCache
from model.kimi_k3.ops.attn_res import attn_res
from model.kimi_k3.ops.mla_decode import absorbed_attention as absorbed
from model.kimi_k3.ops.moe_experts import moe_experts
from model.kimi_k3.ops.moe_route import moe_route
from model.kimi_k3.ops.situ_mlp import situ


def first_layer(model, mla: bool):
    return next(layer for layer in model.layers if model.cfg.is_mla_layer(layer.layer) == mla)


def test_absorbed_mla_decode_equals_materialized(tiny_model):
    """The last token's attention through the weight-absorbed decode path equals the materialized path."""
    layer = first_layer(tiny_model, mla=True).self_attn
    cfg = tiny_model.cfg
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    full = ModelCache(cfg, tiny_model.tp, 2, 16, torch.float32)
    inc = ModelCache(cfg, tiny_model.tp, 2, 16, torch.float32)
    slot = 1
    y_full = layer(x, StepBatch((slot,), (9,), (0,)), full, tiny_model.ops)
    layer(x[:8], StepBatch((slot,), (8,), (0,)), inc, tiny_model.ops)
    y_dec = layer(x[8:], StepBatch((slot,), (1,), (8,)), inc, tiny_model.ops)
    torch.testing.assert_close(y_dec[0], y_full[8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inc.kv[layer.layer][slot, :9], full.kv[layer.layer][slot, :9])


def materialized_attention(layer, q_nope, q_pe, entries):
    """Causal MLA attention the textbook way: per-head keys [c_kv W_UK | k_pe] and values c_kv W_UV materialized
    for every cached token, scores over them."""
    w_uk, w_uv = layer.absorbed()
    n, total = q_nope.shape[0], entries.shape[0]
    c_kv, k_pe = entries.float().split([layer.kv_lora, layer.rope], dim=-1)
    k = torch.cat([torch.einsum("lc,hnc->lhn", c_kv, w_uk.float()), k_pe.unsqueeze(1).expand(-1, layer.heads, -1)], -1)
    v = torch.einsum("lc,hvc->lhv", c_kv, w_uv.float())
    scores = torch.einsum("thd,lhd->htl", torch.cat([q_nope, q_pe], -1).float(), k) * layer.scale
    causal = torch.arange(total) <= torch.arange(total - n, total).unsqueeze(-1)
    return torch.einsum("htl,lhv->thv", torch.softmax(scores.masked_fill(~causal, float("-inf")), -1), v)


@pytest.mark.parametrize("group, calls", [(None, 1), (3, 4)])  # every query at once; 11 queries in groups of 3
def test_absorbed_prefill_equals_materialized_attention(tiny_model, monkeypatch, group, calls):
    """Prefill of new queries over a cached context, absorbed and in query groups sized to the score budget,
    equals the materialized causal attention."""
    layer = first_layer(tiny_model, mla=True).self_attn
    n, total = 11, 40
    if group:
        monkeypatch.setattr(mla, "PREFILL_SCORE_BYTES", mla.SCORE_COPIES * 4 * layer.heads * total * group)
    seen = []
    monkeypatch.setattr(mla, "absorbed_attention", lambda *a: seen.append(1) or absorbed(*a))
    gen = torch.Generator().manual_seed(3)
    q_nope, q_pe = (torch.randn(n, layer.heads, d, generator=gen) for d in (layer.nope, layer.rope))
    entries = torch.randn(total, layer.kv_lora + layer.rope, generator=gen)
    got = layer._prefill(q_nope, q_pe, entries, *layer.absorbed())
    torch.testing.assert_close(got, materialized_attention(layer, q_nope, q_pe, entries), atol=1e-5, rtol=1e-5)
    assert len(seen) == calls


def test_moe_equals_per_token_loop(tiny_model):
    moe = tiny_model.layers[1].ffn
    cfg = tiny_model.cfg
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, weights = moe_route(x, moe.gate, moe.e_bias, moe.top_k, True, 1.0)
    z = x @ moe.down_proj.t()
    got = moe_experts(z, ids, weights, (moe.w13_weight_packed, moe.w13_weight_scale),
                      (moe.w2_weight_packed, moe.w2_weight_scale), moe.beta, moe.beta_lin)
    for t in range(x.shape[0]):
        expect = torch.zeros(cfg.routed_expert_hidden_size)
        for k in range(moe.top_k):
            e = int(ids[t, k])
            w13 = mxfp4.dequantize(moe.w13_weight_packed[e], moe.w13_weight_scale[e])
            w2 = mxfp4.dequantize(moe.w2_weight_packed[e], moe.w2_weight_scale[e])
            a, b = (w13 @ z[t]).chunk(2)
            expect += weights[t, k] * (w2 @ situ(a, b, 4.0, 25.0))
        torch.testing.assert_close(got[t], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_moe_branches_on_their_side_streams_change_nothing_eager_or_captured(tiny_model, monkeypatch):
    """The MoE block with its shared experts and its router on side streams equals it with every branch inline, bit
    for bit, run eagerly and replayed from a CUDA graph (the forks and the joins are captured). The tiny model's
    experts are the reference's, which syncs with the host per expert and cannot be captured: a stand-in that reads
    every output of the router's stream (ids and weights) and the down projection's takes its place."""
    from kernels.timing import capture_graph
    from model.kimi_k3 import moe as moe_module

    moe = copy.deepcopy(tiny_model.layers[1].ffn).cuda()
    ops = copy.deepcopy(tiny_model.ops)
    ops.begin_step(StepBatch((0, 1, 2), (1, 1, 1), (4, 4, 4)))
    dispatched = ops.call

    def call(name, *args, **kwargs):
        if name != "moe_experts":
            return dispatched(name, *args, **kwargs)
        z, ids, weights = args[:3]
        return z.float() * (weights * (ids + 1).float()).sum(-1, keepdim=True)

    ops.call = call
    x = torch.randn(3, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(5)).cuda()
    monkeypatch.setattr(moe_module, "side_stream", lambda device, role: None)
    inline = moe(x, ops)
    monkeypatch.undo()
    assert moe_module.side_stream(x.device, "moe_router") is not None
    torch.testing.assert_close(moe(x, ops), inline, atol=0, rtol=0)
    held = {}
    graph = capture_graph(lambda: held.update(out=moe(x, ops)))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(held["out"], inline, atol=0, rtol=0)


def test_router_chooses_by_biased_score_but_weighs_by_raw_score():
    gate_w = torch.eye(4)
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # makes expert 3 chosen despite the lowest score
    ids, weights = moe_route(x, gate_w, bias, 2, True, 1.0)
    assert sorted(ids[0].tolist()) == [0, 3]
    raw = torch.sigmoid(torch.tensor([3.0, 0.0]))
    torch.testing.assert_close(weights[0].sort().values, (raw / raw.sum()).sort().values)


def test_situ_definition():
    a, b = torch.tensor([0.7, -3.0]), torch.tensor([2.0, 40.0])
    expect = [4 * math.tanh(ai / 4) / (1 + math.exp(-ai)) * 25 * math.tanh(bi / 25)
              for ai, bi in zip(a.tolist(), b.tolist())]
    torch.testing.assert_close(situ(a, b, 4.0, 25.0), torch.tensor(expect))


def test_attn_res_by_hand():
    """l_i = sum_d s_i[d] / rms(s_i) * w_n[d] * w_p[d]; out = sum_i softmax(l)_i s_i."""
    s = [torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[0.0, 3.0, 1.0]]), torch.tensor([[2.0, 2.0, -1.0]])]
    w_n, w_p = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([[0.3, -1.0, 0.2]])
    logits = []
    for src in s:
        rms = math.sqrt(sum(v * v for v in src[0].tolist()) / 3 + 1e-5)
        logits.append(sum(src[0, d].item() / rms * w_n[d].item() * w_p[0, d].item() for d in range(3)))
    z = sum(math.exp(logit) for logit in logits)
    expect = sum(math.exp(logit) / z * src for logit, src in zip(logits, s))
    torch.testing.assert_close(attn_res(s, w_n, w_p, 1e-5), expect)
