"""Everything the vLLM plugin takes from k3forge's model, imported in this one place.

The model's modules are being restructured; when a path moves, this file is the only one of the plugin to edit.
The plugin uses: the config and its checkpoint reader, the model (layers, weights, bindings, logits), the
dispatcher and its backends, the step description, the weight loader, and the ops and helpers its vLLM layers
call on vLLM's caches (KDA prefill, the MLA cache's page addressing; the rest goes through the dispatcher's ops).
"""

from __future__ import annotations

from model.kimi_k3.batch import StepBatch, StepKind
from model.kimi_k3.checkpoint import LANGUAGE_MODEL_PREFIX
from model.kimi_k3.config import ConfigError, KimiK3Config
from model.kimi_k3.dispatch import DECODE_BACKENDS, Dispatcher
from model.kimi_k3.kda import KimiDeltaAttention
from model.kimi_k3.loader import _NON_TEXT, load_weights
from model.kimi_k3.mla import LORA_NORM_EPS, KimiMLA
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.ops.kda import kda_prefill
from model.kimi_k3.ops.mla_decode import paged_rows
from model.kimi_k3.ops.mla_decode_fp8 import dequantize_kv, quantize_kv
from model.kimi_k3.ops.registry import CONTRACTS_DIR
from model.kimi_k3.parallel import TP
from model.kimi_k3.weights import CheckpointError

__all__ = [
    "CONTRACTS_DIR", "DECODE_BACKENDS", "LANGUAGE_MODEL_PREFIX", "LORA_NORM_EPS", "NON_TEXT_PREFIXES",
    "CheckpointError", "ConfigError", "Dispatcher", "KimiDeltaAttention", "KimiK3Config", "KimiK3Model", "KimiMLA",
    "StepBatch", "StepKind", "TP", "dequantize_kv", "kda_prefill", "load_weights", "paged_rows", "quantize_kv",
]

NON_TEXT_PREFIXES = _NON_TEXT  # vision tower and projector tensors of the multimodal checkpoint
