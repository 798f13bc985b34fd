"""Checkpoint formats the loader accepts, and every malformed case refused with a named error."""

import json

import pytest
import torch
from safetensors.torch import load_file

from model.kimi_k3.checkpoint import write_checkpoint
from model.kimi_k3.config import ConfigError
from model.kimi_k3.loader import load_model
from model.kimi_k3.parallel import TP
from model.kimi_k3.weights import CheckpointError
from tests.model.edits import rewrite

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"




def params_equal(a, b):
    return all(torch.equal(p, q) for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()))


def test_nested_checkpoint_layout(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["text_config"]["model_type"] == "kimi_linear"
    names = load_file(tiny_ckpt / "model.safetensors")
    assert names[EXPERT].dtype == torch.uint8
    assert names[EXPERT.replace("packed", "scale")].dtype == torch.uint8
    assert names["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert names["language_model.lm_head.weight"].dtype == torch.bfloat16


def test_flat_and_sharded_checkpoints_load_the_same_weights(tiny_cfg, tiny_model, tmp_path, monkeypatch):
    import model.kimi_k3.checkpoint as ck

    monkeypatch.setattr(ck, "MAX_SHARD_BYTES", 1 << 20)  # force several shards and an index
    flat = write_checkpoint(tiny_cfg, tmp_path / "flat", seed=0, nested=False)
    assert (flat / "model.safetensors.index.json").exists()
    assert params_equal(load_model(flat, act_dtype=torch.float32), tiny_model)


def test_dense_expert_checkpoint(tiny_cfg, tmp_path):
    dense_cfg = tiny_cfg.model_copy(update={"quantization_config": None})
    path = write_checkpoint(dense_cfg, tmp_path / "dense", seed=0)
    model = load_model(path, act_dtype=torch.float32)
    assert model.layers[1].ffn.w13_weight.dtype == torch.float32
    assert not any(n.endswith("packed") for n, _ in model.named_parameters())


def test_rank_slices_reassemble_the_full_tensors(tiny_ckpt, tiny_model):
    ranks = [load_model(tiny_ckpt, tp=TP(r, 2), act_dtype=torch.float32) for r in range(2)]
    full = tiny_model.layers[0].self_attn
    halves = [m.layers[0].self_attn for m in ranks]
    torch.testing.assert_close(torch.cat([h.o_proj for h in halves], dim=1), full.o_proj)
    torch.testing.assert_close(torch.cat([h.A_log for h in halves]), full.A_log)
    torch.testing.assert_close(torch.cat([m.vocab.lm_head for m in ranks]), tiny_model.vocab.lm_head)
    # f_a is replicated inside each rank's packed in_proj
    fa = full.cols.f_a
    for h in halves:
        torch.testing.assert_close(h.in_proj[h.cols.f_a], full.in_proj[fa])


def test_expert_padding_is_zero(tiny_ckpt):
    """tiny's 128-wide experts split over 4 ranks are 32 wide, padded to 128 like K3's 192 -> 256 at TP16."""
    moe = load_model(tiny_ckpt, tp=TP(1, 4), act_dtype=torch.float32).layers[1].ffn
    assert moe.w13_weight_packed.shape[1] == 2 * 128
    assert torch.all(moe.w13_weight_packed[:, 32:128] == 0) and torch.all(moe.w13_weight_packed[:, 160:] == 0)
    assert torch.all(moe.w2_weight_packed[:, :, 16:] == 0)


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop(EXPERT))
    with pytest.raises(CheckpointError, match=r"missing tensor language_model\.model\.layers\.1\.block_sparse_moe"
                                              r"\.experts\.3\.w2\.weight_packed"):
        load_model(ckpt)


def test_extra_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({"language_model.model.layers.0.self_attn.bogus": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor language_model\.model\.layers\.0\.self_attn\.bogus"):
        load_model(ckpt)


def test_vision_tensors_are_not_extra(ckpt, tiny_model):
    rewrite(ckpt, lambda t: t.update({"vision_tower.patch_embed.weight": torch.zeros(2)}))
    assert params_equal(load_model(ckpt, act_dtype=torch.float32), tiny_model)


def test_misshaped_tensor_names_both_shapes(ckpt):
    name = "language_model.model.layers.2.self_attn.q_proj.weight"
    rewrite(ckpt, lambda t: t.update({name: torch.zeros(64, 128, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has shape \[64, 128\], expected \[128, 128\]"):
        load_model(ckpt)


def test_wrong_dtype(ckpt):
    """Packed tensors must match exactly (float ones are converted: test_loader_friendly.py)."""
    rewrite(ckpt, lambda t: t.update({EXPERT: t[EXPERT].to(torch.int16)}))
    with pytest.raises(CheckpointError, match=r"w2\.weight_packed has dtype torch.int16, expected torch.uint8"):
        load_model(ckpt)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json: missing"):
        load_model(ckpt)


def test_config_field_errors_name_the_field(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, 9]
    raw["text_config"]["hidden_size"] = "wide"
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_model(ckpt)
    assert "config.json: hidden_size: Input should be a valid integer" in str(e.value)


def test_bad_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_model(ckpt)


def test_corrupt_weights(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        load_model(ckpt)


def test_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002.safetensors: listed in the index but missing"):
        load_model(ckpt)
