"""The trained model as a K3 checkpoint: the same Hugging Face layout and formats `k3forge ckpt make` writes
(nested `kimi_k3` config, `language_model.` names, bf16 / fp32 tensors, MXFP4 routed experts quantized by
`mxfp4.quantize`, `tokenizer.json`), plus `training.json`, the run's record."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import mxfp4
from ..checkpoint import LANGUAGE_MODEL_PREFIX, checkpoint_tensors
from ..config import KimiK3Config
from ..model import KimiK3Model
from ..tokenizer import build_tokenizer, save_tokenizer
from ..weights import Binding

RECORD_FILE = "training.json"
PACKED_SUFFIXES = (".weight_packed", ".weight_scale")


def _unbind(b: Binding, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors one TP1 binding was packed from (the inverse of `Binding.read`)."""
    rows = [p.tensor.shape[0] if p.shard_dim != 0 or p.extent is None else p.extent for p in b.parts]
    out = {}
    for part, piece in zip(b.parts, value[:sum(rows)].split(rows)):
        full = piece.new_zeros(part.tensor.shape)  # A_log: per head, zero-padded as K3 stores it
        full[tuple(slice(0, n) for n in piece.shape)] = piece
        out[part.tensor.name] = full
    return out


def dense_tensors(model: KimiK3Model) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of a TP1 model, by name (routed experts as their dense weights)."""
    if model.tp.size != 1:
        raise ValueError(f"export: a TP{model.tp.size} rank holds slices; export the TP1 model")
    out = {}
    for b in model.bindings().items:
        param = model.get_parameter(b.param).detach()
        out.update(_unbind(b, param[b.index] if b.index is not None else param))
    return out


def write(model: KimiK3Model, cfg: KimiK3Config, out: Path, record: dict) -> Path:
    """Write the model (dense experts) as a checkpoint of `cfg` (MXFP4 experts when it says so) into `out`."""
    dense = {name: t.float().cpu() for name, t in dense_tensors(model).items()}
    tensors = {}
    for name, spec in sorted(checkpoint_tensors(cfg).items()):
        if name.endswith(PACKED_SUFFIXES):
            base = name.removesuffix(".weight_packed").removesuffix(".weight_scale")
            packed, scale = mxfp4.quantize(dense[base + ".weight"])
            t = packed if name.endswith(".weight_packed") else scale
        else:
            t = dense[name].to(spec.dtype)
        tensors[LANGUAGE_MODEL_PREFIX + name] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(nested=True), indent=2))
    save_tokenizer(build_tokenizer(cfg), out)
    write_record(out, record)
    return out


def write_record(out: Path, record: dict) -> None:
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1))
