"""Side streams for a layer's independent branches. A branch forked onto a side stream starts after all work issued
so far on the current stream and runs beside what the current stream does next, until a join makes the current
stream wait for it; a CUDA graph captures the fork and the join as edges, so a decode step replays the overlap.
Off a GPU every side stream is None and a branch runs inline."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream | None:
    """The side stream of `role` on `device` (one per pair, made on first use), or None off a GPU."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key[0])
    return _STREAMS[key]


@contextlib.contextmanager
def forked(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Runs the block on `stream` after all work issued so far on the current stream; inline where None."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def joined(stream: torch.cuda.Stream | None, *made: torch.Tensor) -> None:
    """The current stream waits for `stream`'s work; `made` (allocated on `stream`) is freed only after the current
    stream's use of it."""
    if stream is None:
        return
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    for t in made:
        t.record_stream(current)
