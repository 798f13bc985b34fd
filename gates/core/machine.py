"""The machine the gates run on (kernels.arch describes it): the software versions a bundle records, the thread
setting the gates use for their CPU tensor work, the process setting that keeps one of its processes out of
another's reach, and the folders a process keeps for its lifetime."""

from __future__ import annotations

import atexit
import ctypes
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from kernels.arch import ArchInfo


def device_type(machine: ArchInfo) -> str:
    """The torch device type a candidate runs on here."""
    return "cuda" if machine.is_gpu else "cpu"


class Environment(BaseModel):
    """What a reviewer needs to reproduce the numbers."""

    model_config = ConfigDict(extra="forbid")

    arch: str
    device_name: str
    gpu_count: int
    driver: str | None
    cuda: str | None
    python: str
    platform: str
    cpu: str
    torch: str
    triton: str | None
    cutlass_dsl: str | None
    fla: str | None
    # how the gate walls in candidate code here (gates.core.isolation.available); None where no gate ran
    candidate_isolation: str | None = None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi(fields: str) -> list[list[str]] | None:
    """nvidia-smi's answer to `--query-gpu=FIELDS`, one row of fields per GPU (units left out), or None where it
    cannot be asked."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]


def _driver() -> str | None:
    rows = _nvidia_smi("driver_version")
    return rows[0][0] if rows else None


def max_sm_clock_mhz() -> float | None:
    """The current CUDA device's maximum SM clock in MHz (nvidia-smi's clocks.max.sm, matched to the device by its
    PCI address, domain:bus:device.function in hex), or None where it cannot be read."""
    import torch

    if not torch.cuda.is_available() or not (rows := _nvidia_smi("pci.bus_id,clocks.max.sm")):
        return None
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        address = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
        for bus_id, mhz in rows:
            domain, bus, device_function = bus_id.split(":")
            if (int(domain, 16), int(bus, 16), int(device_function.split(".")[0], 16)) == address:
                return float(mhz)
    except (ValueError, AttributeError):
        return None
    return None


def gpu_memory_bytes() -> int | None:
    """The current CUDA device's total memory in bytes, or None where there is none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def release_cached_memory() -> None:
    """Give the caching allocator's free blocks back to the GPU: the gate's process keeps what its gates freed, out
    of reach of the sandboxes the next gate starts (each a process of its own)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(machine: ArchInfo) -> Environment:
    import torch

    return Environment(
        arch=machine.arch, device_name=_cpu_name() if not machine.is_gpu else machine.device_name,
        gpu_count=torch.cuda.device_count() if machine.is_gpu else 0,
        driver=_driver() if machine.is_gpu else None, cuda=torch.version.cuda,
        python=sys.version.split()[0], platform=platform.platform(), cpu=_cpu_name(), torch=torch.__version__,
        triton=_version("triton"), cutlass_dsl=_version("nvidia-cutlass-dsl"), fla=_version("fla-core"),
    )


_folders: dict[tuple[str, str | None], Path] = {}
_folders_lock = threading.Lock()


def folder_of_this_process(prefix: str, root: str | None = None) -> Path:
    """A folder of this process's own under `root` (the temporary folder by default), named `prefix`..., made on the
    first ask and removed when the process exits; every later ask gets the same one."""
    with _folders_lock:
        if (prefix, root) not in _folders:
            _folders[(prefix, root)] = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
            atexit.register(shutil.rmtree, _folders[(prefix, root)], ignore_errors=True)
        return _folders[(prefix, root)]


PR_SET_DUMPABLE = 4  # linux/prctl.h


def undumpable() -> bool:
    """This process made undumpable (Linux): another process of the same user can then neither read nor write its
    memory or the environment it was started with (/proc/<pid>/mem, /proc/<pid>/environ), nor attach a debugger to
    it; a process with CAP_SYS_PTRACE (root) still can. The gate's process holds the secret seed and, to sign, the
    evidence key; a candidate's process must not read its sibling's. Execve makes a new program dumpable again,
    so every process sets it for itself. False where the platform has no prctl."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextmanager
def one_thread():
    """Decode-sized CPU work gains nothing from intra-op threads, and on a loaded machine their spin-waits make
    it a hundred times slower: the gates run their CPU tensor work on one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
