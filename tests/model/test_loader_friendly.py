"""What the loader accepts beyond an exact match (issue 16 item 8), and how it names what it refuses.

- Float tensors stored in another plain float dtype than declared are converted, one log line per dtype pair;
  integer and packed tensors (MXFP4 uint8) must match exactly.
- A_log loads per head ([H]) or zero-padded ([128] in K3); nonzero padding is refused.
- Errors name tensors as the checkpoint's files do (`language_model.` prefix in the K3 layout, none in a flat one).
Checkpoints are the tiny preset written by `write_checkpoint` (`k3forge ckpt make`), then edited.
"""

import logging

import pytest
import torch
from safetensors.torch import load_file

from model.kimi_k3.checkpoint import write_checkpoint
from model.kimi_k3.loader import load_model
from model.kimi_k3.parallel import TP
from model.kimi_k3.weights import CheckpointError
from tests.model.edits import rewrite

P = "language_model."
NORM = P + "model.layers.{}.input_layernorm.weight"  # declared bf16
DT_BIAS = P + "model.layers.{}.self_attn.dt_bias"  # declared fp32
A_LOG = P + "model.layers.{}.self_attn.A_log"  # declared fp32 [128], the first H entries real
PACKED = P + "model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"  # declared uint8
SCALE = P + "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"  # declared uint8 (E8M0)




def kda_layers(cfg):
    return [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i)]


def params(model):
    return dict(model.named_parameters())


def cast_lines(caplog):
    return [r.getMessage() for r in caplog.records if "converted on load" in r.getMessage()]


def test_float_tensors_in_another_float_dtype_are_converted(ckpt, tiny_cfg, tiny_model, caplog):
    layers = kda_layers(tiny_cfg)

    def edit(t):
        for i in range(tiny_cfg.num_hidden_layers):
            t[NORM.format(i)] = t[NORM.format(i)].float()  # bf16 declared, fp32 stored
        for i in layers:
            t[DT_BIAS.format(i)] = t[DT_BIAS.format(i)].to(torch.bfloat16)  # fp32 declared, bf16 stored

    rewrite(ckpt, edit)
    stored = load_file(ckpt / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="model.kimi_k3.loader"):
        model = load_model(ckpt, act_dtype=torch.float32)
    got, want = params(model), params(tiny_model)
    for name in want:
        if not name.endswith("dt_bias"):  # fp32 values of bf16 norm weights: exactly the original
            assert torch.equal(got[name], want[name]), name
    for i in layers:
        dt_bias = got[f"layers.{i}.self_attn.dt_bias"]
        assert dt_bias.dtype == torch.float32
        assert torch.equal(dt_bias, stored[DT_BIAS.format(i)].float())
    lines = cast_lines(caplog)
    assert len(lines) == 2, lines  # one per (declared, stored) pair, however many tensors
    assert any(f"{tiny_cfg.num_hidden_layers} tensor(s) stored as torch.float32 where the model declares "
               "torch.bfloat16" in line and NORM.format(0) in line for line in lines), lines
    assert any(f"{len(layers)} tensor(s) stored as torch.bfloat16 where the model declares torch.float32" in line
               for line in lines), lines


def test_converted_tensor_rounds_once_to_a_bf16_parameter(ckpt, tiny_model):
    """fp32 stored where bf16 is declared, loaded for bf16 activations: rounded to bf16 once."""
    name = NORM.format(2)
    fine = tiny_model.layers[2].input_layernorm.weight.detach() + 1e-3  # fp32 values bf16 cannot hold
    rewrite(ckpt, lambda t: t.update({name: fine.clone()}))
    model = load_model(ckpt, act_dtype=torch.bfloat16)
    assert torch.equal(model.layers[2].input_layernorm.weight, fine.to(torch.bfloat16))


def test_exact_dtypes_log_nothing(tiny_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="model.kimi_k3.loader"):
        load_model(tiny_ckpt, act_dtype=torch.float32)
    assert cast_lines(caplog) == []


@pytest.mark.parametrize("stored", [torch.int8, torch.bfloat16], ids=["int8", "bf16"])
def test_packed_mxfp4_tensor_must_match_exactly(ckpt, stored):
    rewrite(ckpt, lambda t: t.update({PACKED: t[PACKED].to(stored)}))
    with pytest.raises(CheckpointError, match=rf"tensor {PACKED} has dtype {stored}, expected torch.uint8"):
        load_model(ckpt)


def test_e8m0_scale_must_match_exactly(ckpt):
    rewrite(ckpt, lambda t: t.update({SCALE: t[SCALE].float()}))
    with pytest.raises(CheckpointError, match=rf"tensor {SCALE} has dtype torch.float32, expected torch.uint8"):
        load_model(ckpt)


def test_float8_is_not_converted(ckpt):
    """An fp8 weight needs its scales: a plain cast would be silently wrong."""
    name = NORM.format(1)
    rewrite(ckpt, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has dtype torch.float8_e4m3fn, expected torch.bfloat16"):
        load_model(ckpt)


def per_head_a_log(cfg):
    heads = cfg.kda_heads
    return lambda t: t.update({A_LOG.format(i): t[A_LOG.format(i)][:heads].clone() for i in kda_layers(cfg)})


def test_a_log_per_head_loads_like_the_padded_form(ckpt, tiny_cfg, tiny_model):
    rewrite(ckpt, per_head_a_log(tiny_cfg))
    assert load_file(ckpt / "model.safetensors")[A_LOG.format(0)].shape == (tiny_cfg.kda_heads,)
    got, want = params(load_model(ckpt, act_dtype=torch.float32)), params(tiny_model)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_log_per_head_splits_across_ranks(ckpt, tiny_cfg, tiny_model):
    rewrite(ckpt, per_head_a_log(tiny_cfg))
    ranks = [load_model(ckpt, tp=TP(r, 2), act_dtype=torch.float32) for r in range(2)]
    for i in kda_layers(tiny_cfg):
        halves = [m.layers[i].self_attn.A_log for m in ranks]
        assert halves[0].shape == (tiny_cfg.kda_heads // 2,)
        assert torch.equal(torch.cat(halves), tiny_model.layers[i].self_attn.A_log)


def test_a_log_nonzero_padding_names_the_tensor(ckpt, tiny_cfg):
    name, heads = A_LOG.format(4), tiny_cfg.kda_heads

    def edit(t):
        t[name][heads] = 0.5
        t[name][-1] = -1.0

    rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=rf"tensor {name} has 2 nonzero entries past its {heads} real ones "
                                              r"along dim 0: its padding must be zero"):
        load_model(ckpt)


def test_a_log_shorter_than_the_heads_is_refused(ckpt, tiny_cfg):
    name, heads = A_LOG.format(0), tiny_cfg.kda_heads
    rewrite(ckpt, lambda t: t.update({name: t[name][:heads - 1].clone()}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \[{heads - 1}\], expected \[128\] "
                                              rf"\(zero-padded\) or \[{heads}\]"):
        load_model(ckpt)


def test_errors_name_tensors_with_the_files_prefix(ckpt):
    """Every kind of refusal in the K3 layout names the tensor with its `language_model.` prefix."""
    shaped = P + "model.layers.2.self_attn.q_proj.weight"

    def edit(t):
        t.pop(PACKED)
        t[P + "model.layers.0.self_attn.bogus"] = torch.zeros(2)
        t[shaped] = torch.zeros(64, 128, dtype=torch.bfloat16)
        t[SCALE] = t[SCALE].to(torch.int8)

    rewrite(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    message = str(e.value)
    assert f"missing tensor {PACKED} (expected shape" in message
    assert f"unexpected tensor {P}model.layers.0.self_attn.bogus" in message
    assert f"tensor {shaped} has shape [64, 128], expected [128, 128]" in message
    assert f"tensor {SCALE} has dtype torch.int8, expected torch.uint8" in message


def test_errors_in_a_flat_checkpoint_name_tensors_without_a_prefix(tiny_cfg, tmp_path):
    flat = write_checkpoint(tiny_cfg, tmp_path / "flat", seed=0, nested=False)
    name = PACKED.removeprefix(P)
    rewrite(flat, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError, match=rf": tensor {name} has dtype torch.int8"):
        load_model(flat)
