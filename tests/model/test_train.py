"""The mini-K3 training code: its forward equals the model's own prefill and decode, gradients reach every trained
parameter, the export is a checkpoint the loader takes (MXFP4 experts, under 20 MB), the tasks are what they say,
and the command trains and writes on CPU."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from model.kimi_k3.batch import StepBatch
from model.kimi_k3.checkpoint import RandomSource, checkpoint_tensors
from model.kimi_k3.engine import Engine
from model.kimi_k3.loader import load_model, load_weights
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.tokenizer import build_tokenizer
from model.kimi_k3.train import export
from model.kimi_k3.train.__main__ import main
from model.kimi_k3.train.config import Recipe, dense_experts, mini_config
from model.kimi_k3.train.data import Tasks
from model.kimi_k3.train.forward import TrainOps, logits, trainable


@pytest.fixture(scope="module")
def dense_model():
    cfg = dense_experts(mini_config())
    model = KimiK3Model(cfg, act_dtype=torch.float32)
    load_weights(model, RandomSource(checkpoint_tensors(cfg), 3))
    return model


@pytest.fixture(scope="module")
def tasks():
    cfg = mini_config()
    return Tasks(build_tokenizer(cfg), cfg)


def test_training_forward_equals_the_model_prefill_and_decode(dense_model):
    """Two sequences of 40 tokens in chunks of 16 (a partial last chunk) against the engine's prefill; the first 10
    tokens fed one decode step at a time."""
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = logits(dense_model, ids, TrainOps(), chunk=16)
    engine = Engine(dense_model, 40, num_slots=2)
    served = engine.step(ids.flatten().tolist(), StepBatch((0, 1), (40, 40), (0, 0)), every_token=True)
    torch.testing.assert_close(trained, served.view(2, 40, -1), atol=2e-4, rtol=1e-4)
    engine = Engine(dense_model, 40, num_slots=2)
    decoded = [engine.step(ids[:, 0].tolist(), StepBatch((0, 1), (1, 1), (0, 0)))]
    for p in range(1, 10):
        decoded.append(engine.step(ids[:, p].tolist(), StepBatch((0, 1), (1, 1), (p, p))))
    torch.testing.assert_close(trained[:, :10], torch.stack(decoded, 1), atol=2e-4, rtol=1e-4)


def test_gradients_reach_every_trained_parameter_and_loads_are_counted(dense_model):
    groups = trainable(dense_model)
    ops = TrainOps()
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    logits(dense_model, ids, ops, chunk=16).logsumexp(-1).mean().backward()
    missing = [n for n, p in dense_model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == ["layers.0.attn_res.norm", "layers.0.attn_res.proj"]  # layer 0 mixes nothing (SPEC.md §2.3)
    assert all(torch.isfinite(p.grad).all() for g in groups.values() for p in g if p.grad is not None)
    loads = ops.take_loads()
    assert len(loads) == 7 and all(int(c.sum()) == 48 * 4 for _, c in loads)  # 7 MoE layers, 48 tokens x top 4
    assert not any(n.endswith("e_bias") for n, p in dense_model.named_parameters() if p.requires_grad)
    dense_model.zero_grad(set_to_none=True)


def test_warm_up_visits_every_length_and_changes_no_state(dense_model, tasks, monkeypatch, tmp_path):
    """The passes before a run times its steps (FLA compiles and autotunes per length) leave the parameters, their
    gradients and the router's loads as they were."""
    from model.kimi_k3.train import loop

    run = loop.Run(out=tmp_path, seed=0, device=torch.device("cpu"), minutes=1.0,
                   recipe=Recipe(tokens_per_step=128, lengths=(64, 128, 64)))
    seen, forward = [], loop._forward
    monkeypatch.setattr(loop, "_forward", lambda model, ids, ops, r: seen.append(ids.shape[1]) or forward(model, ids,
                                                                                                           ops, r))
    trainable(dense_model)  # as train() does before the warm-up
    before = {n: p.detach().clone() for n, p in dense_model.named_parameters()}
    ops = TrainOps()
    loop._warm_up(dense_model, tasks, ops, run)
    assert seen == [64, 128]
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in dense_model.named_parameters())
    assert ops.take_loads() == []


def test_export_is_a_k3_checkpoint_with_mxfp4_experts(dense_model, tmp_path):
    cfg = mini_config()
    export.write(dense_model, cfg, tmp_path, {"seed": 3})
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) < 20e6
    loaded = load_model(tmp_path, act_dtype=torch.float32)
    assert loaded.cfg.experts_quantized and json.loads((tmp_path / export.RECORD_FILE).read_text()) == {"seed": 3}
    ours = dict(dense_model.named_parameters())
    for name, p in loaded.named_parameters():  # bf16 tensors within their rounding, fp32 ones exact
        if p.dtype != torch.uint8:
            torch.testing.assert_close(p, ours[name].detach(), atol=0, rtol=4e-3)


def test_tasks_are_what_they_say(tasks):
    rng = random.Random(0)
    s = tasks.recall(rng, 200, 6)
    assert len(s.tokens) == 200 and all(s.tokens[p] == tasks.eq for p in s.targets)
    assert [s.tokens[p + 1] for p in s.targets] == s.meta["answers"]
    j = tasks.json(rng)
    value = json.loads(tasks.decode(j.tokens[j.prompt_len:-1]))
    assert value == j.meta["record"] and jsonschema.Draft202012Validator(j.meta["schema"]).is_valid(value)
    pick = tasks.pick(rng)
    assert abs(sum(pick.meta["distribution"].values()) - 1) < 1e-12 and pick.tokens[-1] in pick.meta["distribution"]
    ids, nxt, weight = tasks.batch(rng, 4, 128, 0.5)
    assert ids.shape == nxt.shape == weight.shape == (4, 128) and torch.equal(ids[:, 1:], nxt[:, :-1])
    assert abs(weight.sum().item() - 1) < 1e-6


def test_train_command_writes_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "mini"
    code = main(["--out", str(out), "--device", "cpu", "--steps", "1", "--tokens-per-step", "64", "--lengths", "64",
                 "--heldout-rows", "1"])
    record = json.loads((out / export.RECORD_FILE).read_text())
    assert code == 0 and record["steps"] == 1 and record["data_version"] == 2  # the default mix: data version 2
    assert record["recipe"]["recency_fraction"] > 0 and record["recipe"]["window_fraction"] > 0
    assert set(record["heldout"]["mxfp4_experts"]) >= {"recall@64", "json", "copy", "arithmetic", "pick_tv",
                                                       "recency@64", "window@64"}
    assert record["command"].endswith("--heldout-rows 1") and load_model(out).cfg.experts_quantized


def test_a_timed_run_warms_up_first_and_stops_on_time(tmp_path, monkeypatch):
    """Without --steps the run warms up (each length once), then trains until its minutes are spent."""
    from model.kimi_k3.train import loop

    warmed = []
    monkeypatch.setattr(loop, "_warm_up", lambda *args: warmed.append(args[-1].recipe.lengths))
    out = tmp_path / "mini"
    assert main(["--out", str(out), "--device", "cpu", "--minutes", "0.01", "--tokens-per-step", "64", "--lengths",
                 "64", "--heldout-rows", "1"]) == 0
    record = json.loads((out / export.RECORD_FILE).read_text())
    assert warmed == [(64,)] and record["steps"] >= 1


@pytest.mark.parametrize("argv, message", [(["--lengths", "a"], "--lengths"), (["--lengths", "16"], "at least 64"),
                                           (["--minutes", "0"], "--minutes"), (["--window-steps", "-1"], "negative")])
def test_train_command_usage_errors(tmp_path, capsys, argv, message):
    assert main(["--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_window_curriculum_comes_first_then_the_mix(tmp_path):
    recipe = Recipe(window_steps=2)
    assert recipe.mix(0) == recipe.mix(1) == (0.0, {"recency_fraction": 0.0, "window_fraction": 1.0})
    assert recipe.mix(2) == (recipe.recall_fraction, {"recency_fraction": recipe.recency_fraction,
                                                       "window_fraction": recipe.window_fraction})
    assert Recipe(recency_fraction=0, window_fraction=0, window_steps=1).data_version == 2
    out = tmp_path / "mini"
    assert main(["--out", str(out), "--device", "cpu", "--steps", "1", "--tokens-per-step", "64", "--lengths", "64",
                 "--heldout-rows", "1", "--window-steps", "1"]) == 0
    assert json.loads((out / export.RECORD_FILE).read_text())["recipe"]["window_steps"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: FLA's chunk_kda is a Triton kernel")
def test_fla_chunk_kda_agrees_with_the_chunked_reference_on_the_gpu():
    """Training uses FLA's recurrence only where it agrees with ops/kda.py's chunked form; on the H200 it must."""
    from model.kimi_k3.train.forward import fla_chunk_kda

    assert fla_chunk_kda(torch.device("cuda")) is not None
