"""k3forge inside vLLM: a general plugin (entry point `k3forge` in the group `vllm.general_plugins`).

vLLM calls `register()` in every one of its processes (the front end, the engine core, each worker), possibly
more than once; it registers k3forge's K3 model class for the K3 checkpoint architecture. Why a model class and
not replacement ops inside vLLM's own K3: see README.md of this package.

Only this file is imported when vLLM discovers the plugin; vLLM imports the model class (`model.py`) lazily, by
name, in the process that builds the model.
"""

from __future__ import annotations

import logging

# The vLLM release this plugin is written against: its module paths (layers, attention backends, KV cache specs)
# move between releases. The Makefile's vLLM environment installs exactly this version.
VLLM_VERSION = "0.32.0"
# K3 checkpoints (`k3forge ckpt make`, Moonshot's release) name this architecture in config.json.
ARCHITECTURES = ("KimiK3ForConditionalGeneration",)
MODEL_CLASS = "model.kimi_k3.vllm.model:K3ForgeForCausalLM"

log = logging.getLogger(__name__)


def register() -> None:
    """Register k3forge's K3 model class with vLLM's model registry, and its config hook. Re-entrant: a second
    call registers the same import string and hook again, which changes nothing."""
    import vllm
    from vllm import ModelRegistry  # imported here: importing this package must not need vLLM
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .hooks import K3ForgeConfigHook

    if vllm.__version__.split("+")[0] != VLLM_VERSION:
        log.warning("k3forge's vLLM plugin is written for vLLM %s; this is %s (its module paths may differ)",
                    VLLM_VERSION, vllm.__version__)
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL_CLASS)
        MODELS_CONFIG_MAP[arch] = K3ForgeConfigHook  # replaces vLLM's hook for its own K3 class (hooks.py)
