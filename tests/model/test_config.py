"""The K3 config: presets, Hugging Face parsing, validation errors, rank-local shapes."""

import json

import pytest

from model.kimi_k3.cli import describe
from model.kimi_k3.config import ConfigError, KimiK3Config, preset


def test_k3_preset_is_the_published_config():
    cfg = preset("k3")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token) == (93, 7168, 896, 16)
    assert cfg.mla_layer_ids == list(range(3, 92, 4)) + [92] and len(cfg.mla_layer_ids) == 24
    assert cfg.num_attn_res_blocks == 8 and cfg.mla_cache_dim == 576 and cfg.experts_quantized


def test_tiny_preset_exercises_every_part():
    cfg = preset("tiny")
    assert cfg.num_attn_res_blocks >= 2 and len(cfg.mla_layer_ids) >= 2
    assert cfg.num_hidden_layers - len(cfg.mla_layer_ids) >= 3
    assert cfg.first_k_dense_replace == 1 and cfg.num_shared_experts > 0 and cfg.experts_quantized


def test_nested_and_flat_configs_parse_alike():
    cfg = preset("tiny")
    assert (KimiK3Config.from_hf_dict(cfg.to_hf_dict(nested=True))
            == KimiK3Config.from_hf_dict(cfg.to_hf_dict(nested=False)))


def test_unknown_fields_are_kept_but_bad_values_are_named():
    raw = preset("tiny").to_hf_dict(nested=False) | {"some_future_field": 1}
    assert KimiK3Config.from_hf_dict(raw)
    raw["num_experts_per_token"] = 99
    with pytest.raises(ConfigError, match="config.json: num_experts_per_token: larger than num_experts"):
        KimiK3Config.from_hf_dict(raw)


def test_layer_lists_must_cover_every_layer():
    raw = preset("tiny").to_hf_dict(nested=False)
    raw["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="linear_attn_config: layers .* are neither MLA nor KDA"):
        KimiK3Config.from_hf_dict(raw)


@pytest.mark.parametrize("tp,field", [(5, "linear_attn_config.num_heads"), (64, "linear_attn_config.num_heads")])
def test_tp_must_divide_heads(tp, field):
    with pytest.raises(ConfigError, match=f"{field}: 96 is not divisible by TP size {tp}"):
        preset("k3").check_tp(tp)


def test_from_file_errors_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": {"hidden_size": 8}}))
    with pytest.raises(ConfigError, match=f"{path}: vocab_size: Field required"):
        KimiK3Config.from_file(path)


@pytest.mark.parametrize("tp,in_proj,w13,w2", [(8, 6288, [896, 768, 1792], [896, 3584, 192]),
                                               (16, 3216, [896, 512, 1792], [896, 3584, 128])])
def test_k3_rank_local_shapes(tp, in_proj, w13, w2):
    """SPEC.md §9: packed in_proj padded to 16, experts split on the intermediate dim, TP16 padded to 256."""
    w = describe(preset("k3"), tp)["weights"]
    heads = 96 // tp
    assert w["layers.0.self_attn.in_proj"]["shape"] == [in_proj, 7168]
    assert w["layers.0.self_attn.conv_weight"]["shape"] == [3 * heads * 128, 1, 4]
    assert w["layers.0.self_attn.A_log"]["shape"] == [heads]
    assert w["layers.3.self_attn.q_b_proj"]["shape"] == [heads * 192, 1536]
    assert w["layers.3.self_attn.kv_b_proj"]["shape"] == [heads * 256, 512]
    assert w["layers.3.self_attn.fused_qkv_a"]["shape"] == [2112, 7168]
    assert w["layers.1.ffn.w13_weight_packed"]["shape"] == w13
    assert w["layers.1.ffn.w2_weight_packed"]["shape"] == w2
    assert w["layers.1.ffn.gate"]["shape"] == [896, 7168]  # router replicated
    assert w["vocab.lm_head"]["shape"] == [163840 // tp, 7168]
