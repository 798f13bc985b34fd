"""vLLM's per-architecture config hook for the K3 architecture, as k3forge's model class needs it.

vLLM's own hook for `KimiK3ForConditionalGeneration` routes the MXFP4 experts to vLLM's `mxfp4` quantization
method (bf16 only, its own MoE kernels). k3forge's model reads MXFP4 itself (model/kimi_k3/mxfp4.py). So this
hook checks the plugin's options (options.py) where vLLM builds its config, so that a bad one fails in the
caller's process; hides the checkpoint's quantization config from vLLM's quantization machinery (keeping it, for
the model class, as `k3forge_quantization_config` on the text config); turns prefix caching off (the model keeps
a request's KDA state after its last token only, so a cached prefix could not be resumed); and makes the model
run eagerly (its steps read vLLM's metadata on the host: sequence lengths, slots, which neither torch.compile nor
a CUDA graph can capture).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .options import PluginOptions

log = init_logger(__name__)
STASH = "k3forge_quantization_config"


class K3ForgeConfigHook(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        if not model_config.enforce_eager:
            log.info("k3forge's K3 model runs eagerly (no torch.compile, no CUDA graphs): enforce_eager set")
            model_config.enforce_eager = True
        text = model_config.hf_text_config
        for cfg in (model_config.hf_config, text, model_config.model_arch_config):
            quant = getattr(cfg, "quantization_config", None)
            if quant is not None:
                if getattr(text, STASH, None) is None:
                    setattr(text, STASH, dict(quant))
                cfg.quantization_config = None

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        PluginOptions.parse(vllm_config.additional_config)  # in the front end: the error reaches the caller
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            log.info("k3forge's K3 model: prefix caching is not supported (turned off)")
            cache.enable_prefix_caching = False
