"""Tensors inside op arguments: tuples, lists, dicts and dataclasses (KDAWeights) of tensors and scalars; and the
digest that says two tensors are bitwise identical. Shared by the gate and by the production replay
(model/kimi_k3/replay.py), which must name and digest a call's tensors exactly as the gate does."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Iterator

import torch


def leaves(obj: Any, name: str) -> Iterator[tuple[str, Any]]:
    """(path, tensor-like) for every tensor-like leaf, paths like `w.conv_weight` or `out[1]`.

    A leaf is anything that is a torch.Tensor instance, subclasses included: callers decide what to accept.
    """
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from leaves(item, f"{name}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from leaves(item, f"{name}[{key!r}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), f"{name}.{f.name}")


def state_leaves(args: tuple, state: tuple[int, ...], names: list[str]) -> Iterator[tuple[str, Any]]:
    """(path, tensor) of a call's state arguments (positions `state`), each under its parameter's name: how the
    gate's worker, its checks and the production replay all name the state a call updates."""
    for i in state:
        yield from leaves(args[i], names[i])


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same structure with every tensor replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        return {key: map_tensors(item, fn) for key, item in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def clone(obj: Any, device: str | torch.device | None = None) -> Any:
    """A deep copy of every tensor (on `device` if given); other values shared."""
    return map_tensors(obj, lambda t: t.detach().to(device or t.device, copy=True))


def copy_into(dst: Any, src: Any) -> None:
    """Write src's tensors into dst's tensors of the same structure, in place (persistent buffers)."""
    for (_, d), (_, s) in zip(leaves(dst, ""), leaves(src, ""), strict=True):
        d.copy_(s)


def same_layout(a: Any, b: Any) -> bool:
    """Whether a and b have one structure, equal non-tensor values, and tensors of equal shapes, strides, dtypes
    and devices: then copy_into(a, b) makes a stand for b in a call, so a's buffers can serve b's."""
    def layout(t: torch.Tensor) -> tuple:
        return ("tensor", tuple(t.shape), t.stride(), t.dtype, t.device)
    return map_tensors(a, layout) == map_tensors(b, layout)


def digest(t: torch.Tensor) -> str:
    """dtype, shape and sha256 of the bytes (NaN payloads and signed zeros included): equal digests are the
    bitwise identity the determinism and mutation checks ask for, without sending the tensor."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{hashlib.sha256(data).hexdigest()}"
