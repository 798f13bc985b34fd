"""Device and architecture detection.

`detect()` describes the machine this process runs on (a GPU through torch, or "cpu"); `known(arch)`
describes a target by name without touching any device, for compile-only work on CPU machines.
Bandwidth and FLOP rates come from a small table of declared values (measured on this project's H200,
vendor figures elsewhere) unless `measure_copy_bandwidth()` is asked for.

    >>> from kernels.arch import detect, known
    >>> detect().arch                 # 'sm_90' on an H200, 'cpu' without a GPU
    >>> known("sm_90").mem_bw_Bps     # 4.3e12, measured here
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Declared ceilings per arch. H200: copy bandwidth and bf16 dense matrix rate measured on the lent
# H200 (4.3 TB/s counting read + write bytes, ~790 TFLOP/s on random data). GB300: vendor leads, not
# measured here.
_DECLARED = {
    "sm_90": dict(device_name="NVIDIA H200", sm_count=132, l2_bytes=60 * 1024 * 1024,
                  mem_bw_Bps=4.3e12, bf16_flops=790e12, smem_per_sm_bytes=228 * 1024,
                  source="measured on the project's H200 (copy 4.3 TB/s, bf16 GEMM ~790 TFLOP/s)"),
    "sm_100": dict(device_name="NVIDIA GB300", sm_count=160, l2_bytes=126 * 1024 * 1024,
                   mem_bw_Bps=8.0e12, bf16_flops=2250e12, smem_per_sm_bytes=228 * 1024,
                   source="declared from vendor figures; not measured here"),
    "cpu": dict(device_name="cpu", sm_count=0, l2_bytes=0, mem_bw_Bps=0.0, bf16_flops=0.0,
                smem_per_sm_bytes=0, source="no GPU"),
}

# Arch families that need the 'a' suffix for their arch-specific instructions (wgmma, tcgen05, ...).
_ARCH_SPECIFIC = {"sm_90": "sm_90a", "sm_100": "sm_100a", "sm_103": "sm_103a"}


@dataclass(frozen=True)
class ArchInfo:
    """What a kernel or a roofline needs to know about a device.

    arch: 'sm_90', 'sm_100', ... or 'cpu'. cute_arch: the target CuTe DSL compiles for ('sm_90a').
    mem_bw_Bps: copy bandwidth in bytes/s, read + write bytes counted. bf16_flops: dense bf16 rate.
    measured: True when mem_bw_Bps was measured in this process, False when declared.
    """

    arch: str
    cute_arch: str
    device_name: str
    sm_count: int
    l2_bytes: int
    mem_bw_Bps: float
    bf16_flops: float
    smem_per_sm_bytes: int
    measured: bool = False
    source: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.arch != "cpu"

    @property
    def capability(self) -> tuple[int, int] | None:
        """(major, minor) from the arch string, e.g. (9, 0); None on CPU."""
        if not self.is_gpu:
            return None
        digits = self.arch.removeprefix("sm_")
        return int(digits[:-1]), int(digits[-1])


def arch_from_capability(major: int, minor: int) -> str:
    """(9, 0) -> 'sm_90'; (10, 0) -> 'sm_100'."""
    return f"sm_{major}{minor}"


def cute_arch_for(arch: str) -> str:
    """The CuTe DSL target for an arch: 'sm_90' -> 'sm_90a' (arch-specific features), 'cpu' -> ''."""
    if arch == "cpu":
        return ""
    base = arch.rstrip("af")
    return _ARCH_SPECIFIC.get(base, arch)


def known(arch: str) -> ArchInfo:
    """Declared description of a target arch ('sm_90', 'sm_90a', 'sm_100', 'cpu'); no device access."""
    base = arch if arch == "cpu" else arch.rstrip("af")
    if base not in _DECLARED:
        raise KeyError(f"no declared figures for arch {arch!r}; known: {sorted(_DECLARED)}")
    return ArchInfo(arch=base, cute_arch=cute_arch_for(base), measured=False, **_DECLARED[base])


def detect(device: int | str | None = None) -> ArchInfo:
    """Describe the current device (torch's current CUDA device, or the one given), or the CPU.

    Name, SM count and L2 size are read from the device; bandwidth and FLOP rates are the declared
    figures for its arch (use `measure_copy_bandwidth` to measure). Never raises on a CPU machine.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a project dependency
        return known("cpu")
    if not torch.cuda.is_available():
        return known("cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    arch = arch_from_capability(props.major, props.minor)
    base = _DECLARED.get(arch, dict(mem_bw_Bps=0.0, bf16_flops=0.0, smem_per_sm_bytes=0,
                                    source="arch not in the declared table"))
    l2 = int(getattr(props, "L2_cache_size", 0) or base.get("l2_bytes", 0))
    smem = int(getattr(props, "shared_memory_per_multiprocessor", 0) or base.get("smem_per_sm_bytes", 0))
    return ArchInfo(arch=arch, cute_arch=cute_arch_for(arch), device_name=props.name,
                    sm_count=props.multi_processor_count, l2_bytes=l2, mem_bw_Bps=base["mem_bw_Bps"],
                    bf16_flops=base["bf16_flops"], smem_per_sm_bytes=smem, measured=False,
                    source=base["source"])


def measure_copy_bandwidth(device: int | str | None = None, nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    times.sort()
    return 2 * n / times[len(times) // 2]


def with_measured_bandwidth(info: ArchInfo, device: int | str | None = None) -> ArchInfo:
    """`info` with mem_bw_Bps replaced by a fresh measurement (GPU only)."""
    if not info.is_gpu:
        return info
    return replace(info, mem_bw_Bps=measure_copy_bandwidth(device), measured=True,
                   source="copy bandwidth measured in this process")
