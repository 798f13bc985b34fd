"""Kimi K3 text config: the Hugging Face `config.json` fields, validation, presets and TP-local sizes.

The field names are the checkpoint's own (`text_config` of a `kimi_k3` config, `model_type` `kimi_linear`).
Validation errors name the field, so a malformed `config.json` is reported as `config.json: field: problem`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels.validation import validate

# MXFP4 packs one E8M0 scale per 32 inputs.
MXFP4_GROUP = 32
# Rank-local routed-expert intermediate sizes are zero-padded to this multiple (TP16: 192 -> 256).
EXPERT_SHARD_ALIGN = 128


class ConfigError(ValueError):
    """A config that cannot describe a runnable model; the message names the source and field."""


def read_json(path: Path) -> Any:
    """A config file's JSON, or a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None


class LinearAttnConfig(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    full_attn_layers: list[int] = Field(description="1-indexed MLA layers")
    kda_layers: list[int] = Field(description="1-indexed KDA layers")
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    short_conv_kernel_size: int = Field(gt=0)
    gate_lower_bound: float = Field(lt=0)
    use_full_rank_gate: bool = True


class KimiK3Config(BaseModel):
    """The text model config. Unknown Hugging Face fields are kept (extra="allow") but unused."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model_type: Literal["kimi_linear"] = "kimi_linear"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    q_lora_rank: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    rms_norm_eps: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    hidden_act: Literal["situ"] = "situ"
    activation_situ_beta: float = Field(gt=0)
    activation_situ_linear_beta: float = Field(gt=0)
    first_k_dense_replace: int = Field(ge=0)
    moe_layer_freq: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_token: int = Field(gt=0)
    num_shared_experts: int = Field(ge=0)
    routed_expert_hidden_size: int = Field(gt=0)
    latent_moe_use_norm: bool = True
    moe_router_activation_func: Literal["sigmoid"] = "sigmoid"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    attn_res_block_size: int = Field(gt=0)
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    bos_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int = 0
    linear_attn_config: LinearAttnConfig
    quantization_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> "KimiK3Config":
        n = self.num_hidden_layers
        lac = self.linear_attn_config
        for field, layers in (("full_attn_layers", lac.full_attn_layers), ("kda_layers", lac.kda_layers)):
            bad = [i for i in layers if not 1 <= i <= n]
            if bad:
                raise ValueError(f"linear_attn_config.{field}: {bad} outside 1..{n} (1-indexed)")
        mla, kda = set(lac.full_attn_layers), set(lac.kda_layers)
        if mla & kda:
            raise ValueError(f"linear_attn_config: layers {sorted(mla & kda)} are both MLA and KDA")
        if mla | kda != set(range(1, n + 1)):
            missing = sorted(set(range(1, n + 1)) - (mla | kda))
            raise ValueError(f"linear_attn_config: layers {missing} are neither MLA nor KDA")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError("num_expert_group/topk_group: only 1 group is supported (group limiting is a no-op in K3)")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError("num_experts_per_token: larger than num_experts")
        if self.first_k_dense_replace > n:
            raise ValueError("first_k_dense_replace: larger than num_hidden_layers")
        if self.moe_layer_freq != 1:
            raise ValueError("moe_layer_freq: only 1 is supported (every layer after the dense ones is MoE)")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope: K3's MLA is NoPE; rotary MLA is not supported by the target model")
        if self.quantization_config is not None:
            self._check_quantization()
        return self

    def _check_quantization(self) -> None:
        q = self.quantization_config or {}
        if q.get("quant_method") != "compressed-tensors":
            raise ValueError(f"quantization_config.quant_method: {q.get('quant_method')!r}, "
                             "expected 'compressed-tensors'")
        if q.get("format") != "mxfp4-pack-quantized":
            raise ValueError(f"quantization_config.format: {q.get('format')!r}, expected 'mxfp4-pack-quantized'")
        for name, group in (q.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != MXFP4_GROUP:
                raise ValueError(
                    f"quantization_config.config_groups.{name}.weights: expected 4-bit float, group_size {MXFP4_GROUP}"
                )

    # ---- derived facts -------------------------------------------------------------------------

    @property
    def experts_quantized(self) -> bool:
        """Routed experts are MXFP4 exactly when the checkpoint carries a quantization config."""
        return self.quantization_config is not None

    @property
    def mla_layer_ids(self) -> list[int]:
        """0-indexed MLA layers (the config lists them 1-indexed)."""
        return sorted(i - 1 for i in self.linear_attn_config.full_attn_layers)

    def is_mla_layer(self, layer: int) -> bool:
        return (layer + 1) in self.linear_attn_config.full_attn_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def kda_heads(self) -> int:
        return self.linear_attn_config.num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """One latent-cache entry: normalized c_kv followed by k_pe (576 in K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    # ---- tensor parallelism --------------------------------------------------------------------

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError naming the field that TP size `tp` cannot divide."""
        if tp < 1:
            raise ConfigError(f"tp: {tp} must be >= 1")
        divisible = {
            "linear_attn_config.num_heads": self.kda_heads,
            "num_attention_heads": self.num_attention_heads,
            "vocab_size": self.vocab_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts * moe_intermediate_size": self.shared_intermediate_size,
        }
        for field, size in divisible.items():
            if size % tp:
                raise ConfigError(f"{field}: {size} is not divisible by TP size {tp}")
        if self.experts_quantized and (self.moe_intermediate_size // tp) % MXFP4_GROUP:
            raise ConfigError(
                f"moe_intermediate_size: {self.moe_intermediate_size}/{tp} is not a multiple of the "
                f"MXFP4 group ({MXFP4_GROUP}), so the w2 scales cannot be split across ranks"
            )

    def expert_intermediate_local(self, tp: int) -> int:
        """Rank-local routed-expert intermediate size, zero-padded to EXPERT_SHARD_ALIGN where it falls short."""
        local = self.moe_intermediate_size // tp
        if local % EXPERT_SHARD_ALIGN == 0 or self.moe_intermediate_size % EXPERT_SHARD_ALIGN:
            return local  # already aligned, or a small config that was never aligned
        return -(-local // EXPERT_SHARD_ALIGN) * EXPERT_SHARD_ALIGN

    # ---- (de)serialization ---------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "KimiK3Config":
        """Read a K3 (`text_config` nested) or flat `kimi_linear` config dict."""
        nested = isinstance(raw, dict) and "text_config" in raw
        return validate(cls, raw["text_config"] if nested else raw, source, ConfigError,
                        where="text_config" if nested else "<root>")

    @classmethod
    def from_file(cls, path: str | Path) -> "KimiK3Config":
        """A config.json, or the config.json of a checkpoint directory."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_dict(read_json(path), source=str(path))

    def to_hf_dict(self, nested: bool = True) -> dict[str, Any]:
        """The `config.json` body; nested as a `kimi_k3` multimodal config with a null vision config."""
        text = self.model_dump(mode="json", exclude_none=True)
        if not nested:
            return text
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "text_config": text,
            "vision_config": None,
        }


def _mxfp4_quantization_config() -> dict[str, Any]:
    """compressed-tensors MXFP4 config: only the routed experts are quantized (SPEC.md §1)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": MXFP4_GROUP,
                    "scale_dtype": "uint8",
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "lm_head",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
    }


def _layer_split(n: int, mla_every: int) -> tuple[list[int], list[int]]:
    """1-indexed MLA layers every `mla_every` layers plus the last; all others KDA (K3's pattern)."""
    mla = sorted(set(range(mla_every, n + 1, mla_every)) | {n})
    return mla, [i for i in range(1, n + 1) if i not in mla]


def _k3() -> KimiK3Config:
    mla, kda = _layer_split(93, 4)
    return KimiK3Config(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=33792,
        moe_intermediate_size=3072,
        num_hidden_layers=93,
        num_attention_heads=96,
        num_key_value_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        routed_expert_hidden_size=3584,
        attn_res_block_size=12,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        linear_attn_config=LinearAttnConfig(
            full_attn_layers=mla,
            kda_layers=kda,
            num_heads=96,
            head_dim=128,
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
        ),
        quantization_config=_mxfp4_quantization_config(),
    )


def _tiny() -> KimiK3Config:
    """CPU-test preset: a few MB, yet 3 AttnRes blocks, 2 MLA + 6 KDA layers, dense layer 0, MXFP4 experts."""
    mla, kda = _layer_split(8, 4)
    return KimiK3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=65536,
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=2,
        routed_expert_hidden_size=64,
        attn_res_block_size=3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        linear_attn_config=LinearAttnConfig(
            full_attn_layers=mla,
            kda_layers=kda,
            num_heads=4,
            head_dim=32,
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
        ),
        quantization_config=_mxfp4_quantization_config(),
    )


PRESETS = {"k3": _k3, "tiny": _tiny}


def preset(name: str) -> KimiK3Config:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]()
