"""Tensor parallelism on GPUs: NCCL between one process per GPU, the decode step replayed from a CUDA graph with
its collectives captured. The TP2 comparison needs two GPUs (an nvidia-h200-x2 machine: `kernels/gpu_session.sh
tp2`); on CPU run the backend choice, the refusals, and the graph's step function (decode from index tensors,
padded rows on a scratch slot) against the plain step, at TP1 and over gloo at TP2."""

from __future__ import annotations

import pytest
import torch

from gates.cli import main
from gates.evals.subject import first_layers
from model.kimi_k3.batch import StepBatch
from model.kimi_k3.checkpoint import RandomSource, checkpoint_tensors
from model.kimi_k3.config import KimiK3Config, preset
from model.kimi_k3.distributed import run_tp, tp_backend
from model.kimi_k3.engine import Engine
from model.kimi_k3.errors import EXIT_USAGE
from model.kimi_k3.loader import load_model, load_weights
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.moe import LatentMoE
from model.kimi_k3.parallel import TP

PROMPTS = [[11, 5, 9, 13, 17, 21, 25], [300, 2, 77]]
STEPS = 8  # decode steps after the prefill
TIMEOUT_S = 600
# bf16 TP2 against TP1: each rank rounds its row-parallel partial to bf16 before the all-reduce, where TP1 rounds
# the whole product once: 2.8e-3 relative L2 on the hidden state after one layer (issue 22's TP_BF16_FINDING),
# growing layer by layer and, through the KDA states and the MLA cache, step by step. Measured with this test's
# own functions on CPU over gloo, tiny preset (8 layers, 128 wide, routing pinned): logits 2.9e-2 and 5.7e-2
# apart at the prefill, 2.7e-2 to 2.2e-1 over 8 decode steps with the same tokens; a wrong split is O(1) (a
# sequence whose tokens part: 1.4). Not yet measured at K3 widths: the test prints its figures, tighten these
# from them.
PREFILL_REL_L2 = 1e-1
DECODE_REL_L2 = 3e-1


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_backend_is_gloo_on_cpu_and_nccl_on_cuda(monkeypatch):
    assert tp_backend("cpu", 4) == "gloo"
    fake_gpus(monkeypatch, 2)
    assert tp_backend("cuda", 2) == "nccl"
    assert tp_backend("cuda:1", 1) == "nccl"  # one rank: the named GPU, no process group


@pytest.mark.parametrize("device, size, gpus, message", [
    ("cuda", 2, 1, "TP2 on cuda needs 2 GPUs (one per rank); 1 visible"),
    ("cuda", 2, 0, "TP2 on cuda needs 2 GPUs (one per rank); 0 visible"),
    ("cuda:1", 2, 2, "rank r runs on cuda:r; name the device cuda, without an index"),
    ("meta", 2, 2, "tensor parallelism runs on cpu (gloo) or cuda (NCCL)"),
])
def test_backend_refusals(monkeypatch, device, size, gpus, message):
    fake_gpus(monkeypatch, gpus)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tp_backend(device, size)


@pytest.mark.parametrize("gpus, extra, message", [
    (1, ["--device", "cuda", "--tp", "2"], "--tp 2 --device cuda: TP2 on cuda needs 2 GPUs (one per rank); 1 visible"),
    (2, ["--device", "cuda:1", "--tp", "2"], "rank r runs on cuda:r"),
    (0, ["--device", "cuda", "--tp", "2"], "--device cuda: this machine has 0 CUDA GPU(s)"),
    (0, ["--device", "cpu", "--eager"], "--eager: CUDA graphs run only on cuda"),
])
def test_generate_refuses_in_one_line_before_any_work(capsys, monkeypatch, tiny_ckpt, gpus, extra, message):
    fake_gpus(monkeypatch, gpus)
    argv = ["generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1,2", *extra]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cuda_graphs_need_a_cuda_model(tiny_model):
    with pytest.raises(ValueError, match="CUDA graphs need a cuda device; the model is on cpu"):
        Engine(tiny_model, max_len=16, graph_sizes=(1,))


def prefill(engine: Engine) -> tuple[list[int], torch.Tensor]:
    """Each prompt in its own slot, prefilled in one step: (slots, the first greedy tokens)."""
    slots = [engine.cache.allocate() for _ in PROMPTS]
    batch = StepBatch(tuple(slots), tuple(map(len, PROMPTS)), (0,) * len(PROMPTS))
    return slots, engine.step([t for p in PROMPTS for t in p], batch).argmax(-1)


def indexed_decode_on_rank(tp: TP, device: torch.device, ckpt: str) -> dict:
    """Two decode steps from the same state: the plain step, and the graph's step function on index tensors padded
    to four rows with a scratch slot (what a replay at captured size 4 computes)."""
    model = load_model(ckpt, tp=tp, act_dtype=torch.float32, device=device)
    out = {}
    for way in ("step", "indexed"):
        engine = Engine(model, max_len=16, num_slots=len(PROMPTS) + 1)
        slots, tokens = prefill(engine)
        scratch = engine.cache.allocate()
        positions = [engine.cache.lengths[s] for s in slots]
        if way == "step":
            out[way] = engine.step(tokens, StepBatch(tuple(slots), (1,) * len(slots), tuple(positions)))
            continue
        pad = 4 - len(slots)
        ids = torch.cat([tokens, torch.zeros(pad, dtype=torch.long)])
        index = torch.tensor(slots + [scratch] * pad)
        out[way] = engine.decode_logits(ids, index, torch.tensor(positions + [0] * pad))[:len(slots)]
    return out


@pytest.mark.parametrize("size", [1, 2])
def test_the_graphed_step_function_matches_the_decode_step(size, tiny_ckpt):
    out = run_tp(indexed_decode_on_rank, size, str(tiny_ckpt), timeout=120)
    # fp32; the padded rows change the GEMMs' row count and so their blocking (observed ~3e-5 on logits ~8)
    torch.testing.assert_close(out["indexed"], out["step"], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ two GPUs


def k3_widths() -> KimiK3Config:
    """Every width K3's (hidden 7168, 96 KDA heads of 128, MLA, 3072-wide MXFP4 experts on a 3584 latent, the
    163840-token vocabulary), four layers (dense KDA, two KDA + MoE, MLA + MoE) and 32 experts: ~10 GB a model."""
    body = first_layers(preset("k3"), 4).model_dump()
    body["num_experts"] = 32
    return KimiK3Config.model_validate(body)


def greedy_on_rank(tp: TP, device: torch.device, graphs: bool) -> dict:
    """Greedy decoding of PROMPTS for STEPS steps at K3 widths, bf16: every step's logits [1 + STEPS, B, V] and
    tokens, and how many decode steps replayed a CUDA graph. The router's correction bias pins every token to
    experts 0..15 (by a margin of 1 over sigmoid keys in (0, 1)), so that what the comparison sees is TP rounding,
    not near-tied router keys routing a token elsewhere (TP_BF16_FINDING: bf16 TP1 and TP2 then diverge)."""
    cfg = k3_widths()
    with torch.device(device):
        model = KimiK3Model(cfg, tp, torch.bfloat16)
    load_weights(model, RandomSource(checkpoint_tensors(cfg), seed=0, device=device), origin="random K3 widths")
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.e_bias.copy_((torch.arange(cfg.num_experts, device=device) < module.top_k).float() * 2)
    engine = Engine(model.eval(), max_len=max(map(len, PROMPTS)) + STEPS + 1, num_slots=len(PROMPTS),
                    graph_sizes=(len(PROMPTS),) if graphs else ())
    slots = [engine.cache.allocate() for _ in PROMPTS]
    batch = StepBatch(tuple(slots), tuple(map(len, PROMPTS)), (0,) * len(PROMPTS))
    logits = [engine.step([t for p in PROMPTS for t in p], batch).cpu()]
    for _ in range(STEPS):
        batch = StepBatch(tuple(slots), (1,) * len(slots), tuple(engine.cache.lengths[s] for s in slots))
        logits.append(engine.step(logits[-1].argmax(-1).to(device), batch).cpu())
    logits = torch.stack(logits)
    return {"logits": logits, "tokens": logits.argmax(-1), "replays": engine.graphs.replays if engine.graphs else 0}


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def compared_steps(got: dict, ref: dict, prefill_rel_l2: float, decode_rel_l2: float) -> int:
    """Steps (the prefill, then each decode step) of two greedy runs compared per sequence: each step's logits
    within its bound (relative L2) up to and including the first step whose greedy tokens differ, after which
    the sequence is not comparable (a top-2 near-tie that rounding within the bound settled the other way). The
    number of (sequence, step) pairs compared; prints each step's figure."""
    n = 0
    for b in range(len(PROMPTS)):
        for s in range(1 + STEPS):
            rel, bound = rel_l2(got["logits"][s, b], ref["logits"][s, b]), decode_rel_l2 if s else prefill_rel_l2
            same = bool(got["tokens"][s, b] == ref["tokens"][s, b])
            print(f"sequence {b} step {s}: logits {rel:.2e} rel. L2 apart (bound {bound:g}), same token: {same}")
            assert rel <= bound, f"sequence {b}, step {s}: logits {rel:.2e} rel. L2 apart (> {bound:g})"
            n += 1
            if not same:
                break
    return n


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL TP2 needs 2 GPUs (an nvidia-h200-x2 machine: kernels/gpu_session.sh tp2)")
def test_nccl_tp2_under_cuda_graphs_matches_tp1():
    """TP2 over NCCL on cuda:0 and cuda:1, decode steps replayed from a CUDA graph with the all-reduces and the
    lm_head's all-gather captured: the same greedy tokens as TP1 (on cuda:0, also graphed) and logits within bf16
    rounding of the partial sums; and the graphed TP2 run equals the eager one token for token."""
    tp1 = greedy_on_rank(TP(), torch.device("cuda", 0), graphs=True)
    torch.cuda.empty_cache()
    tp2 = run_tp(greedy_on_rank, 2, True, device="cuda", timeout=TIMEOUT_S)
    tp2_eager = run_tp(greedy_on_rank, 2, False, device="cuda", timeout=TIMEOUT_S)
    assert tp1["replays"] == tp2["replays"] == STEPS and tp2_eager["replays"] == 0
    assert torch.equal(tp2["tokens"], tp2_eager["tokens"])  # one computation, captured or not
    assert compared_steps(tp2, tp2_eager, 1e-3, 1e-3) == (1 + STEPS) * len(PROMPTS)
    # Most steps must be comparable, or the test said nothing: a near-tie ends a sequence's comparison.
    assert compared_steps(tp2, tp1, PREFILL_REL_L2, DECODE_REL_L2) >= (1 + STEPS) * len(PROMPTS) // 2
