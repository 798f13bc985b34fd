"""Roofline floors: the least time an op can take, from the bytes it must move and the FLOPs it must do.

Nothing here is specific to an op: each op computes its own byte and FLOP counts from its shapes
(every input read once, every output written once) and passes them in.

    >>> from kernels.roofline import floor
    >>> f = floor(bytes_moved=106.9e6, flops=0, arch="sm_90")
    >>> round(f.floor_us, 1), f.bound
    (24.9, 'memory')
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ArchInfo, known


@dataclass(frozen=True)
class Floor:
    """bytes / bandwidth and flops / rate, in microseconds; floor_us is the larger of the two."""

    bytes_moved: float
    flops: float
    mem_bw_Bps: float
    flops_per_s: float
    memory_us: float
    compute_us: float

    @property
    def floor_us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        """'memory' or 'compute': which term sets the floor."""
        return "memory" if self.memory_us >= self.compute_us else "compute"

    def fraction(self, measured_us: float) -> float:
        """floor / measured: 1.0 means at the floor; > 1.0 is below the floor (suspicious)."""
        return self.floor_us / measured_us if measured_us > 0 else float("inf")

    def as_dict(self) -> dict:
        return dict(bytes_moved=self.bytes_moved, flops=self.flops, mem_bw_Bps=self.mem_bw_Bps,
                    flops_per_s=self.flops_per_s, memory_us=self.memory_us, compute_us=self.compute_us,
                    floor_us=self.floor_us, bound=self.bound)


def floor(bytes_moved: float, flops: float = 0.0, arch: str | ArchInfo = "sm_90", *,
          mem_bw_Bps: float | None = None, flops_per_s: float | None = None) -> Floor:
    """Floor for an op moving `bytes_moved` bytes and doing `flops` FLOPs on `arch`.

    arch is an ArchInfo (e.g. from kernels.arch.detect()) or an arch name; mem_bw_Bps / flops_per_s
    override its figures (flops_per_s defaults to the bf16 dense matrix rate: pass the rate of the unit
    that actually does the work, e.g. fp32 CUDA cores, when it is not a bf16 matrix op).
    """
    info = arch if isinstance(arch, ArchInfo) else known(arch)
    bw = mem_bw_Bps if mem_bw_Bps is not None else info.mem_bw_Bps
    rate = flops_per_s if flops_per_s is not None else info.bf16_flops
    if bw <= 0:
        raise ValueError(f"no memory bandwidth for arch {info.arch!r}: pass mem_bw_Bps")
    if flops > 0 and rate <= 0:
        raise ValueError(f"no FLOP rate for arch {info.arch!r}: pass flops_per_s")
    memory_us = bytes_moved / bw * 1e6
    compute_us = flops / rate * 1e6 if flops > 0 else 0.0
    return Floor(bytes_moved=float(bytes_moved), flops=float(flops), mem_bw_Bps=bw, flops_per_s=rate,
                 memory_us=memory_us, compute_us=compute_us)


def floor_us(bytes_moved: float, flops: float = 0.0, arch: str | ArchInfo = "sm_90", **kw) -> float:
    """Shorthand: floor(...).floor_us."""
    return floor(bytes_moved, flops, arch, **kw).floor_us


def fraction_of_floor(measured_us: float, bytes_moved: float, flops: float = 0.0,
                      arch: str | ArchInfo = "sm_90", **kw) -> float:
    """floor_us / measured_us for an op; > 1 means the measurement beat the floor (flag it)."""
    return floor(bytes_moved, flops, arch, **kw).fraction(measured_us)


def achieved_bandwidth_Bps(bytes_moved: float, measured_us: float) -> float:
    return bytes_moved / (measured_us * 1e-6)
