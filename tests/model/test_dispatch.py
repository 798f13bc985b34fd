"""The decode dispatcher: the specialized kernel runs only inside its contract's envelope, every fallback
has its reason, counted and logged once, and a kernel that raises falls back for that call.

Envelope tests use a synthetic contract (validated on sm_90, TP 8/16, batch 1..8, 3..7 draft tokens,
hidden 64) on a synthetic target, with a spy kernel, so they run on CPU."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
import yaml

from gates.cli import main
from kernels.contract import parse_contract
from model.kimi_k3.batch import StepBatch
from model.kimi_k3.cache import MLA_PAGE_SIZE
from model.kimi_k3.config import preset
from model.kimi_k3.dispatch import Dispatcher, Target, detect
from model.kimi_k3.drafters import NgramDrafter
from model.kimi_k3.engine import Engine, SamplingParams
from model.kimi_k3.ops.attn_res import attn_res
from model.kimi_k3.ops.kda import KDAColumns, KDAWeights
from model.kimi_k3.ops.registry import OPS, Specialized
from tests.gates.fixtures.helpers import CPU_EXAMPLE, CPU_EXAMPLE_CONTRACTS

HIDDEN = 64
ENVELOPE = {
    "hardware": {"validated": [{"arch": "sm_90", "devices": ["NVIDIA H200"]}],
                 "declared": [{"arch": "sm_100", "devices": ["NVIDIA GB300"]}]},
    "tp_sizes": [8, 16],
    "batch": {"min": 1, "max": 8},
    "spec_tokens": {"min": 3, "max": 7},
    "dtypes": {"activations": "fp32", "weights": "fp32"},
    "shapes": {"hidden": [HIDDEN]},
    "benchmark": {"points": [{"batch": 1, "spec_tokens": 3}], "required_speedup": 1.2},
}
CONTRACT = parse_contract({**yaml.safe_load(CPU_EXAMPLE.read_text()), **ENVELOPE}, "synthetic")
H200_TP8 = Target("sm_90", "NVIDIA H200", tp_size=8, act_dtype=torch.float32)


def decode(b: int) -> StepBatch:
    return StepBatch(tuple(range(b)), (1,) * b, (5,) * b)


def verify(b: int, draft: int) -> StepBatch:
    return StepBatch(tuple(range(b)), (1 + draft,) * b, (5,) * b, spec_tokens=draft)


class SpyKernel:
    """A specialized attn_res that counts its calls (or raises, to test the error path)."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = 0, error

    def __call__(self, *args):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return attn_res(*args)


def dispatcher(kernel, target=H200_TP8, backend="latency_specialized") -> Dispatcher:
    return Dispatcher(target, backend, {"attn_res": Specialized(CONTRACT, "synthetic", kernel)})


def call_attn_res(d: Dispatcher, batch: StepBatch, hidden: int = HIDDEN, weights: torch.dtype = torch.float32):
    d.begin_step(batch)
    g = torch.Generator().manual_seed(batch.num_tokens)
    sources = [torch.randn(batch.num_tokens, hidden, generator=g) for _ in range(3)]
    norm, proj = torch.rand(hidden, generator=g).to(weights), torch.randn(1, hidden, generator=g).to(weights)
    return d.call("attn_res", sources, norm, proj, 1e-5), attn_res(sources, norm, proj, 1e-5)


ENVELOPE_TABLE = [  # (case, step, target, call overrides, expected fallback reason or None = specialized)
    ("batch 0", verify(0, 3), H200_TP8, {}, "batch"),
    ("batch 1", verify(1, 3), H200_TP8, {}, None),
    ("batch max", verify(8, 3), H200_TP8, {}, None),
    ("batch max+1", verify(9, 3), H200_TP8, {}, "batch"),
    ("2 draft tokens", verify(1, 2), H200_TP8, {}, "spec_tokens"),
    ("3 draft tokens", verify(2, 3), H200_TP8, {}, None),
    ("7 draft tokens", verify(2, 7), H200_TP8, {}, None),
    ("8 draft tokens", verify(2, 8), H200_TP8, {}, "spec_tokens"),
    ("plain decode", decode(1), H200_TP8, {}, "spec_tokens"),
    ("prefill", StepBatch((0,), (4,), (0,)), H200_TP8, {}, "prefill"),
    ("mixed prefill + decode", StepBatch((0, 1), (4, 1), (0, 5)), H200_TP8, {}, "mixed"),
    ("declared-only arch", verify(1, 3), replace(H200_TP8, arch="sm_100"), {}, "arch"),
    ("cpu", verify(1, 3), replace(H200_TP8, arch="cpu"), {}, "arch"),
    ("TP 4", verify(1, 3), replace(H200_TP8, tp_size=4), {}, "tp_size"),
    ("TP 16", verify(1, 3), replace(H200_TP8, tp_size=16), {}, None),
    ("bf16 activations", verify(1, 3), replace(H200_TP8, act_dtype=torch.bfloat16), {}, "dtype"),
    ("bf16 weights", verify(1, 3), H200_TP8, {"weights": torch.bfloat16}, "dtype"),
    ("hidden outside shapes", verify(1, 3), H200_TP8, {"hidden": 32}, "shape"),
]


@pytest.mark.parametrize("step, target, overrides, reason", [c[1:] for c in ENVELOPE_TABLE],
                         ids=[c[0] for c in ENVELOPE_TABLE])
def test_the_kernel_runs_only_inside_its_envelope(step, target, overrides, reason):
    kernel = SpyKernel()
    d = dispatcher(kernel, target)
    out, expected = call_attn_res(d, step, **overrides)
    torch.testing.assert_close(out, expected)
    stats = d.report()["ops"]["attn_res"]
    if reason is None:
        assert (kernel.calls, stats["specialized"], stats["standard"], stats["fallbacks"]) == (1, 1, 0, {})
    else:
        assert (kernel.calls, stats["specialized"], stats["standard"], stats["fallbacks"]) == (0, 0, 1, {reason: 1})


def test_auto_never_runs_a_specialized_kernel():
    kernel = SpyKernel()
    d = dispatcher(kernel, backend="auto")
    call_attn_res(d, verify(1, 3))
    assert kernel.calls == 0
    assert d.report()["ops"]["attn_res"] | {"standard_impl": None} == {
        "specialized": 0, "standard": 1, "fallbacks": {}, "standard_impl": None, "last_error": None}


def test_each_reason_is_counted_every_time_and_logged_once(caplog):
    d = dispatcher(SpyKernel())
    with caplog.at_level(logging.INFO, logger="model.kimi_k3.dispatch"):
        for step in (StepBatch((0,), (4,), (0,)), verify(9, 3), StepBatch((0,), (2,), (0,)), verify(12, 3),
                     verify(1, 3)):
            call_attn_res(d, step)
    assert d.report()["ops"]["attn_res"]["fallbacks"] == {"prefill": 2, "batch": 2}
    assert d.report()["ops"]["attn_res"]["specialized"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "prefill" in messages[0] and "batch 9 outside 1..8" in messages[1]


def test_a_kernel_that_raises_falls_back_and_is_counted(caplog):
    kernel = SpyKernel(RuntimeError("launch failed: too many resources requested"))
    d = dispatcher(kernel)
    with caplog.at_level(logging.INFO, logger="model.kimi_k3.dispatch"):
        for _ in range(2):
            out, expected = call_attn_res(d, verify(2, 3))
            torch.testing.assert_close(out, expected)
    stats = d.report()["ops"]["attn_res"]
    assert kernel.calls == 2
    assert (stats["specialized"], stats["standard"], stats["fallbacks"]) == (0, 2, {"error": 2})
    assert stats["last_error"] == "RuntimeError: launch failed: too many resources requested"
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is not None


def test_recorded_decisions_count_only_when_replayed():
    """What a CUDA-graph capture does: choose once, count once per replay."""
    d = dispatcher(SpyKernel())
    with d.recording() as decisions:
        call_attn_res(d, verify(1, 3))
    assert d.report()["ops"] == {}
    for _ in range(3):
        d.replayed(decisions)
    assert d.report()["ops"]["attn_res"]["specialized"] == 3


def test_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="decode_backend: 'fastest'"):
        Dispatcher(H200_TP8, "fastest")
    with pytest.raises(RuntimeError, match="before begin_step"):
        dispatcher(SpyKernel()).call("attn_res", [torch.zeros(1, HIDDEN)], torch.ones(HIDDEN), torch.ones(1, HIDDEN),
                                     1e-5)
    with pytest.raises(TypeError, match="needs a Contract"):
        Specialized(CONTRACT.model_dump(), "synthetic", attn_res)


@pytest.fixture
def model(tiny_model, monkeypatch):
    """The tiny fp32 model; engines replace its dispatcher, restored afterwards for other tests."""
    monkeypatch.setattr(tiny_model, "ops", tiny_model.ops)
    return tiny_model


def test_every_op_call_reads_the_dims_and_dtypes_it_declares(model, tiny_cfg):
    seen = {}

    class Recorder(Dispatcher):
        def call(self, name, *args, **kwargs):
            seen[name] = OPS[name].signature(*args, **kwargs)  # zip(strict) fails if probe and names disagree
            return super().call(name, *args, **kwargs)

    engine = Engine(model, max_len=12)
    fp8 = Engine(model, max_len=12, kv_cache_dtype="fp8")  # its MLA layers decode through mla_decode_fp8
    model.ops = Recorder(Target.of(model))
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), spec_tokens=2, drafter=NgramDrafter())
    fp8.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert set(seen) == set(OPS)
    assert seen["mla_decode_fp8"].dtypes["kv_cache"] == "fp8_e4m3"
    cfg = tiny_cfg
    assert seen["attn_res"].shapes["hidden"] == cfg.hidden_size
    assert seen["kda_decode"].shapes == {"heads": cfg.kda_heads, "head_dim": cfg.kda_head_dim}
    assert seen["kda_decode"].dtypes == {"weights": "fp32", "ssm_state": "fp32"}
    assert seen["mla_decode"].shapes == {"heads": cfg.num_attention_heads, "kv_lora_rank": cfg.kv_lora_rank,
                                         "rope_dim": cfg.qk_rope_head_dim, "page_size": MLA_PAGE_SIZE}
    assert seen["moe_route"].shapes == {"experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                                        "hidden": cfg.hidden_size}
    assert seen["moe_experts"].dtypes == {"weights": "mxfp4"}


def test_latency_specialized_generates_the_same_greedy_tokens_as_auto(model):
    """The CPU example's contract (attn_res, validated on cpu, fp32) runs in decode steps and falls back in the
    prefill step; the tokens match the standard path's."""
    prompts, params = [[1, 2, 3], [7, 8, 9, 10, 11]], SamplingParams(max_new_tokens=6)
    runs = {}
    for backend in ("auto", "latency_specialized"):
        engine = Engine(model, max_len=16, decode_backend=backend, contracts_dir=CPU_EXAMPLE_CONTRACTS)
        runs[backend] = ([g.tokens for g in engine.generate(prompts, params)], model.ops.report())
    (auto_tokens, auto), (spec_tokens, spec) = runs["auto"], runs["latency_specialized"]
    assert spec_tokens == auto_tokens
    assert all(op["specialized"] == 0 for op in auto["ops"].values())
    calls = sum(auto["ops"]["attn_res"][k] for k in ("specialized", "standard"))
    prefill_calls = spec["ops"]["attn_res"]["fallbacks"]["prefill"]
    assert spec["ops"]["attn_res"]["fallbacks"] == {"prefill": prefill_calls}
    assert spec["ops"]["attn_res"]["specialized"] == calls - prefill_calls > prefill_calls


def test_generate_json_reports_dispatch_counts(tiny_ckpt, capsys):
    argv = ["generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--dtype", "fp32",
            "--decode-backend", "latency_specialized", "--contracts", str(CPU_EXAMPLE_CONTRACTS), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    dispatch = result["dispatch"]
    assert dispatch["backend"] == "latency_specialized" and dispatch["target"]["arch"] == "cpu"
    assert dispatch["ops"]["attn_res"]["specialized"] > 0 and "prefill" in dispatch["ops"]["attn_res"]["fallbacks"]


@pytest.mark.gpu
def test_the_standard_kda_layer_runs_k3_shapes_under_cuda_graphs():
    """A K3 KDA layer's decode step at TP8 rank-local shapes (12 heads of 128), standard path, captured at
    batch 1/2/4/8: replays match eager steps, padded rows only touch the scratch slot, and every replay
    is counted."""
    from model.kimi_k3.cuda_graphs import GraphedDecode

    cfg, tp, dev, bf16 = preset("k3"), 8, torch.device("cuda"), torch.bfloat16
    heads, dim, d = cfg.kda_heads // tp, cfg.kda_head_dim, cfg.hidden_size
    cols, wc = KDAColumns(heads, dim, rank=dim), cfg.linear_attn_config.short_conv_kernel_size
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    in_proj, o_proj = randn(cols.width, d, scale=d**-0.5), randn(d, cols.p, scale=cols.p**-0.5)
    w = KDAWeights(conv_weight=randn(3 * cols.p, wc, scale=0.5, dtype=torch.float32),
                   f_b=randn(cols.p, dim, scale=dim**-0.5),
                   A_log=randn(heads, scale=0.5, dtype=torch.float32),
                   dt_bias=randn(cols.p, scale=0.1, dtype=torch.float32),
                   o_norm=torch.ones(dim, device=dev), lower_bound=cfg.linear_attn_config.gate_lower_bound,
                   norm_eps=cfg.rms_norm_eps)
    sizes, scratch = (1, 2, 4, 8), 8
    conv, ssm = randn(scratch + 1, 3 * cols.p, wc), randn(scratch + 1, heads, dim, dim, scale=0.1, dtype=torch.float32)
    ops = Dispatcher(Target(*detect(dev), tp_size=tp, act_dtype=bf16))

    def step(x, slots):
        ops.begin_step(decode(x.shape[0]))
        return ops.call("kda_decode", x @ in_proj.t(), conv, ssm, slots, w) @ o_proj.t()

    def padding(size):
        return torch.zeros(size, d, dtype=bf16, device=dev), torch.full((size,), scratch, device=dev)

    graphed = GraphedDecode(step, padding, sizes, ops)
    for b in (1, 3, 8):
        x, slots = randn(b, d), torch.randperm(scratch, device=dev)[:b]
        live = slots.tolist()
        conv_before, ssm_before = conv.clone(), ssm.clone()
        out = graphed(x, slots).clone()
        others = [s for s in range(scratch) if s not in live]  # padded rows write the scratch slot only
        assert torch.equal(conv[others], conv_before[others]) and torch.equal(ssm[others], ssm_before[others])
        conv_graph, ssm_graph = conv[live].clone(), ssm[live].clone()
        conv.copy_(conv_before)
        ssm.copy_(ssm_before)
        close = dict(atol=2e-2, rtol=2e-2)  # GEMMs at M = b and at the padded size may round differently
        torch.testing.assert_close(out, step(x, slots), **close)
        torch.testing.assert_close(conv_graph, conv[live], **close)
        torch.testing.assert_close(ssm_graph, ssm[live], **close)
    stats = ops.report()["ops"]["kda_decode"]
    assert stats["standard"] == 3 + 3  # three replays, three eager steps
    assert stats["standard_impl"] == OPS["kda_decode"].gpu_standard  # FLA's kernels, not the reference
