"""The machine the gates run on: its arch (names the bundle), its device, and the software versions.

Peak figures are the declared ceilings the roofline uses (H200: copy bandwidth 4.3 TB/s and ~790 TFLOP/s
bf16, measured on the project's H200); an arch without figures gets no roofline, not a guessed one.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata

from pydantic import BaseModel, ConfigDict

PEAKS = {  # arch: (memory bandwidth B/s, dense bf16 FLOP/s)
    "sm_90": (4.3e12, 790e12),
}


@dataclass(frozen=True)
class Machine:
    arch: str  # "sm_90", or "cpu" where there is no GPU
    device: str  # torch device type the candidate runs on: "cuda" or "cpu"
    name: str

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"


def detect() -> Machine:
    import torch

    if not torch.cuda.is_available():
        return Machine(arch="cpu", device="cpu", name=_cpu_name())
    major, minor = torch.cuda.get_device_capability()
    return Machine(arch=f"sm_{major}{minor}", device="cuda", name=torch.cuda.get_device_name())


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def target_arch(arch: str) -> str:
    """The arch-specific target a CuTe DSL kernel compiles for: sm_90 -> sm_90a (wgmma, TMA), sm_100 -> sm_100a."""
    return arch if arch[-1].isalpha() else f"{arch}a"


def base_arch(arch: str) -> str:
    """sm_90a -> sm_90: the arch a machine reports."""
    return arch.rstrip("abcdefghijklmnopqrstuvwxyz")


class Environment(BaseModel):
    """What a reviewer needs to reproduce the numbers."""

    model_config = ConfigDict(extra="forbid")

    arch: str
    device: str
    device_name: str
    gpu_count: int
    driver: str | None
    cuda: str | None
    python: str
    platform: str
    torch: str
    triton: str | None
    cutlass_dsl: str | None
    fla: str | None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def environment(machine: Machine) -> Environment:
    import torch

    return Environment(
        arch=machine.arch, device=machine.device, device_name=machine.name,
        gpu_count=torch.cuda.device_count() if machine.is_gpu else 0,
        driver=_driver() if machine.is_gpu else None, cuda=torch.version.cuda,
        python=sys.version.split()[0], platform=platform.platform(), torch=torch.__version__,
        triton=_version("triton"), cutlass_dsl=_version("nvidia-cutlass-dsl"), fla=_version("fla-core"),
    )


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
