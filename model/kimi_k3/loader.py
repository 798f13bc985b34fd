"""Load a Hugging Face layout K3 checkpoint directory into a rank-local model.

Each rank reads only its slices (safetensors slices lazily). A missing, extra, mis-shaped or mis-typed
tensor is refused with a `CheckpointError` naming the tensor (and both shapes or dtypes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from .checkpoint import LANGUAGE_MODEL_PREFIX
from .config import KimiK3Config, read_json
from .model import KimiK3Model
from .parallel import TP
from .weights import CheckpointError

_ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "U8": torch.uint8,
              "I8": torch.int8, "F64": torch.float64, "I32": torch.int32, "I64": torch.int64,
              "F8_E4M3": torch.float8_e4m3fn}
# Non-text parts of the multimodal checkpoint; a text-only load skips them.
_NON_TEXT = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


class TensorSource(Protocol):
    def names(self) -> set[str]: ...
    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]: ...
    def get_slice(self, name: str): ...


class SafetensorsDir:
    """The text-model tensors of a checkpoint directory, names without the `language_model.` prefix
    (a tensor outside that namespace keeps its full name, so it is reported as unexpected)."""

    def __init__(self, path: str | Path, nested: bool):
        self.path = Path(path)
        prefix = LANGUAGE_MODEL_PREFIX if nested else ""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        self._handles = {}
        self._where: dict[str, tuple[str, str]] = {}
        for fname in files:
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: listed in the index but missing")
            try:
                handle = safe_open(str(fpath), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{fpath}: unreadable safetensors file ({e})") from None
            self._handles[fname] = handle
            for full in handle.keys():
                name = full.removeprefix(prefix)
                if not name.startswith(_NON_TEXT):
                    self._where[name] = (fname, full)

    def names(self) -> set[str]:
        return set(self._where)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        sl = self.get_slice(name)
        return tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())

    def get_slice(self, name: str):
        fname, full = self._where[name]
        return self._handles[fname].get_slice(full)


def load_weights(model: KimiK3Model, source: TensorSource, origin: str = "checkpoint") -> None:
    """Check the source against the model's bindings, then fill every parameter with this rank's slices."""
    bindings = model.bindings()
    expected = bindings.checkpoint_tensors()
    have = source.names()
    missing, extra = sorted(set(expected) - have), sorted(have - set(expected))
    problems = [f"{origin}: missing tensor {n} (expected shape {list(expected[n].shape)})" for n in missing[:10]]
    problems += [f"{origin}: unexpected tensor {n}" for n in extra[:10]]
    hidden = len(missing) + len(extra) - len(problems)
    for name, spec in sorted(expected.items()):
        if name not in have:
            continue
        shape, dtype = source.shape_dtype(name)
        if tuple(shape) != spec.shape:
            problems.append(f"{origin}: tensor {name} has shape {list(shape)}, expected {list(spec.shape)}")
        elif dtype != spec.dtype:
            problems.append(f"{origin}: tensor {name} has dtype {dtype}, expected {spec.dtype}")
    if problems:
        raise CheckpointError("\n".join(problems + ([f"... and {hidden} more"] if hidden else [])))

    for b in bindings.items:
        param = model.get_parameter(b.param)
        target = param[b.index] if b.index is not None else param
        target.copy_(b.read(source.get_slice, model.tp))


def load_config(path: str | Path) -> tuple[KimiK3Config, bool]:
    """(config, nested) of a checkpoint directory; nested means a `kimi_k3` config with `text_config`."""
    if not Path(path).is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    cfg_path = Path(path) / "config.json"
    raw = read_json(cfg_path)
    return KimiK3Config.from_hf_dict(raw, source=str(cfg_path)), isinstance(raw, dict) and "text_config" in raw


def load_model(path: str | Path, tp: TP = TP(), act_dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu") -> KimiK3Model:
    """Build this rank's model and load its slices from a checkpoint directory."""
    cfg, nested = load_config(path)
    with torch.device(device):
        model = KimiK3Model(cfg, tp, act_dtype)
    load_weights(model, SafetensorsDir(path, nested), origin=str(path))
    return model.eval()
