"""The mini-K3 config and the training recipe.

The mini model keeps every structural feature of K3 (SPEC.md §1) in K3's proportions at toy width: 8 layers,
MLA every fourth layer and the last (3 and 7; K3: every fourth and the last of 93), KDA elsewhere, dense layer 0,
Block AttnRes over 3 blocks, latent MoE with sigmoid router and correction bias, SiTU, 2 shared experts,
MXFP4 routed experts. Its KDA layers are K3's head shape (head dim 128, gate rank 128, conv width 4) with 6 heads,
the smallest local head count the fused KDA decode kernel's contract covers (K3 at TP16), so the H200 runs the
contracted kernel on it; the width 128 is one the attn_res contract covers on CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import KimiK3Config, preset
from .data import data_version


def mini_config() -> KimiK3Config:
    """The trained model's config (MXFP4 experts: the checkpoint's; training runs them dense)."""
    tiny = preset("tiny")
    body = tiny.model_dump()
    body.update(hidden_size=128, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
                num_experts_per_token=4, routed_expert_hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                linear_attn_config={**tiny.linear_attn_config.model_dump(), "num_heads": 6, "head_dim": 128})
    return KimiK3Config.model_validate(body)


def dense_experts(cfg: KimiK3Config) -> KimiK3Config:
    """The same config with bf16 routed experts: what training updates before they are quantized."""
    return cfg.model_copy(update={"quantization_config": None})


@dataclass(frozen=True)
class Recipe:
    """Everything a training run depends on besides the seed and the step count (recorded with the checkpoint)."""

    tokens_per_step: int = 32768  # rows x length; a step's length is drawn from `lengths`
    lengths: tuple[int, ...] = (256, 512, 1024)
    recall_fraction: float = 0.5  # rows of one long recall sample; the others pack the short tasks
    # data version 2 (data.py): rows of one recency or one windowed-count sample each, taken from the packed rows'
    # share (0 and 0: version 1's rows exactly); by default version 1's tasks keep 65 % of a step
    recency_fraction: float = 0.15
    window_fraction: float = 0.2
    # a curriculum: the first `window_steps` steps are windowed-count rows only (the mix after), so the model
    # learns the count, the one task whose answers move with the decay's exact value, before the others crowd it
    window_steps: int = 0
    lr: float = 2e-3
    min_lr_fraction: float = 0.1  # cosine decay to this fraction of lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    bias_rate: float = 1e-3  # aux-loss-free balancing: e_score_correction_bias moves this much per step
    kda_chunk: int = 32  # the chunked KDA form's chunk (ops/kda.py): its [C, C, K] decays cost C x K per token

    @property
    def data_version(self) -> int:
        """The data version this mix draws from (1 while no version 2 task is on, the curriculum's included)."""
        curriculum = 1.0 if self.window_steps else 0.0  # its steps are windowed-count rows only
        return data_version(self.recency_fraction, max(self.window_fraction, curriculum))

    def mix(self, step: int) -> tuple[float, dict[str, float]]:
        """Tasks.batch's recall fraction and keyword fractions at a step (the curriculum's, then the recipe's)."""
        if step < self.window_steps:
            return 0.0, {"recency_fraction": 0.0, "window_fraction": 1.0}
        return self.recall_fraction, {"recency_fraction": self.recency_fraction,
                                      "window_fraction": self.window_fraction}

    def as_dict(self) -> dict:
        return asdict(self)
