"""Generation refuses what it cannot do right (issue 22): non-finite logits, sampling parameters or sizes it
cannot honour, all before anything large is allocated. Each test here failed before its fix."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gates.cli import main
from model.kimi_k3 import engine as engine_module
from model.kimi_k3.engine import Engine, SamplingParams


def generate(capsys, ckpt, *extra: str) -> tuple[int, str]:
    code = main(["generate", "--ckpt", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--dtype", "fp32",
                 "--device", "cpu", *extra])
    return code, capsys.readouterr().err


@pytest.fixture
def poisoned(tiny_ckpt, tmp_path):
    """A copy of the tiny checkpoint with one tensor (the first whose name holds `part`) set to NaN; zero padding
    stays zero (A_log is stored padded, and the loader refuses padding that is not zero)."""
    def make(part: str):
        ckpt = shutil.copytree(tiny_ckpt, tmp_path / "nan")
        tensors = load_file(ckpt / "model.safetensors")
        name = next(k for k in sorted(tensors) if part in k and tensors[k].is_floating_point())
        tensors[name] = torch.where(tensors[name] == 0, tensors[name], float("nan"))
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
        return ckpt
    return make


@pytest.mark.parametrize("part, where, extra", [
    ("layers.1.self_attn.A_log", "the first module whose output is not finite is layers.1.self_attn", ()),
    ("layers.1.self_attn.A_log", "the first module whose output is not finite is layers.1.self_attn",
     ("--spec-tokens", "2")),
    ("embed_tokens", "the token embedding", ()),
    ("lm_head", "the output head (lm_head)", ()),
])
def test_non_finite_logits_stop_generation_and_name_where_they_start(poisoned, capsys, part, where, extra):
    code, err = generate(capsys, poisoned(part), *extra)
    assert code == 2 and "the logits are not finite" in err and where in err, err


def test_a_finite_step_costs_one_check_and_no_search(tiny_model, monkeypatch):
    monkeypatch.setattr(Engine, "_first_nonfinite",
                        lambda *args: pytest.fail("searched a step whose logits are finite"))
    assert len(Engine(tiny_model, max_len=16).generate([[1, 2, 3]], SamplingParams(3))[0].tokens) == 3


@pytest.mark.parametrize("extra", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_non_finite_sampling_parameters_are_refused(tiny_ckpt, capsys, extra):
    code, err = generate(capsys, tiny_ckpt, *extra)
    assert code == 2 and "--temperature must be a finite number >= 0 and --top-p in (0, 1]" in err


def test_the_engine_refuses_non_finite_sampling_parameters(tiny_model):
    with pytest.raises(ValueError, match="a finite temperature"):
        Engine(tiny_model, max_len=16).generate([[1]], SamplingParams(2, temperature=float("nan")))


@pytest.mark.parametrize("extra", [("--max-new-tokens", "1000000000"), ("--spec-tokens", "100000")])
def test_positions_beyond_max_position_embeddings_are_refused_before_loading(tiny_ckpt, capsys, extra):
    code, err = generate(capsys, tiny_ckpt, *extra)
    assert code == 2 and "(max_position_embeddings)" in err and len(err.splitlines()) == 1, err


def test_a_config_too_large_for_this_machine_is_refused_before_loading(tiny_ckpt, tmp_path, capsys):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "huge")
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["hidden_size"] = 10**10
    (ckpt / "config.json").write_text(json.dumps(config))
    code, err = generate(capsys, ckpt)
    assert code == 2 and "the weights of 1 TP1 rank(s) need" in err and "GiB is free on cpu" in err, err


def test_caches_that_would_not_fit_are_refused_before_allocation(tiny_model):
    with pytest.raises(ValueError, match=r"the caches of 8 sequences of 1000000000 positions need [\d,.]+ GiB"):
        Engine(tiny_model, max_len=10**9)


def test_verification_states_that_would_not_fit_are_refused_before_allocation(tiny_model, monkeypatch):
    from model.kimi_k3.drafters import NgramDrafter

    engine = Engine(tiny_model, max_len=2048)
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: 2**20)  # 1 MiB free from now on
    with pytest.raises(ValueError, match="the verification states of 1000 draft tokens for 8 sequences need"):
        engine.generate([[1, 2]], SamplingParams(4), spec_tokens=1000, drafter=NgramDrafter())
    assert engine.cache.spec_tokens == 0  # nothing was allocated
