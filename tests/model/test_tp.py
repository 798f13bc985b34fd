"""Tensor parallelism: per-rank shapes of SPEC.md §9, and TP2/TP4 over real gloo process groups (CPU, tiny
preset, fp32) against TP1."""

from __future__ import annotations

import time

import pytest
import torch

from model.kimi_k3.batch import StepBatch
from model.kimi_k3.cache import ModelCache
from model.kimi_k3.config import preset
from model.kimi_k3.distributed import run_tp
from model.kimi_k3.drafters import NgramDrafter
from model.kimi_k3.engine import Engine, SamplingParams
from model.kimi_k3.kda import KimiDeltaAttention
from model.kimi_k3.loader import load_model
from model.kimi_k3.mla import KimiMLA
from model.kimi_k3.model import VocabParallel
from model.kimi_k3.moe import DenseMLP, LatentMoE
from model.kimi_k3.parallel import TP

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [300, 2, 77]]
NEW_TOKENS = 4
TIMEOUT_S = 120  # a broken collective fails the test instead of hanging it

# SPEC.md §9: rank-local shapes of the K3 config at TP8 and TP16 (MXFP4 experts: two values per byte).
SPEC_SHAPES = {
    8: {"kda.in_proj": (6288, 7168), "kda.conv_weight": (4608, 1, 4), "kda.f_b": (1536, 128), "kda.A_log": (12,),
        "kda.dt_bias": (1536,), "kda.o_proj": (7168, 1536), "mla.fused_qkv_a": (2112, 7168),
        "mla.q_b_proj": (2304, 1536), "mla.kv_b_proj": (3072, 512), "mla.g_proj": (1536, 7168),
        "mla.o_proj": (7168, 1536), "moe.w13_weight_packed": (896, 768, 1792), "moe.w2_weight_packed": (896, 3584, 192),
        "moe.gate": (896, 7168), "moe.down_proj": (3584, 7168), "moe.up_proj": (7168, 3584),
        "moe.shared_gate_up": (1536, 7168), "moe.shared_down": (7168, 768), "dense.gate_up": (8448, 7168),
        "dense.down": (7168, 4224), "vocab.embed": (20480, 7168), "vocab.lm_head": (20480, 7168)},
    16: {"kda.in_proj": (3216, 7168), "kda.conv_weight": (2304, 1, 4), "kda.f_b": (768, 128), "kda.A_log": (6,),
         "kda.dt_bias": (768,), "kda.o_proj": (7168, 768), "mla.fused_qkv_a": (2112, 7168),
         "mla.q_b_proj": (1152, 1536), "mla.kv_b_proj": (1536, 512), "mla.g_proj": (768, 7168),
         "mla.o_proj": (7168, 768), "moe.w13_weight_packed": (896, 512, 1792), "moe.w2_weight_packed": (896, 3584, 128),
         "moe.gate": (896, 7168), "moe.down_proj": (3584, 7168), "moe.up_proj": (7168, 3584),
         "moe.shared_gate_up": (768, 7168), "moe.shared_down": (7168, 384), "dense.gate_up": (4224, 7168),
         "dense.down": (7168, 2112), "vocab.embed": (10240, 7168), "vocab.lm_head": (10240, 7168)},
}


@pytest.mark.parametrize("size", sorted(SPEC_SHAPES))
def test_rank_local_shapes_follow_spec(size):
    cfg, tp = preset("k3"), TP(rank=size - 1, size=size)
    with torch.device("meta"):
        modules = {"kda": KimiDeltaAttention(cfg, 0, tp, torch.bfloat16), "mla": KimiMLA(cfg, 3, tp, torch.bfloat16),
                   "moe": LatentMoE(cfg, 1, tp, torch.bfloat16), "dense": DenseMLP(cfg, 0, tp, torch.bfloat16),
                   "vocab": VocabParallel(cfg, tp, torch.bfloat16)}
    shapes = {f"{m}.{name}": tuple(modules[m].get_parameter(name).shape)
              for m, name in (key.split(".") for key in SPEC_SHAPES[size])}
    assert shapes == SPEC_SHAPES[size]


def test_tiny_tp4_pads_the_expert_shards(tiny_cfg):
    """The TP4 run below goes through the padding path: 128 / 4 = 32 intermediate rows, padded to 128."""
    assert tiny_cfg.moe_intermediate_size // 4 == 32 and tiny_cfg.expert_intermediate_local(4) == 128


def run_rank(tp: TP, device: torch.device, ckpt: str) -> dict:
    """On one rank: prefill logits, then plain and speculative greedy generations."""
    model = load_model(ckpt, tp=tp, act_dtype=torch.float32, device=device)
    cache = ModelCache(model.cfg, tp, len(PROMPTS), 16, torch.float32, device)
    batch = StepBatch(tuple(cache.allocate() for _ in PROMPTS), tuple(map(len, PROMPTS)), (0,) * len(PROMPTS))
    logits = model.logits(model(torch.tensor([t for p in PROMPTS for t in p], device=device), batch, cache))
    engine = Engine(model, max_len=16, num_slots=len(PROMPTS))
    plain = engine.generate(PROMPTS, SamplingParams(NEW_TOKENS))
    spec = engine.generate(PROMPTS, SamplingParams(NEW_TOKENS), spec_tokens=3, drafter=NgramDrafter())
    return {"logits": logits.cpu(), "tokens": [g.tokens for g in plain], "logprobs": [g.logprobs for g in plain],
            "spec": [g.tokens for g in spec]}


@pytest.fixture(scope="module")
def tp1(tiny_ckpt):
    return run_rank(TP(), torch.device("cpu"), str(tiny_ckpt))


@pytest.mark.parametrize("size", [2, 4])
def test_tp_matches_tp1(size, tiny_ckpt, tp1):
    out = run_tp(run_rank, size, str(tiny_ckpt), timeout=TIMEOUT_S)
    # partial sums are reduced in another order: equal within fp32 rounding (observed ~4e-5 on logits ~8)
    torch.testing.assert_close(out["logits"], tp1["logits"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(out["logprobs"]), torch.tensor(tp1["logprobs"]), rtol=1e-4, atol=1e-4)
    assert out["tokens"] == tp1["tokens"]
    assert out["spec"] == tp1["tokens"]


def fail_on_rank_1(tp: TP, device: torch.device) -> int:
    if tp.rank == 1:
        raise ValueError("rank 1 refuses")
    tp.all_reduce(torch.ones(1))  # rank 0 waits in a collective that rank 1 never joins
    return tp.rank


def stall_on_rank_1(tp: TP, device: torch.device) -> None:
    if tp.rank == 1:
        time.sleep(60)


def test_run_tp_reraises_a_rank_error():
    with pytest.raises(ValueError, match="rank 1 refuses") as info:
        run_tp(fail_on_rank_1, 2, timeout=TIMEOUT_S)
    assert any("TP rank 1" in note for note in info.value.__notes__)


def test_run_tp_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ranks \\[1\\] still running"):
        run_tp(stall_on_rank_1, 2, timeout=2)
    assert time.monotonic() - start < 30
