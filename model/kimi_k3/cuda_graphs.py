"""Decode steps replayed from CUDA graphs captured at fixed batch sizes, the way vLLM captures decode.

`step(*inputs)` runs one decode step on tensors whose first dim is the batch (token ids, hidden states,
cache slots, lengths); it calls `dispatcher.begin_step` itself, and reads and writes everything else
(weights, caches) at fixed addresses. It is captured once per size; a call with batch b copies its inputs
into the graph of the smallest captured size >= b and replays it. Rows past b are padding, reset on
every call to the values `make_inputs(size)` gave them (e.g. a scratch cache slot that no sequence
owns), so a padded row never touches a live sequence.

The dispatcher chooses implementations at capture, where the envelope is fixed for the graph (decode at
this batch size); those choices are counted once per replay, so `Dispatcher.report()` stays truthful.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .dispatch import Decision, Dispatcher


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    padding: tuple[torch.Tensor, ...]  # the inputs' values in rows no sequence fills
    inputs: tuple[torch.Tensor, ...]  # static input buffers the graph reads
    output: torch.Tensor  # static output buffer the graph writes
    decisions: list[Decision]


class GraphedDecode:
    """One CUDA graph of `step` per batch size in `sizes`; call it like `step`, with any batch up to
    max(sizes). The returned tensor is a view of the graph's output buffer: the next call overwrites it.
    `replays` counts the calls.

    A step may hold NCCL collectives (a tensor-parallel rank's all-reduces): they are captured like any kernel,
    provided the process group's communicator exists before the capture (it does once the group is created with
    a device id, as `distributed.run_tp` does) and every rank captures the same sizes in the same order; the
    warm-up calls then run the collectives eagerly first, on every rank alike."""

    def __init__(self, step: Callable[..., torch.Tensor], make_inputs: Callable[[int], tuple[torch.Tensor, ...]],
                 sizes: Sequence[int], dispatcher: Dispatcher, warmup: int = 2):
        self.step, self.make_inputs, self.dispatcher, self.warmup = step, make_inputs, dispatcher, warmup
        self.sizes = sorted(set(sizes))
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then fit in the memory the largest one already took from the pool.
        self.graphs = {size: self._capture(size) for size in reversed(self.sizes)}

    def _capture(self, size: int) -> _Graph:
        padding = tuple(self.make_inputs(size))
        inputs = tuple(t.clone() for t in padding)
        with self.dispatcher.recording():  # warm-up calls are not steps anyone asked for
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):  # lazy init, autotuning and JIT compiles happen outside the capture
                    self.step(*inputs)
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with self.dispatcher.recording() as decisions, torch.cuda.graph(graph, pool=self.pool):
            output = self.step(*inputs)
        return _Graph(graph, padding, inputs, output, decisions)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        b = inputs[0].shape[0]
        size = next((s for s in self.sizes if s >= b), None)
        if size is None:
            raise ValueError(f"batch {b} is above the largest captured size {self.sizes[-1]}")
        g = self.graphs[size]
        for static, new, pad in zip(g.inputs, inputs, g.padding, strict=True):
            static[:b].copy_(new)
            static[b:].copy_(pad[b:])
        g.graph.replay()
        self.replays += 1
        self.dispatcher.replayed(g.decisions)
        return g.output[:b]
