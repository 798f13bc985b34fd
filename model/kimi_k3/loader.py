"""Load a Hugging Face layout K3 checkpoint directory into a rank-local model.

Each rank reads only its slices (safetensors slices lazily). What the loader accepts besides an exact match:
- a float tensor stored in another plain float dtype than the model declares (an fp32 norm weight declared
  bf16, a bf16 `dt_bias` declared fp32) is converted once, to the parameter's dtype, with one log line per
  (declared, stored) dtype pair; integer and packed tensors (MXFP4 uint8) must match exactly;
- `A_log` per head ([H]) or zero-padded (K3 stores [128]); padding that is not zero is refused.
Anything else missing, extra, mis-shaped or mis-typed is refused with a `CheckpointError` naming the tensor as
the checkpoint's files name it (`language_model.` prefix included), with both shapes or dtypes.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from .checkpoint import LANGUAGE_MODEL_PREFIX
from .config import KimiK3Config, read_json
from .model import KimiK3Model
from .parallel import TP
from .weights import CheckpointError, Part

log = logging.getLogger(__name__)

_ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "U8": torch.uint8,
              "I8": torch.int8, "I16": torch.int16, "F64": torch.float64, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# Float dtypes that hold plain values (no scale): a tensor stored in one where the model declares another is
# converted on load. Integer and packed tensors (MXFP4 uint8 bytes and E8M0 scales) and float8 (which needs its
# scales) must be stored exactly as declared.
CASTABLE_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

# Non-text parts of the multimodal checkpoint; a text-only load skips them.
_NON_TEXT = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


class TensorSource(Protocol):
    def names(self) -> set[str]: ...
    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype]: ...
    def get_slice(self, name: str): ...
    def stored_name(self, name: str) -> str: ...  # how the source's files name (or would name) the tensor


class SafetensorsDir:
    """The text-model tensors of a checkpoint directory, names without the `language_model.` prefix
    (a tensor outside that namespace keeps its full name, so it is reported as unexpected)."""

    def __init__(self, path: str | Path, nested: bool):
        self.path = Path(path)
        self.prefix = prefix = LANGUAGE_MODEL_PREFIX if nested else ""
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

    def stored_name(self, name: str) -> str:
        """The name in the file (a missing tensor: the name the file would give it)."""
        return self._where[name][1] if name in self._where else self.prefix + name


def castable(stored: torch.dtype, declared: torch.dtype) -> bool:
    """Whether a tensor stored as `stored` may be loaded where the model declares `declared`."""
    return stored == declared or (stored in CASTABLE_FLOATS and declared in CASTABLE_FLOATS)


def accepts(part: Part, shape: tuple[int, ...]) -> bool:
    """Whether a stored tensor of this shape can fill the part: the declared shape or, for a padded part
    (`extent` set), any length from `extent` up along its shard dim: the real entries alone (A_log per head,
    [H]) or padded (K3 stores [128]; the padding must be zero, `nonzero_padding`)."""
    shape, declared, d = tuple(shape), part.tensor.shape, part.shard_dim
    if shape == declared:
        return True
    if part.extent is None or d is None or len(shape) != len(declared):
        return False
    return shape[d] >= part.extent and shape[:d] + shape[d + 1:] == declared[:d] + declared[d + 1:]


def nonzero_padding(part: Part, get_slice, shape: tuple[int, ...]) -> int:
    """How many stored entries past the part's `extent` along its shard dim are not zero (0 when none are stored)."""
    d = part.shard_dim
    if part.extent is None or d is None or shape[d] <= part.extent:
        return 0
    index = [slice(None)] * len(shape)
    index[d] = slice(part.extent, None)
    return int((get_slice(part.tensor.name)[tuple(index)] != 0).sum())


def load_weights(model: KimiK3Model, source: TensorSource, origin: str = "checkpoint") -> None:
    """Check the source against the model's bindings, then fill every parameter with this rank's slices."""
    bindings = model.bindings()
    parts = {p.tensor.name: p for b in bindings.items for p in b.parts}  # a checkpoint tensor feeds one part
    have = source.names()
    named = source.stored_name
    missing, extra = sorted(set(parts) - have), sorted(have - set(parts))
    problems = [f"{origin}: missing tensor {named(n)} (expected shape {list(parts[n].tensor.shape)})"
                for n in missing[:10]]
    problems += [f"{origin}: unexpected tensor {named(n)}" for n in extra[:10]]
    hidden = len(missing) + len(extra) - len(problems)
    casts: dict[tuple[torch.dtype, torch.dtype], list[str]] = defaultdict(list)
    for name, part in sorted(parts.items()):
        if name not in have:
            continue
        spec = part.tensor
        shape, dtype = source.shape_dtype(name)
        if not accepts(part, shape):
            expected = list(spec.shape)
            if part.extent is not None:  # e.g. A_log: [128] (zero-padded) or [96] (per head)
                real = [part.extent if d == part.shard_dim else n for d, n in enumerate(spec.shape)]
                expected = f"{expected} (zero-padded) or {real}"
            problems.append(f"{origin}: tensor {named(name)} has shape {list(shape)}, expected {expected}")
        elif not castable(dtype, spec.dtype):
            problems.append(f"{origin}: tensor {named(name)} has dtype {dtype}, expected {spec.dtype} "
                            "(only fp16, bf16, fp32 and fp64 convert into each other on load)")
        elif nonzero := nonzero_padding(part, source.get_slice, tuple(shape)):
            problems.append(f"{origin}: tensor {named(name)} has {nonzero} nonzero entries past its {part.extent} "
                            f"real ones along dim {part.shard_dim}: its padding must be zero")
        elif dtype != spec.dtype:
            casts[spec.dtype, dtype].append(name)
    if problems:
        raise CheckpointError("\n".join(problems + ([f"... and {hidden} more"] if hidden else [])))
    for (declared, stored), names in sorted(casts.items(), key=str):
        log.info("%s: %d tensor(s) stored as %s where the model declares %s, converted on load (%s%s)", origin,
                 len(names), stored, declared, named(names[0]), ", ..." if len(names) > 1 else "")

    for b in bindings.items:
        param = model.get_parameter(b.param)
        target = param[b.index] if b.index is not None else param
        target.copy_(b.read(source.get_slice, model.tp))  # copy_ converts a float part to the parameter's dtype


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
