"""Random, well-scaled K3 checkpoints in the Hugging Face layout (safetensors, `config.json`, `tokenizer.json`).

Tensors are drawn per name from a seed, so any tensor (or a rank's slice of it) can be produced alone and
in any order: `RandomSource` serves the loader directly (e.g. real `k3` layer shapes on a GPU, where no
file of them could be written), and `write_checkpoint` saves the same tensors to disk.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import mxfp4
from .config import KimiK3Config
from .model import KimiK3Model
from .parallel import TP
from .tokenizer import build_tokenizer, save_tokenizer
from .weights import CkptTensor

LANGUAGE_MODEL_PREFIX = "language_model."
MAX_SHARD_BYTES = 2 << 30


def checkpoint_tensors(cfg: KimiK3Config) -> dict[str, CkptTensor]:
    """Every text-model tensor of a checkpoint for this config (names without the language_model prefix)."""
    with torch.device("meta"):
        model = KimiK3Model(cfg, TP(), torch.bfloat16)
    return model.bindings().checkpoint_tensors()


class RandomSource:
    """Deterministic random tensors by name; quacks like a safetensors file for the loader."""

    def __init__(self, tensors: dict[str, CkptTensor], seed: int, device: torch.device | str = "cpu"):
        self.tensors, self.seed, self.device = tensors, seed, torch.device(device)

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self.tensors[name]
        return t.shape, t.dtype

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get(name)  # a full tensor supports the same indexing as a safetensors slice

    def stored_name(self, name: str) -> str:
        return name

    def get(self, name: str) -> torch.Tensor:
        spec = self.tensors[name]
        base = name.removesuffix(".weight_scale").removesuffix(".weight_packed")
        gen = torch.Generator(self.device).manual_seed((self.seed * 1_000_003 + zlib.crc32(base.encode())) % 2**63)
        if spec.init == "mxfp4":
            packed = self.tensors[base + ".weight_packed"]
            n, k = packed.shape[0], packed.shape[1] * 2
            dense = torch.randn(n, k, generator=gen, device=self.device) / math.sqrt(k)
            pair = mxfp4.quantize(dense)
            return pair[0] if name.endswith("packed") else pair[1]
        return _draw(spec, gen, self.device).to(spec.dtype)


def _draw(spec: CkptTensor, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Scales chosen so activations stay O(1) through the network and every branch matters."""
    shape = spec.shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    fan_in = shape[-1]
    kind, _, arg = spec.init.partition(":")
    match kind:
        case "linear" | "router":
            return normal(1 / math.sqrt(fan_in))
        case "ones":
            return 1 + normal(0.05)
        case "res_proj":  # AttnRes scores of O(1), so the softmax mixes rather than averages
            return normal(1 / math.sqrt(fan_in))
        case "lm_head":  # logits of std ~2: peaked enough that greedy decoding rarely meets a near-tie
            return normal(2 / math.sqrt(fan_in))
        case "embed":
            return normal(1.0)
        case "conv":
            return normal(0.5)
        case "small":
            return normal(0.1)
        case "dt_bias":
            return normal(1.0)
        case "a_log":  # per-head log decay rates; entries past the head count (arg) stay zero, as K3 pads them
            rates = torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen))
            rates[int(arg):] = 0
            return rates
    raise ValueError(f"{spec.name}: unknown init {spec.init!r}")


def write_checkpoint(cfg: KimiK3Config, out: str | Path, seed: int = 0, nested: bool = True) -> Path:
    """Write config.json, tokenizer.json and safetensors shards (with an index when there is more than one)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(cfg)
    source = RandomSource(tensors, seed)
    prefix = LANGUAGE_MODEL_PREFIX if nested else ""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = source.get(name)
        if size and size + t.numel() * t.element_size() > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][prefix + name] = t.contiguous()
        size += t.numel() * t.element_size()
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(nested=nested), indent=2))
    save_tokenizer(build_tokenizer(cfg), out)
    return out
