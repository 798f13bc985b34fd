"""The candidate's side of the sandbox: a spawned process that imports candidate code, runs it on tensors the
gate sends, and sends back raw results: outputs and states (as tensors, or as sha256 digests for a repeated
run), digests of the other inputs after the call, storage pointers, per-call timings. It decides nothing:
every verdict is computed by the gate, in the parent.

It never learns the seed that drew its inputs. The functions the harness times and synchronizes with are
captured here before any candidate module is imported, used through those references, and checked after
every request: a candidate that replaces one is reported, whatever it returns.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import hashlib
import importlib
import io
import os
import signal
import sys
import time
import traceback
import types
from types import ModuleType
from typing import Any, Callable

import torch

from gates.core import isolation
from gates.core.compare import digest as _tensor_digest
from gates.core.l2 import L2_CALLS, cuda_runtime, persisting_l2_bytes, release_persisting_l2
from gates.core.machine import undumpable
from gates.core.sources import in_repository, repository_path
from kernels.bytes import span
from kernels.timing import PAD_CYCLES, L2Flusher, capture_graph, capture_pipeline, count_kernels
from kernels.trees import clone, copy_into, leaves, map_tensors, same_layout, state_leaves
from model.kimi_k3.ops.registry import import_entry_point

_perf_counter = time.perf_counter
_synchronize = torch.cuda.synchronize
_record = torch.cuda.Event.record
_elapsed_time = torch.cuda.Event.elapsed_time
_replay = torch.cuda.CUDAGraph.replay
_sleep = torch.cuda._sleep

# (owner, attribute) pairs a candidate could patch to forge timings or results.
GUARDED = {
    "time.perf_counter": (time, "perf_counter"),
    "torch.cuda.synchronize": (torch.cuda, "synchronize"),
    "torch.cuda.Event.record": (torch.cuda.Event, "record"),
    "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time"),
    "torch.cuda.Event.synchronize": (torch.cuda.Event, "synchronize"),
    "torch.cuda.Event.query": (torch.cuda.Event, "query"),  # run_concurrent: did both calls start at once
    "torch.cuda.CUDAGraph.replay": (torch.cuda.CUDAGraph, "replay"),
    "torch.cuda._sleep": (torch.cuda, "_sleep"),
    "torch.Tensor.copy_": (torch.Tensor, "copy_"),
    "torch.Tensor.clone": (torch.Tensor, "clone"),
    "torch.Tensor.cpu": (torch.Tensor, "cpu"),
    "torch.save": (torch, "save"),
    "torch.randint": (torch, "randint"),  # redraw_'s factors: patched to a constant, every replay would repeat
    "torch.cuda.memory_allocated": (torch.cuda, "memory_allocated"),  # held_bytes: what the calls keep
    "torch.cuda.empty_cache": (torch.cuda, "empty_cache"),  # poison: the allocator's cache refilled with poison
    "torch.cuda.memory_snapshot": (torch.cuda, "memory_snapshot"),  # poison: the free blocks it keeps
    "gc.collect": (gc, "collect"),
    "gc.get_objects": (gc, "get_objects"),
}
if cuda_runtime is not None:  # what the benchmarks read and release the L2 set-aside with
    GUARDED.update({f"cuda.bindings.runtime.{name}": (cuda_runtime, name) for name in (*L2_CALLS, "cudaMemset")})
# what process_state reads the process's defaults, modes and RNG with: patched, a reseeded RNG or TF32 left on reads
# as untouched
GUARDED.update({f"torch.{name}": (torch, name) for name in (
    "get_default_dtype", "get_default_device", "is_grad_enabled", "is_inference_mode_enabled",
    "are_deterministic_algorithms_enabled", "get_float32_matmul_precision", "get_num_threads", "get_rng_state")})
GUARDED["torch.cuda.get_rng_state"] = (torch.cuda, "get_rng_state")
# Classes and modules whose every attribute the worker's checks compute with, on every tensor of every call: a
# digest (detach, contiguous, view, numpy, then hashlib), a storage's pointer and size (aliasing, fresh), a canary
# zone's comparison (bounds). A candidate that replaces one method of theirs (torch.Tensor.detach handing back the
# bytes an input held before the call wrote it) forges the checks computed in its process without touching a name
# GUARDED lists, so each attribute of theirs (a class's through its bases) is fingerprinted with the worker, before
# any candidate import, and checked after every call. The torch module's other functions are not: a candidate may
# patch what the yardstick calls (torch.matmul), which the benchmarks judge by timing the standard alone.
LIBRARY_SURFACE = {"torch.Tensor": torch.Tensor, "torch.UntypedStorage": torch.UntypedStorage, "hashlib": hashlib}
_ORIGINAL = {name: getattr(owner, attr) for name, (owner, attr) in GUARDED.items()}
POISON_COPIES = 4
# Scratch a candidate allocates for itself (split-K partials, arrival counters) comes from the caching allocator too.
# Memory fresh from the driver reads as zeros, so in a fresh process scratch assumed zeroed (partials accumulated
# with atomics into torch.empty, a semaphore never cleared) is right, and wrong in serving, where the memory was
# used before. On a GPU, poison() first returns every free cached block to the driver and writes 0xFF over the free
# blocks it keeps (those of segments still partly in use), then caches one block of the large pool (later requests up
# to its size are split from it) and enough 1 MiB blocks to fill SMALL_POOL_BYTES of the small pool's 2 MiB
# segments, all 0xFF: NaN in every float format, -1 in every integer.
SCRATCH_POISON_BYTES = 1 << 30
SMALL_POOL_BYTES, SMALL_BLOCK_BYTES = 64 << 20, 1 << 20
# The code that serves a request in this process: the worker, what it copies, digests and times with, and the loader
# of entry points. Its functions, classes and tables are fingerprinted when this module loads, before any candidate
# import; so are the reference's and standard's modules, loaded before the candidate (load(trusted=True)).
OWN_MODULES = ("gates.core.worker", "kernels.trees", "gates.core.compare", "kernels.timing", "gates.core.l2",
               "model.kimi_k3.ops.registry")


CODE = (types.FunctionType, staticmethod, classmethod, property)


def _watched(value: Any) -> bool:
    """Code a request runs: a function, a class, or a table of callables (a dispatch table). A dict of data (a
    cache, the evals' session state) changes as it serves and is not watched."""
    return (isinstance(value, (types.FunctionType, type))
            or (isinstance(value, dict) and bool(value) and all(callable(v) for v in value.values())))


def _parts(value: Any) -> tuple:
    """What a candidate could swap in a watched value: the object itself and, for a function, its code and
    defaults; for a class, its methods (class attributes that are data may change as it serves); for a table, its
    entries. Compared by identity (_same)."""
    if isinstance(value, types.FunctionType):
        return (value, value.__code__, value.__defaults__, value.__kwdefaults__)
    if isinstance(value, type):
        return (value, tuple((k, v) for k, v in vars(value).items() if isinstance(v, CODE)))
    if isinstance(value, dict):
        return (value, tuple(value.items()))
    return (value,)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


def _namespaces(owner: type | ModuleType) -> list[Any]:
    """Every dict an attribute of `owner` is looked up in: a module's own; a class's and its bases' (but object's,
    which no one can change), so that an attribute set on a subclass to shadow its base's shows too."""
    return [vars(owner)] if isinstance(owner, ModuleType) else [vars(c) for c in owner.__mro__ if c is not object]


def _watcher() -> tuple[Callable[[], list[str]], Callable[[ModuleType], None]]:
    """(changed, watch): changed() names every guarded callable replaced, every attribute of LIBRARY_SURFACE
    replaced, added or removed, and every watched module global whose function, class or table was swapped or edited
    since watch(module) fingerprinted it. The fingerprints and the helpers live in this closure, out of reach of a
    candidate that rebinds this module's globals."""
    guarded = {name: (owner, attr, getattr(owner, attr)) for name, (owner, attr) in GUARDED.items()}
    missing = object()
    surface = []  # (label, namespace, attribute, its value then, or `missing`)
    for label, owner in LIBRARY_SURFACE.items():
        spaces = _namespaces(owner)
        for attr in {a for space in spaces for a in space}:
            surface += [(f"{label}.{attr}", space, attr, space.get(attr, missing)) for space in spaces]
    prints: dict[str, tuple[ModuleType, dict[str, tuple]]] = {}
    parts, same, watched = _parts, _same, _watched

    def watch(module: ModuleType) -> None:
        if module.__name__ not in prints:
            prints[module.__name__] = (module, {k: parts(v) for k, v in vars(module).items()
                                                if watched(v) and not k.startswith("__")})

    def changed() -> list[str]:
        out = [name for name, (owner, attr, original) in guarded.items() if getattr(owner, attr) is not original]
        out += [label for label, space, attr, was in surface if space.get(attr, missing) is not was]
        for name, (module, before) in prints.items():
            now = vars(module)
            out += [f"{name}.{k}" for k, was in before.items() if k not in now or not same(parts(now[k]), was)]
        return list(dict.fromkeys(out))  # a replaced method shows in each namespace it is looked up in, once

    return changed, watch


_changed, _watch = _watcher()


def tampered() -> list[str]:
    return _changed()


class Tampered(RuntimeError):
    """Importing or calling candidate code replaced a guarded function or changed watched code: nothing more runs in
    this process's request, and the reply names what was replaced (`replaced`), even if it was put back since."""

    def __init__(self, what: str, replaced: list[str]) -> None:
        super().__init__(f"{what} replaced {', '.join(replaced)}")
        self.replaced = replaced


def load(entry: str, trusted: bool = False) -> Callable:
    """Import a `module:function` entry point and stop at once if that replaced a guarded function or changed a
    watched module (the gate reports tampering from the reply), before it can run anything else, e.g. a standard
    that takes minutes. A trusted entry (the reference, the standard), loaded before the candidate, has the
    repository modules its import brought in watched from then on."""
    before = set(sys.modules)
    fn = import_entry_point(entry)
    if patched := tampered():
        raise Tampered(f"importing {entry}", patched)
    if trusted:
        for name in sorted(set(sys.modules) - before) + [entry.partition(":")[0]]:
            if in_repository(sys.modules.get(name)):
                _watch(sys.modules[name])
    return fn


def _sync(device: str) -> None:
    if device == "cuda":
        _synchronize()


def _storage(t: torch.Tensor) -> tuple[int, int]:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0


def _accepted(name: str, t: Any, device: str, problems: list[str]) -> bool:
    if type(t) is not torch.Tensor:  # noqa: E721 - subclasses can defer work past the call or lie about values
        problems.append(f"{name} is a {type(t).__module__}.{type(t).__qualname__}, not a plain torch.Tensor")
        return False
    if t.device.type != device:
        problems.append(f"{name} is on {t.device}, expected {device}")
        return False
    return True


def plain_copy(name: str, t: Any, device: str, problems: list[str]) -> torch.Tensor | None:
    """A detached CPU copy of a candidate's tensor, or None with the reason in `problems`."""
    return _ORIGINAL["torch.Tensor.clone"](t.detach()).to("cpu") if _accepted(name, t, device, problems) else None


def _digest(name: str, t: Any, device: str, problems: list[str]) -> str | None:
    return _tensor_digest(t) if _accepted(name, t, device, problems) else None


def process_state(device: str) -> dict[str, Any]:
    """What one call could change for every later op of the process (serving runs the whole model in it): the
    defaults new tensors and autograd take, the matmul precision every later GEMM runs at, and the RNG streams
    sampling draws from (a kernel that draws or reseeds moves every later sample)."""
    matmul = torch.backends.cuda.matmul
    state = {
        "the default dtype": torch.get_default_dtype(),
        "the default device": str(torch.get_default_device()),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "the float32 matmul precision": (torch.get_float32_matmul_precision(),
                                         getattr(matmul, "fp32_precision", None),
                                         getattr(torch.backends.cudnn, "fp32_precision", None)),
        "reduced-precision matmul reductions": (matmul.allow_bf16_reduced_precision_reduction,
                                                matmul.allow_fp16_reduced_precision_reduction),
        "the intra-op thread count": torch.get_num_threads(),
        "the CPU RNG state": _tensor_digest(torch.get_rng_state()),
    }
    if device == "cuda":
        state["the CUDA RNG state"] = _tensor_digest(torch.cuda.get_rng_state())
    return state


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """process_state() differences, one line each."""
    return [f"changed {what} (drew from it or reseeded it)" if "RNG" in what else
            f"changed {what} ({before[what]!r} -> {after[what]!r})" for what in before if after[what] != before[what]]


def call(fn: Callable, args: tuple, state: tuple[int, ...], names: list[str], device: str, keep: list,
         full: bool = True, with_inputs: bool = True) -> dict:
    """One call of the candidate on `args` (its buffers, updated in place): its raw outputs and side effects.

    Outputs and states come back as tensors (`full`) or as digests (a repeated run, compared bit for bit);
    the other inputs as digests. `keep` holds the returned objects alive, so a later run cannot be handed
    this run's result memory.
    """
    inputs = [(n, *_storage(t)) for i, a in enumerate(args) for n, t in leaves(a, names[i])]
    before = process_state(device)
    try:
        out = fn(*args)
        _sync(device)
    except Exception as e:  # the candidate's own failure: a result, not a harness error
        return {"raised": f"{type(e).__name__}: {e}"}
    # before this process reads anything of the call: a method replaced for the reads and put back before the
    # request's end (when the caller lets go of what the call returned) is seen here
    if patched := tampered():
        raise Tampered("a call of the candidate", patched)
    after = process_state(device)
    keep.append(out)
    problems: list[str] = []
    record = plain_copy if full else _digest
    result = {
        "outputs": [(n, v) for n, t in leaves(out, "out") if (v := record(n, t, device, problems)) is not None],
        "states": [(n, v) for n, t in state_leaves(args, state, names)
                   if (v := record(n, t, device, problems)) is not None],
        "problems": problems,
        "side_effects": changes(before, after),
        "input_storage": inputs,
        "output_storage": [(n, *_storage(t)) for n, t in leaves(out, "out")],
    }
    if with_inputs:
        result["inputs"] = [(n, _tensor_digest(t)) for i, a in enumerate(args) if i not in state
                            for n, t in leaves(a, names[i])]
    return result


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What reads as poison in a tensor of `dtype`: NaN, or the largest integer."""
    if dtype.is_floating_point:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max


def poison(specs: list[tuple[tuple[int, ...], torch.dtype]], device: str) -> None:
    """Fill freed memory of each output's size with NaN (or the max integer): an output the candidate does not
    write then reads as poison, not as whatever result last lived there. On a GPU the allocator's whole cache is
    poison too (SCRATCH_POISON_BYTES): so is scratch the candidate allocates."""
    held = []
    if device == "cuda":
        _ORIGINAL["torch.cuda.empty_cache"]()
        sizes = [SCRATCH_POISON_BYTES] + [SMALL_BLOCK_BYTES] * (SMALL_POOL_BYTES // SMALL_BLOCK_BYTES)
        held += [torch.full((n,), 0xFF, dtype=torch.uint8, device=device) for n in sizes]
    for shape, dtype in specs:
        for _ in range(POISON_COPIES):
            held.append(torch.full(shape, poison_value(dtype), dtype=dtype, device=device))
    if device == "cuda":
        _poison_free_cached_blocks()
    _sync(device)
    del held


def _poison_free_cached_blocks() -> None:
    """0xFF over every block the allocator keeps free now, while poison() holds its own: the rest of segments still
    partly in use (empty_cache keeps those) and of the segments the outputs' poison was carved from (fresh from the
    driver, so zeros)."""
    for segment in _ORIGINAL["torch.cuda.memory_snapshot"]():
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                (err,) = _ORIGINAL["cuda.bindings.runtime.cudaMemset"](block["address"], 0xFF, block["size"])
                if err != cuda_runtime.cudaError_t.cudaSuccess:
                    raise RuntimeError(f"poison: cudaMemset of a free cached block failed ({err})")


# The autograd modes a kernel is called under: the model's forward runs under torch.no_grad, serving engines under
# torch.inference_mode, a test often with autograd on. A kernel may read the mode (to skip saving for backward) but
# its results must not depend on it: it is the cheapest signal that tells serving from a harness that calls it with
# autograd on, as the production replay does. Run r of an input is called under AUTOGRAD_MODES[r % 3] (run 1, the
# one held to the reference, under the model's), and the runs must agree bit for bit (run_cases).
AUTOGRAD_MODES = (torch.no_grad, torch.inference_mode, torch.enable_grad)
GUARD_BYTES = 4096  # the least canary zone on each side of an argument tensor (a multiple of any alignment asked)
CANARY = 0xA5  # every byte of a zone, unless a run asks for another (CANARIES)
# The zones' byte in run r of an input (run_cases): bytes a kernel reads past its tensors must change its result, so
# each run puts other bytes there and the runs' outputs must still agree bit for bit. 0xA5 reads as about -3e-16 in
# bf16 and fp32 (as good as the zeros a padding row is assumed to hold); 0xFF is NaN in every float format and -1
# as an integer; 0x7F is 3.4e38 in bf16 and fp32, NaN in fp16 and e4m3, a large positive integer; 0x01 a tiny
# positive subnormal. A masked over-read (NaN x 0 is NaN, a huge value added then subtracted is not the value) or
# an index read past an integer tensor then shows in some run even where another run's bytes look like padding.
CANARIES = (CANARY, 0xFF, 0x7F, 0x01)


class Guards:
    """Argument tensors placed each inside a buffer of its own, between two zones of CANARY bytes, each zone at
    least GUARD_BYTES and one slice of the tensor's leading dimension (a cache's slot, a batch row), so that an
    index one past either end lands in a zone: a kernel that writes outside the tensors it was given (a padding
    row's state stored one slot past the cache, a tile's tail past a buffer) changes a canary instead of memory the
    gate never looks at. The views keep the tensors' shapes, strides and dtypes (copy_into and same_layout see no
    difference) and are as aligned as a fresh allocation (a zone is a whole number of GUARD_BYTES)."""

    def __init__(self) -> None:
        self.zones: dict[int, tuple[torch.Tensor, int, int]] = {}  # id(view) -> (buffer, start, end) in bytes
        self.canary = CANARY  # the byte every zone holds now

    def refill(self, canary: int) -> None:
        """Every zone filled with `canary`, which `overruns` then checks for."""
        self.canary = canary
        for buffer, start, end in self.zones.values():
            buffer[:start].fill_(canary)
            buffer[end:].fill_(canary)

    def place(self, obj: Any) -> Any:
        """A copy of `obj` with every tensor placed between canary zones."""
        return map_tensors(obj, self._place)

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        copy = _ORIGINAL["torch.Tensor.clone"](t.detach())
        item, extent = copy.element_size(), copy.untyped_storage().nbytes()  # a fresh copy spans its storage
        slice_bytes = copy.stride(0) * item if copy.dim() else 0
        zone = -(-max(GUARD_BYTES, slice_bytes) // GUARD_BYTES) * GUARD_BYTES
        buffer = torch.full((zone + extent + zone,), self.canary, dtype=torch.uint8, device=copy.device)
        view = torch.empty(0, dtype=copy.dtype, device=copy.device).set_(
            buffer.untyped_storage(), zone // item, copy.shape, copy.stride())
        _ORIGINAL["torch.Tensor.copy_"](view, copy)
        self.zones[id(view)] = (buffer, zone, zone + extent)
        return view

    def overruns(self, args: tuple, names: list[str]) -> list[str]:
        """Where a call wrote outside the argument tensors (changed canaries, before or after which tensor); the
        zones are then made whole again, so each call answers for itself."""
        found = []
        for i, a in enumerate(args):
            for name, t in leaves(a, names[i]):
                if (placed := self.zones.get(id(t))) is None:
                    continue
                buffer, start, end = placed
                for side, zone in (("before", buffer[:start]), ("after", buffer[end:])):
                    changed = int((zone != self.canary).sum())
                    if changed:
                        found.append(f"{changed} byte(s) {side} {name} changed: a write outside the tensors the "
                                     "call was given")
                        zone.fill_(self.canary)
        return found


def persistent_buffers(pool: list, pristine: Any, guards: Guards) -> Any:
    """The buffers in `pool` laid out as `pristine`, made on first need (between canary zones, `guards`): a serving
    engine keeps one set per shape (a cache of another context length is another allocation), and cases of one
    envelope point may differ so."""
    for buffers in pool:
        if same_layout(buffers, pristine):
            return buffers
    pool.append(guards.place(pristine))
    return pool[-1]


def run_cases(*, candidate: str, reference: str, device: str, names: list[str], cases: list, runs: int,
              output_specs: list) -> dict:
    """Every case of one envelope point on persistent buffers (same pointers, fresh contents, as a serving engine
    calls a kernel; one set per layout, see persistent_buffers). Run 0 follows the reference in this process,
    whose result has just been freed, and returns its tensors; the other runs follow poisoned memory and return
    digests, which must match run 0's bit for bit. Run r's canary zones hold CANARIES[r] and it is called under
    AUTOGRAD_MODES[r]: a result that depends on bytes past its tensors, or on the autograd mode, differs between the
    runs."""
    ref = load(reference, trusted=True)
    fn = load(candidate)
    pool: list = []
    guards = Guards()
    results = []
    for case in cases:
        pristine = clone(case.args, device)
        buffers = persistent_buffers(pool, pristine, guards)
        keep: list = []
        kept_runs: list[int] = []  # the run of each object in `keep` (call keeps nothing of a run that raised)
        per_run = []
        for r in range(runs):
            guards.refill(CANARIES[r % len(CANARIES)])
            copy_into(buffers, pristine)
            if r == 0:
                ref(*clone(pristine))  # its result is freed right here: the trap a candidate must not fall into
            else:
                poison(output_specs, device)
            with AUTOGRAD_MODES[r % len(AUTOGRAD_MODES)]():
                per_run.append(call(fn, buffers, case.state, names, device, keep, full=r == 0))
            per_run[-1]["overruns"] = guards.overruns(buffers, names)
            # what the earlier runs returned, as it is now: the caller still holds it (serving keeps a layer's
            # output for later layers: a residual, an AttnRes block), so a call must not write there
            per_run[-1]["earlier_outputs"] = [(k, n, _tensor_digest(t)) for k, out in zip(kept_runs, keep)
                                              for n, t in leaves(out, "out") if type(t) is torch.Tensor]
            if "raised" not in per_run[-1]:
                kept_runs.append(r)
        results.append(per_run)
        del keep
    return {"cases": results}


def written_leaves(args: tuple, names: list[str], written: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    """The leaves of `args` that `written` names: an argument's name takes all its leaves, `name[-1]` its last (the
    newest of a list of sources)."""
    out = []
    for spec in written:
        arg = spec.removesuffix("[-1]")
        if arg in names:
            found = list(leaves(args[names.index(arg)], arg))
            out += found[-1:] if spec.endswith("[-1]") else found
    return out


def run_late_inputs(*, candidate: str, names: list[str], cases: list, written: tuple[str, ...]) -> dict:
    """GPU: each case's call captured in one CUDA graph behind the late writer (gates/core/late_writer.py), once per
    leaf the op's predecessor writes: the writer lets the candidate start (griddepcontrol.launch_dependents), waits,
    then writes that leaf, which held poison until then. Per case and leaf the digests of the outputs and the
    updated state (from the case's state, reset before the replay), to be run 1's bit for bit: a kernel launched
    with programmatic dependent launch that reads the leaf before griddepcontrol.wait reads the poison."""
    from gates.core import late_writer

    _watch(late_writer)
    fn = load(candidate)
    results = []
    for case in cases:
        pristine = clone(case.args, "cuda")
        per_leaf = []
        for leaf, original in written_leaves(pristine, names, written):
            buffers = clone(pristine)
            target = span(dict(written_leaves(buffers, names, written))[leaf])
            source = span(original).clone()
            held: dict = {}

            def step(buffers=buffers, target=target, source=source, held=held):
                late_writer.late_write(source, target)
                held["out"] = fn(*buffers)

            try:
                graph = capture_graph(step)
                copy_into(buffers, pristine)
                target.fill_(0xFF)  # NaN in every float format, -1 as an integer: what a read too early sees
                _replay(graph)
                _synchronize()
            except Exception as e:  # the candidate's failure: a result
                per_leaf.append({"leaf": leaf, "raised": f"{type(e).__name__}: {e}"})
                continue
            problems: list[str] = []
            per_leaf.append({"leaf": leaf, "problems": problems,
                             "outputs": [(n, d) for n, t in leaves(held["out"], "out")
                                         if (d := _digest(n, t, "cuda", problems)) is not None],
                             "states": [(n, d) for n, t in state_leaves(buffers, case.state, names)
                                        if (d := _digest(n, t, "cuda", problems)) is not None]})
        results.append(per_leaf)
    return {"cases": results}


def run_trajectory(*, candidate: str, device: str, names: list[str], initial: tuple, state: tuple[int, ...],
                   steps: list) -> dict:
    """Consecutive decode steps carrying the state in place: each step's outputs, then the final state."""
    fn = load(candidate)
    guards = Guards()
    args = guards.place(clone(initial, device))
    keep: list = []
    outputs = []
    for step in steps:
        for i, a in enumerate(step):
            if i not in state:
                copy_into(args[i], a)
        result = call(fn, args, (), names, device, keep, with_inputs=False)
        result["overruns"] = guards.overruns(args, names)
        outputs.append(result)
        if "raised" in result:
            break
        keep.clear()
    problems: list[str] = []
    final = [(n, plain_copy(n, t, device, problems)) for n, t in state_leaves(args, state, names)]
    return {"steps": outputs, "final_state": final, "problems": problems}


def run_calls(*, candidate: str, device: str, names: list[str], cases: list, calls: int) -> dict:
    """`calls` consecutive calls cycling through `cases` (one envelope point's inputs, the state reset to the case's
    before each call), as a serving engine calls a kernel step after step: per call the digests of its outputs and
    state, and the tensors themselves for the first and the last call on each case. A kernel that counts its calls
    and changes after a warm-up shows as a call that differs from the first one on the same input.

    Also the memory live before the first call (call -1), after each call of the first round over the cases and
    after the last call (held_bytes, the call's outputs freed), with whether the call's buffers had served an
    earlier call: every buffer is made before the first call, so what the worker holds stays the same and a change
    is what the candidate kept."""
    fn = load(candidate)
    pristine = [clone(case.args, device) for case in cases]
    pool: list = []
    guards = Guards()
    layouts = [persistent_buffers(pool, p, guards) for p in pristine]
    keep: list = []
    results: list[dict] = []
    held = [{"call": -1, "bytes": held_bytes(device, results), "layout_served": False}]
    served: set[int] = set()
    for k in range(calls):
        case = cases[k % len(cases)]
        buffers = layouts[k % len(cases)]
        copy_into(buffers, pristine[k % len(cases)])
        full = k < len(cases) or k >= calls - len(cases)
        result = call(fn, buffers, case.state, names, device, keep, full=full, with_inputs=False)
        result["overruns"] = guards.overruns(buffers, names)
        keep.clear()
        results.append({key: result[key] for key in ("raised", "outputs", "states", "problems", "side_effects",
                                                     "overruns") if key in result})
        if "raised" in result:
            break
        if k < len(cases) or k == calls - 1:
            held.append({"call": k, "bytes": held_bytes(device, results), "layout_served": id(buffers) in served})
        served.add(id(buffers))
    return {"calls": results, "held": held}


def held_bytes(device: str, records: list) -> int:
    """The bytes of tensors live in this process on `device`, garbage cycles collected first: on a GPU the caching
    allocator's count (tensors a compiled extension holds included); on a CPU the storages of every tensor the
    garbage collector tracks, but those of the worker's `records` (outputs kept as the gate asked)."""
    _ORIGINAL["gc.collect"]()
    if device == "cuda":
        _synchronize()
        return _ORIGINAL["torch.cuda.memory_allocated"]()
    own = {t.untyped_storage().data_ptr() for _, t in leaves(records, "")}
    storages = {}
    for obj in _ORIGINAL["gc.get_objects"]():
        # type(), not isinstance: isinstance reads __class__, which some module objects answer with a warning
        if issubclass(type(obj), torch.Tensor) and obj.layout == torch.strided and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in own:
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def poison_(obj: Any) -> None:
    """Every tensor of `obj` filled with NaN (integers: their max), in place: inputs not yet written."""
    for _, t in leaves(obj, ""):
        t.fill_(poison_value(t.dtype))


CONCURRENT_SPINS = (PAD_CYCLES, 8 * PAD_CYCLES, 64 * PAD_CYCLES, 512 * PAD_CYCLES)  # ~0.1, 0.8, 6.4, 51 ms


def _pair_behind_spin(fn: Callable, buffers: list, inputs: list, spin: int, hold: torch.cuda.Stream,
                      streams: tuple, device: str) -> tuple[list, bool]:
    """One try of run_concurrent's pair: the buffers poisoned, a spin of `spin` cycles on `hold`, each call's input
    copy and call enqueued on its stream behind it. (outputs, whether the spin still held both calls when the host
    had enqueued them)."""
    for b in buffers:
        poison_(b)
    _sync(device)
    start = torch.cuda.Event()
    with torch.cuda.stream(hold):
        _sleep(spin)
    _record(start, hold)
    current = torch.cuda.current_stream()
    outs = []
    for stream, b, pristine in zip(streams, buffers, inputs):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            copy_into(b, pristine)
            outs.append(fn(*b))
        current.wait_stream(stream)
    at_once = not _ORIGINAL["torch.cuda.Event.query"](start)
    _sync(device)
    return outs, at_once


def run_concurrent(*, candidate: str, device: str, names: list[str], cases: list, pairs: list) -> dict:
    """Each pair of `cases` called at once on two side streams, as a serving engine runs the shared experts beside
    the routed ones and the MLA gate beside its attention. Both calls' buffers are poisoned (poison_) and the device
    synchronized; then a spin holds a third stream while the host enqueues on each side stream, behind an event after
    the spin, the copy of that call's inputs and the call: the two start together, and each finds its inputs written
    only if it runs on the stream it was called on (a launch on the default stream runs at once, on poison). The
    spin must outlast the host's enqueueing of both calls (an eager candidate of many launches takes far longer than
    a graph replay): where the spin had ended before the second call was enqueued, the first ran alone, so the pair
    is made again behind a spin 8 times longer (CONCURRENT_SPINS). Per call (case, in pair order) the digests of its
    outputs and state and whether its pair started at once, for the gate to hold to the same call made alone. A
    kernel sharing a workspace between calls, or launching on a stream of its own, differs."""
    fn = load(candidate)
    guards = Guards()
    pristine = [clone(case.args, device) for case in cases]
    hold, streams = torch.cuda.Stream(), (torch.cuda.Stream(), torch.cuda.Stream())
    results = []
    for pair in pairs:
        buffers = [guards.place(pristine[i]) for i in pair]
        try:
            for spin in CONCURRENT_SPINS:
                outs, at_once = _pair_behind_spin(fn, buffers, [pristine[i] for i in pair], spin, hold, streams,
                                                  device)
                if at_once:
                    break
        except Exception as e:  # the candidate's own failure: a result, not a harness error
            _sync(device)
            results.append({"raised": f"{type(e).__name__}: {e}"})
            continue
        for i, b, out in zip(pair, buffers, outs):
            problems: list[str] = []
            got = [(n, d) for n, t in leaves(out, "out") if (d := _digest(n, t, device, problems)) is not None]
            got += [(n, d) for n, t in state_leaves(b, cases[i].state, names)
                    if (d := _digest(n, t, device, problems)) is not None]
            beside = pair[1] if i == pair[0] else pair[0]
            results.append({"case": i, "beside": beside, "got": got, "problems": problems, "at_once": at_once,
                            "overruns": guards.overruns(b, names)})
    return {"calls": results}


REDRAW_FACTORS = (-1.0, -0.5, 0.5, 1.0)  # powers of two: exact in every float dtype, no overflow
PIPELINE_SEEDS = 1 << 40  # the pipeline replays' redraw seeds, apart from the one-call replays' (0, 1, ...)


def redraw_(dst: Any, src: Any, seed: int) -> None:
    """dst = src with every floating element times a random one of REDRAW_FACTORS (drawn from `seed`; integer
    tensors copied as they are): the step's activation gets new contents for every timed replay, so no output
    cached by pointer or by any fingerprint of it (a hash, a sum, a sum of squares) is ever right again, while
    the values keep their magnitudes and the call its work."""
    gen = None
    for (_, d), (_, s) in zip(leaves(dst, ""), leaves(src, ""), strict=True):
        if not s.is_floating_point():
            d.copy_(s)
            continue
        if gen is None:
            gen = torch.Generator(device=s.device).manual_seed(seed)
        factors = torch.tensor(REDRAW_FACTORS, device=s.device, dtype=s.dtype)
        d.copy_(s * factors[_ORIGINAL["torch.randint"](len(REDRAW_FACTORS), s.shape, generator=gen,
                                                        device=s.device)])


class BenchSession:
    """Candidate and standard captured once in CUDA graphs, then timed side by side in blocks the gate asks for.

    Every timed replay starts cold on fresh inputs: the next input set (cycling through `sets`) is copied into the
    graph's buffers, its first argument (every op's step activation: x, z, q_nope, proj, sources) redrawn by
    `redraw_` from a seed both implementations of a pair share, and a buffer of twice the L2 is written (read, for
    "cold_sets" below: the dirty lines of the flush or the copies are then written back before the replay instead of
    during it). Then a spin kernel holds the stream while the host enqueues the start event, the replay and the end
    event (NVBench's blocking kernel), so the events time the GPU's work and never the host's enqueueing (a replay
    the host has not submitted when the stream reaches the start event would be charged the host's delay). On the
    H200 this order gave the steadiest times of the three tried (NOTES.md run 5): with the spin before the flush, or
    none, a 4-CTA-cluster kernel at batch 1 swung between 7 and 15 us from block to block.
    Candidate and standard alternate within each pair, in alternating order, so a slow phase of the machine
    hits both. Host wall time is replay plus a device-wide synchronize, which also counts work left on other
    streams. Each block returns the last pair's outputs (candidate and standard on the same redrawn inputs), of the
    one-call replays and of one input set (`check_set`, the gate's secret choice) of the in-pipeline replays, for the
    gate to compare: a candidate fast because it skipped work returns outputs that do not follow their inputs.
    Finally every input set is replayed once more, as drawn, and the outputs returned for the gate to check.
    No L2 is set aside for persisting accesses while anything is timed: lines kept there would outlive the flush
    (what the implementations set aside is reported as `l2_set_aside`, and the gate fails a candidate for it).

    In-pipeline time, the headline (gates/PRACTICES.md): each implementation is also captured once over all N
    input sets in one graph, as a decode step runs one layer after another with the other layers' weights
    passing through the L2 between them; per-call time = replay / N, the graph's launch paid once for N calls.
    Where the other N - 1 sets together exceed twice the L2 (a projection's weights), each call's inputs are cold
    without help, and the L2 holds clean lines as in a decode step ("cold_sets"). Otherwise an L2 flush precedes
    each call and an identical graph of the N flushes alone is replayed beside it and subtracted ("flushed"):
    the flush's dirty lines are written back during the next call, which charges a weight-streaming op a few
    µs no decode step pays (the linear kernel's NOTES.md: KDA in_proj 27.0 µs flushed against 22.8 µs in its
    own benchmark). The fresh inputs are copied into the N buffers (and redrawn) before each pipeline replay.
    """

    def __init__(self, impls: dict[str, str], names: list[str], state: tuple[int, ...], sets: list):
        release_persisting_l2()
        # the standard (trusted, watched from then on) is imported before the candidate; the order of impls stays
        loaded = {name: load(entry, trusted=True) for name, entry in impls.items() if name != "candidate"}
        self.fns = {name: loaded.get(name) or load(entry) for name, entry in impls.items()}
        self.names, self.state = names, state
        self.sets = [clone(s, "cuda") for s in sets]
        self.flush = L2Flusher()
        # one buffer per input set and implementation, and one graph per set for the one-call-per-replay figure: a
        # graph bakes in its call's non-tensor arguments (a scaling factor, a flag), so a set's own scalars reach
        # the op only through its own capture; the in-pipeline graph below reads the same buffers
        self.buffers = {name: [clone(s) for s in self.sets] for name in self.fns}
        self.graphs: dict[str, list] = {name: [] for name in self.fns}
        self.outs: dict[str, list] = {name: [] for name in self.fns}
        for name, fn in self.fns.items():
            for args in self.buffers[name]:
                held: dict[str, Any] = {}
                self.graphs[name].append(capture_graph(lambda fn=fn, args=args, held=held: held.update(out=fn(*args))))
                self.outs[name].append(held["out"])  # the captured call's output: every replay rewrites it
        set_bytes = min(sum(t.numel() * t.element_size() for _, t in leaves(s, "set")) for s in self.sets)
        self.pipeline = "cold_sets" if (len(self.sets) - 1) * set_bytes >= self.flush.nbytes else "flushed"
        flush = self.flush if self.pipeline == "flushed" else None
        self.pipe_outs: dict[str, list[dict]] = {name: [{} for _ in self.sets] for name in self.fns}
        self.pipelines = {name: capture_pipeline([lambda fn=fn, args=args, held=held: held.update(out=fn(*args))
                                                  for args, held in zip(self.buffers[name], self.pipe_outs[name])],
                                                 flush)
                          for name, fn in self.fns.items()}
        self.flushes = capture_pipeline([lambda: None] * len(self.sets), flush, warmup=1) if flush else None
        # cold_sets: what precedes a timed replay reads twice the L2 instead of writing it, so the dirty lines of
        # the flush or of the input copies are written back before the replay, not during it
        self.evict = self.flush if flush else functools.partial(torch.amax, torch.empty_like(self.flush.buf))
        # The L2 any code set aside for persisting accesses while the implementations ran (their import, warm-up and
        # capture; only graphs replay from here): reported, then released, so every timed replay starts from an L2
        # that the flush empties, as a decode step's other layers would (gates.core.l2)
        self.l2_set_aside = persisting_l2_bytes()
        release_persisting_l2()
        self.replays = 0  # one-call pairs so far: the redraw seed of the next pair
        self.piped = 0  # pipeline pairs so far (their seeds start at PIPELINE_SEEDS)

    def _load(self, buffer: tuple, k: int, seed: int) -> None:
        """Input set k into its buffers, its first argument redrawn from `seed`."""
        copy_into(buffer[1:], self.sets[k][1:])
        redraw_(buffer[0], self.sets[k][0], seed)

    def _prepare(self, name: str):
        """The next input set into its buffers (redrawn: the pair's seed); the graph that reads them."""
        k = self.replays % len(self.sets)
        self._load(self.buffers[name][k], k, self.replays)
        return self.graphs[name][k]

    @staticmethod
    def _outputs(out) -> dict:
        """Plain copies of a call's outputs (the graph's own buffers: valid until that graph's next replay)."""
        problems: list[str] = []
        return {"outputs": [(n, c) for n, t in leaves(out, "out")
                            if (c := plain_copy(n, t, "cuda", problems)) is not None], "problems": problems}

    def block(self, pairs: int, check_set: int = 0) -> dict:
        if not 0 <= check_set < len(self.sets):
            raise ValueError(f"check_set {check_set}: {len(self.sets)} input sets")
        order, events = list(self.fns), []
        for i in range(pairs):
            for name in (order if i % 2 == 0 else order[::-1]):
                events.append((name, *self._timed(self._prepare(name))))
            self.replays += 1
        _synchronize()
        last = (self.replays - 1) % len(self.sets)  # the outputs stay in the graphs' buffers until their next replay
        spots = [{"where": "last timed pair", **{name: self._outputs(self.outs[name][last]) for name in self.fns}}]
        piped = []
        for i in range(pairs):
            for name in (order if i % 2 == 0 else order[::-1]):
                for k, buffer in enumerate(self.buffers[name]):
                    self._load(buffer, k, PIPELINE_SEEDS + self.piped)
                piped.append((name, self._timed(self.pipelines[name]),
                              self._timed(self.flushes) if self.flushes else None))
            self.piped += 1
        _synchronize()
        spots.append({"where": f"last in-pipeline pair, input set {check_set + 1}",
                      **{name: self._outputs(self.pipe_outs[name][check_set]["out"]) for name in self.fns}})
        device_us: dict[str, list[float]] = {name: [] for name in self.fns}
        for name, start, end in events:
            device_us[name].append(_elapsed_time(start, end) * 1e3)
        n = len(self.sets)
        pipeline_us: dict[str, list[float]] = {name: [] for name in self.fns}
        for name, (s1, e1), flushes in piped:
            subtract = _elapsed_time(*flushes) if flushes else 0.0
            pipeline_us[name].append((_elapsed_time(s1, e1) - subtract) * 1e3 / n)
        return {"device_us": device_us, "pipeline_us": pipeline_us, "spots": spots}

    def _timed(self, graph) -> tuple:
        """Replay a graph from a cold L2 behind a spin kernel, bracketed by events (not yet read)."""
        self.evict()
        _sleep(PAD_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _record(start)
        _replay(graph)
        _record(end)
        return start, end

    def finish(self, host_iters: int) -> dict:
        host_us: dict[str, list[float]] = {name: [] for name in self.fns}
        for _ in range(host_iters):
            for name in self.fns:
                graph = self._prepare(name)
                self.flush()
                _synchronize()
                t0 = _perf_counter()
                _replay(graph)
                _synchronize()
                host_us[name].append((_perf_counter() - t0) * 1e6)
            self.replays += 1
        recheck: dict[str, list[dict]] = {name: [] for name in self.fns}
        for name in self.fns:
            for k, (s, buffer, graph) in enumerate(zip(self.sets, self.buffers[name], self.graphs[name])):
                copy_into(buffer, s)  # as drawn: the gate holds the reference's outputs for these
                _replay(graph)
                _synchronize()
                got = self._outputs(self.outs[name][k])
                got["states"] = [(n, plain_copy(n, t, "cuda", got["problems"]))
                                 for n, t in state_leaves(buffer, self.state, self.names)]
                recheck[name].append(got)
        kernels = {name: count_kernels(lambda fn=fn, args=self.buffers[name][0]: fn(*args))
                   for name, fn in self.fns.items()}
        return {"host_us": host_us, "recheck": recheck, "kernels": kernels}


CLOCK_SPIN_CYCLES, CLOCK_SPINS = 2_000_000, 3  # ~1 ms each at an H200's 1980 MHz


def sm_clock_mhz() -> float:
    """The SM clock the GPU runs at now, in MHz: a spin of CLOCK_SPIN_CYCLES SM cycles (torch.cuda._sleep, bound
    before any candidate import) timed with CUDA events; the fastest of CLOCK_SPINS (the first may meet a clock
    still ramping up from idle)."""
    best = 0.0
    for _ in range(CLOCK_SPINS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _record(start)
        _sleep(CLOCK_SPIN_CYCLES)
        _record(end)
        _synchronize()
        best = max(best, CLOCK_SPIN_CYCLES / (_elapsed_time(start, end) * 1e3))
    return best


_bench: BenchSession | None = None


def bench_start(**session) -> dict:
    """Capture the graphs of a new benchmark session (replacing any earlier one)."""
    global _bench
    _bench = None
    _bench = BenchSession(**session)
    return {"pipeline": _bench.pipeline, "l2_set_aside": _bench.l2_set_aside, "sm_clock_mhz": sm_clock_mhz()}


def bench_block(*, pairs: int, check_set: int = 0) -> dict:
    if _bench is None:
        raise RuntimeError("bench_block before bench_start")
    return _bench.block(pairs, check_set)


def bench_finish(*, host_iters: int) -> dict:
    global _bench
    if _bench is None:
        raise RuntimeError("bench_finish before bench_start")
    try:
        return _bench.finish(host_iters)
    finally:
        _bench = None


def probe(*, entries: list[str]) -> dict:
    """Import each `module:function`; the error for each that does not import, is not callable, or replaces a
    guarded function on import (put back, so the next entry is judged on its own)."""
    errors = {}
    for entry in entries:
        before = set(tampered())
        try:
            import_entry_point(entry)
        except Exception as e:
            errors[entry] = f"{type(e).__name__}: {e}"
        if patched := [name for name in tampered() if name not in before]:
            errors[entry] = f"importing it replaced {', '.join(patched)}"
            for name in patched:
                if name in GUARDED:
                    owner, attr = GUARDED[name]
                    setattr(owner, attr, _ORIGINAL[name])
    return {"errors": errors}


def _kernels(report) -> list[dict]:
    """A kernels.cute.CompileReport's per-kernel resources as plain numbers."""
    return [{"kernel": k.name, "registers": int(k.registers), "spill_bytes": int(k.spill_bytes),
             "stack_frame_bytes": int(k.stack_frame_bytes), "shared_bytes": int(k.smem_bytes)}
            for k in report.kernels]


def run_compile(*, entry: str, contract: dict, archs: list[str], shard: tuple[int, int] = (0, 1)) -> dict:
    """Compile every key the entry point's module lists (or, for `shard` (i, n), keys i, i + n, ...) for every
    target: per-kernel resources or the error, per key and arch. The module is the one that defines the function
    the contract names (its __module__), not the one it is imported through: the gate compiles the code under
    test, not a protocol a re-exporting module happens to offer."""
    from kernels.arch import cute_arch_for
    from kernels.contract import Contract

    module = load(entry).__module__
    mod = sys.modules[module]
    missing = [f for f in ("compile_keys", "compile") if not callable(getattr(mod, f, None))]
    if missing:
        return {"protocol": f"{module} defines no {' or '.join(missing)}()"}
    results = []
    index, shards = shard
    for key in mod.compile_keys(Contract.model_validate(contract))[index::shards]:
        for arch in archs:
            entry: dict[str, Any] = {"key": repr(key), "arch": arch, "target": cute_arch_for(arch)}
            t0 = _perf_counter()
            try:
                report = mod.compile(key, entry["target"])
                entry["kernels"] = _kernels(report)
                if not entry["kernels"]:
                    entry["error"] = "no kernel resources reported: " + ("; ".join(report.notes) or "empty report")
            except Exception as e:
                entry["error"] = "".join(traceback.format_exception_only(e)).strip()
            entry["seconds"] = _perf_counter() - t0
            results.append(entry)
    return {"compiles": results}


HANDLERS = {"cases": run_cases, "trajectory": run_trajectory, "calls": run_calls, "concurrent": run_concurrent,
            "late_inputs": run_late_inputs,
            "bench_start": bench_start, "bench_block": bench_block, "bench_finish": bench_finish, "probe": probe,
            "compile": run_compile}


def handler(kind: str) -> Callable[..., dict]:
    """The function serving a request kind; the evals' candidate handlers load only when an eval asks."""
    if kind.startswith("eval_"):
        from gates.evals import remote

        _watch(remote)  # loaded before the first eval request imports the candidate through it
        return remote.CHILD_HANDLERS[kind]
    return HANDLERS[kind]


# Repository files a candidate may open that its evidence does not cover: the judge's own (the harness digest versions
# them), every op's contract (the op's own is covered by name; the dispatcher reads the others) and the evidence.
NOT_COVERED = ("gates/", "contracts/", "evidence/")


def _record_opens() -> Callable[[], set[str]]:
    """Start recording every path this process opens (Python's `open` audit event: open(), io.open_code, os.open,
    so numpy and torch loads too); an audit hook cannot be removed, so candidate code cannot stop the recording.
    Reads from C code that bypass Python (fopen in an extension) are not seen. Returns the function that gives the
    repository files opened so far that are not bytecode: a table, a .cu or .ptx source, a tuned config the
    candidate reads at run time changes what it computes, so its evidence covers them as it covers modules. Each
    path is resolved once, when the first reply after its opening asks (the hook itself stays a set insert)."""
    opened: set[str] = set()
    files: set[str] = set()

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], str):  # an int is an already-open descriptor
            opened.add(args[0] if os.path.isabs(args[0]) else os.path.join(os.getcwd(), args[0]))

    def repository_files() -> set[str]:
        while opened:
            path = opened.pop()
            if "__pycache__" in path:
                continue
            try:
                if rel := repository_path(path):
                    files.add(rel)
            except (OSError, ValueError):  # a name that cannot be resolved is no repository file
                continue
        return files

    sys.addaudithook(hook)
    return repository_files


# A message from the gate (gates.core.sandbox): a tag byte, then the path of a request file, a request's bytes, or
# nothing (the end)
REQUEST_FILE, REQUEST_BYTES, REQUEST_END = b"F", b"B", b"E"


def read_request(message: bytes) -> dict | None:
    """The gate's request (trusted: the gate wrote it), or None at the end. A file is mapped, not read: copy-on-write
    pages, so the child's writes stay its own."""
    tag, body = message[:1], message[1:]
    if tag == REQUEST_FILE:
        return torch.load(body.decode(), mmap=True, weights_only=False)
    if tag == REQUEST_BYTES:
        return torch.load(io.BytesIO(body), weights_only=False)
    return None


def serve(conn, env: dict[str, str], stack_file: str) -> None:
    """The child's loop: one request in, one reply out, until the gate closes the pipe. On SIGUSR1 it writes
    every thread's stack to `stack_file` (the gate asks when a reply is overdue)."""
    os.environ.update(env)  # e.g. CUTE_DSL_ARCH, which must be set before cutlass is imported
    # what the isolation launcher did before this process began (gates.core.isolation), read before any candidate
    # code can change the environment
    confined = os.environ.pop(isolation.OUTCOME_VAR, "not confined: started without the isolation launcher")
    os.setsid()  # a session of its own: whatever candidate code leaves behind is told from the gate's own children
    # (gates.core.strays)
    undumpable()  # before any candidate import: another candidate's process cannot read or write this one's memory
    stacks = open(stack_file, "w")  # noqa: SIM115 - open for the process's life: faulthandler writes on a signal
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)  # see gates.core.machine.one_thread
    # Candidate code imported from here on compiles nothing into the tree's __pycache__ (the sandbox reports a
    # changed bytecode file as a write). The checks are bound here, before any import: a candidate that rebinds
    # this module's globals does not change what this loop calls.
    sys.dont_write_bytecode = True
    changed, get_handler, save = _changed, handler, _ORIGINAL["torch.save"]
    baseline = set(sys.modules)  # what the worker itself runs on; anything more, candidate code (or a trusted
    # entry) brought in, by an import statement or importlib: the repository files among it are what ran
    repository_files = _record_opens()
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        request = read_request(data)
        if request is None:
            return
        kind = request.pop("kind")
        try:
            reply = get_handler(kind)(**request)
        except Tampered as e:
            reply = {"tampered": e.replaced}
        except Exception:
            reply = {"error": traceback.format_exc(limit=-4)}
        reply["tampered"] = list(dict.fromkeys([*reply.get("tampered", []), *changed()]))
        reply["confined"] = confined
        modules = {repository_path(getattr(sys.modules.get(name), "__file__", None))
                   for name in set(sys.modules) - baseline}
        reply["loaded"] = sorted(path for path in modules | repository_files() if path and not path.startswith(
            NOT_COVERED))  # the gate's own files (e.g. the problems' Case, unpickled with a request) are versioned
        # by the harness digest
        buf = io.BytesIO()
        save(reply, buf)
        conn.send_bytes(buf.getvalue())


for _module in OWN_MODULES:  # last, so that every function and table above is in the fingerprint
    _watch(importlib.import_module(_module))
