"""Run a function on every rank of a tensor-parallel group: N processes on one machine, one rank each.

CPU ranks talk through gloo; GPU ranks through NCCL, rank r on cuda:r, with NVLink multicast off in NCCL, PyTorch's
symmetric memory and NVSHMEM (on the shared multi-GPU machines a program using it can take the host's GPUs out of
service; /work/.library/device/KINDS.md).
`run_tp(fn, n, *args)` calls `fn(tp, device, *args)` on every rank and returns rank 0's result; a rank's
exception is re-raised in the caller, and a run that outlives its timeout is killed, so a broken
collective cannot hang the caller. World size 1 runs `fn` in the calling process with no process group.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .parallel import TP

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def tp_backend(device: str | torch.device, size: int) -> str:
    """The process-group backend of `size` ranks on `device`: gloo on cpu, NCCL on cuda (rank r on cuda:r). A
    one-line ValueError for another device, a GPU index beside size > 1, or fewer visible GPUs than ranks."""
    device = torch.device(device)
    if device.type not in BACKENDS:
        raise ValueError(f"TP on {device}: tensor parallelism runs on cpu (gloo) or cuda (NCCL)")
    if device.type == "cuda" and size > 1:
        if device.index is not None:
            raise ValueError(f"TP{size} on {device}: rank r runs on cuda:r; name the device cuda, without an index")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < size:
            raise ValueError(f"TP{size} on cuda needs {size} GPUs (one per rank); {visible} visible")
    return BACKENDS[device.type]


def free_port() -> int:
    """A localhost TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(fn: Callable[..., Any], size: int, *args: Any, device: str = "cpu", timeout: float = 600.0) -> Any:
    """fn(tp, device, *args) on `size` ranks; rank 0's return value (plain Python or CPU tensors).

    `device` is "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r); `fn` must be importable by name
    (a module-level function), as each rank is a fresh process that receives it pickled.
    """
    backend = tp_backend(device, size)
    if size == 1:
        return fn(TP(), torch.device(device), *args)
    # Ranks fork from one fresh server process that has imported torch and the model once: a clean
    # process (no threads, no CUDA context) as with spawn, without N interpreter starts. (fn's own module
    # is not preloaded: a child re-runs the caller's __main__, which must not be imported before that.)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, f"{__package__}.loader", f"{__package__}.engine"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, size, port, backend, timeout, fn, args, results), daemon=True)
             for rank in range(size)]
    for p in procs:
        p.start()
    finished = False
    try:
        result = _collect(procs, results, timeout)
        finished = True
        return result
    finally:
        for p in procs:  # after an error or a timeout the others may wait in a collective forever
            p.join(timeout=10 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs: list, results, timeout: float) -> Any:
    """Wait for every rank's report; rank 0's result, or raise the first rank's error."""
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    while len(done) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"TP rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without a report")
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP{len(procs)} run exceeded {timeout:.0f} s; "
                                   f"ranks {sorted(set(range(len(procs))) - set(done))} still running")
            continue
        if not ok:
            error, remote_tb = pickle.loads(payload)
            error.add_note(f"raised on TP rank {rank}:\n{remote_tb}")
            raise error
        done[rank] = payload
    return pickle.loads(done[0])


def _rank_main(rank: int, size: int, port: int, backend: str, timeout: float, fn, args, results) -> None:
    # Results travel pickled by value: torch's shared-memory tensor passing needs the sender alive.
    try:
        if backend == "nccl":
            os.environ.update(MULTICAST_OFF)
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
            device = torch.device("cpu")
        # With a device id NCCL creates its communicator here, before any CUDA graph could capture a collective.
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout), device_id=device if backend == "nccl" else None)
        try:
            out = fn(TP(rank, size, dist.group.WORLD), device, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(out if rank == 0 else None)))
    except BaseException as e:  # report everything (KeyboardInterrupt too) rather than die silently
        results.put((rank, False, _pickled_error(e)))


def _pickled_error(e: BaseException) -> bytes:
    tb = traceback.format_exc()
    try:
        return pickle.dumps((e, tb))
    except Exception:  # an exception type that does not pickle travels as its text
        return pickle.dumps((RuntimeError(f"{type(e).__name__}: {e}"), tb))
