"""k3forge's Kimi K3 as a vLLM model class (registered for `KimiK3ForConditionalGeneration` by `register()`).

vLLM schedules, batches, allocates and frees the caches, samples (greedy, seeded temperature, top-p) and
constrains output (its structured-output backends); k3forge's model computes each step: its layers and weights,
its AttnRes residual stream, its MoE (SiTU experts, MXFP4 or dense) and its dispatcher, which runs every
decode op through the implementation `additional_config["decode_backend"]` selects:
- `auto` (the default): each op's standard implementation (on CUDA the library kernels a serving engine runs,
  e.g. FLA's KDA; on CPU the reference);
- `latency_specialized`: the contracted kernels (contracts/) inside their envelopes, the standard elsewhere.
KDA and MLA run on vLLM's caches through the layers in `layers.py`.

Text only: the vision tower's tensors in a checkpoint are skipped. No pipeline parallelism, no speculative
decoding and no prefix caching yet (a request's KDA state is kept for its last token only).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.model_executor.models.interfaces import IsHybrid

from . import k3
from .hooks import STASH
from .layers import KDAStateLayer, MLACacheLayer, kda_state_dtypes, kda_state_shapes, step_metadata
from .options import PluginOptions


def k3_config(vllm_config: VllmConfig) -> "k3.KimiK3Config":
    """k3forge's config of the checkpoint, from vLLM's text config with the quantization config the plugin's
    config hook kept aside (hooks.py)."""
    text = vllm_config.model_config.hf_text_config
    raw = text.to_dict()
    raw["quantization_config"] = getattr(text, STASH, None)
    return k3.KimiK3Config.from_hf_dict(raw, source=f"{vllm_config.model_config.model} (text_config)")


def vllm_tp() -> "k3.TP":
    """k3forge's TP context on vLLM's tensor-parallel group."""
    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return k3.TP()
    from vllm.distributed import get_tp_group

    return k3.TP(rank=get_tensor_model_parallel_rank(), size=size, group=get_tp_group().device_group)


class _VLLMCaches:
    """k3forge's model asks its cache for room and advances it; under vLLM the scheduler owns both."""

    def check_room(self, slot: int, new_tokens: int) -> None:
        pass

    def advance(self, batch) -> None:
        pass



class K3ForgeForCausalLM(nn.Module, IsHybrid):
    """k3forge's K3 text model on vLLM's scheduler, caches and sampler."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return kda_state_shapes(k3_config(vllm_config), vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return kda_state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.options = PluginOptions.parse(vllm_config.additional_config)  # first: a bad option stops start-up
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError("k3forge's vLLM plugin: pipeline parallelism is not supported")
        cfg = k3_config(vllm_config)
        self.cfg = cfg
        self.model = k3.KimiK3Model(cfg, vllm_tp(), vllm_config.model_config.dtype)
        base = f"{prefix}." if prefix else ""
        self.layer_names: list[str] = []
        for layer in self.model.layers:
            wrap = MLACacheLayer if cfg.is_mla_layer(layer.layer) else KDAStateLayer
            name = f"{base}model.layers.{layer.layer}.self_attn"
            layer.self_attn = wrap(layer.self_attn, cfg, vllm_config, name)
            self.layer_names.append(name)
        self.model.ops = k3.Dispatcher.for_model(self.model, self.options.decode_backend,
                                                 self.options.contracts_dir or k3.CONTRACTS_DIR)

    @property
    def dispatcher(self) -> "k3.Dispatcher":
        return self.model.ops

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.vocab.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None:
            raise NotImplementedError("k3forge's vLLM plugin takes token ids, not input embeddings")

        num_tokens = input_ids.shape[0]
        out = torch.zeros(num_tokens, self.cfg.hidden_size, dtype=self.model.act_dtype, device=input_ids.device)
        meta = step_metadata(self.layer_names[0])
        if meta is None or meta.num_reqs == 0:  # vLLM's dummy and profiling runs
            return out
        batch = k3.StepBatch(slots=tuple(range(meta.num_reqs)), query_lens=tuple(meta.query_lens),
                             context_lens=tuple(meta.context_lens))
        t = meta.num_actual_tokens
        out[:t] = self.model(input_ids[:t], batch, _VLLMCaches())
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] (the final norm and the lm_head; vocab-parallel ranks gathered)."""
        return self.model.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every text tensor of the checkpoint through k3forge's bindings (each rank reads its slices); a
        missing, unexpected, mis-shaped or mis-typed tensor fails naming it."""
        source = _TensorDict(weights)
        k3.load_weights(self.model, source, origin="checkpoint (through vLLM)")
        return {name for name, _ in self.named_parameters()}


class _TensorDict:
    """vLLM's weight stream as k3forge's TensorSource: names without `language_model.`, vision tensors dropped."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]):
        self._tensors: dict[str, torch.Tensor] = {}
        self._stored: dict[str, str] = {}
        self._prefix = ""
        for stored, tensor in weights:
            name = stored.removeprefix(k3.LANGUAGE_MODEL_PREFIX)
            if name != stored:
                self._prefix = k3.LANGUAGE_MODEL_PREFIX
            if not name.startswith(k3.NON_TEXT_PREFIXES):
                self._tensors[name] = tensor
                self._stored[name] = stored

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self._tensors[name]
        return tuple(t.shape), t.dtype

    def get_slice(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def stored_name(self, name: str) -> str:
        """The checkpoint's name of a tensor (of a missing one: the name it would have)."""
        return self._stored.get(name, self._prefix + name)


def dispatch_report(model: K3ForgeForCausalLM) -> dict:
    """The dispatcher's per-op counts (specialized, standard, fallback reasons) in a worker: `LLM.apply_model(
    dispatch_report)` returns one per worker."""
    return model.dispatcher.report()
