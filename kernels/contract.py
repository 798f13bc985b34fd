"""The contract schema: what a specialized kernel claims to support, and what runs instead outside it.

One YAML file per specialized op under `contracts/`. Errors read `file: field: problem`, one per line.
The envelope checks here are structural; `k3forge contract check` adds what needs the rest of the
repository: the op exists in the registry, the entry points import, each validated arch has evidence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kernels.validation import validate

SCHEMA_VERSION = 1
DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "mxfp4")


class ContractError(ValueError):
    """A malformed or inconsistent contract; str() is `file: field: problem` lines."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Range(_Strict):
    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "Range":
        if self.min > self.max:
            raise ValueError(f"empty range: min {self.min} > max {self.max}")
        return self

    def __contains__(self, value: int) -> bool:
        return self.min <= value <= self.max


class Hardware(_Strict):
    arch: str = Field(pattern=r"^(sm_\d+[a-z]?|cpu)$", description="compute capability, e.g. sm_90; cpu for CPU")
    devices: list[str] = Field(min_length=1, description="device names as torch reports them")


def evidence_dir(op: str, arch: str) -> str:
    """Where the gate runner writes an op's evidence bundle for an arch, relative to the repository root."""
    return f"evidence/{op}/{arch}"


class ValidatedHardware(Hardware):
    evidence: str | None = Field(default=None,
                                 description=f"bundle directory; must be {evidence_dir('<op>', '<arch>')}")


class HardwareSupport(_Strict):
    validated: list[ValidatedHardware] = Field(default_factory=list, description="evidence exists")
    declared: list[Hardware] = Field(default_factory=list, description="targets not yet validated here")

    @model_validator(mode="after")
    def _disjoint(self) -> "HardwareSupport":
        archs = [h.arch for h in (*self.validated, *self.declared)]
        both = {h.arch for h in self.validated} & {h.arch for h in self.declared}
        if both:
            raise ValueError(f"arch {sorted(both)} listed as both validated and declared")
        if len(set(archs)) != len(archs):
            raise ValueError(f"an arch is listed twice in {archs}; list its devices in one entry")
        return self


class Dtypes(_Strict):
    activations: Literal[DTYPES]  # type: ignore[valid-type]
    weights: Literal[DTYPES]  # type: ignore[valid-type]
    kv_cache: Literal[DTYPES] | None = None  # type: ignore[valid-type]
    ssm_state: Literal[DTYPES] | None = None  # type: ignore[valid-type]


class Tolerance(_Strict):
    atol: float = Field(gt=0)
    rtol: float = Field(ge=0)
    min_close_fraction: float = Field(default=0.99999, gt=0, le=1, description="elements within atol + rtol*|ref|")
    max_rel_l2: float = Field(gt=0, description="||out - ref|| / ||ref|| bound")
    max_units: float = Field(default=3.0, gt=0, description="largest error of any element, in tolerance units")


class BenchPoint(_Strict):
    batch: int = Field(ge=1)
    spec_tokens: int = Field(default=0, ge=0)
    shape: dict[str, int] = Field(default_factory=dict, description="values for the contract's shape keys")
    required_speedup: float | None = Field(default=None, gt=0, description="this point's own bound (else the default)")
    min_roofline_fraction: float | None = Field(default=None, gt=0, le=1)


class Benchmark(_Strict):
    points: list[BenchPoint] = Field(min_length=1)
    required_speedup: float = Field(gt=0,
                                    description="over the standard implementation, at every point without its own")
    min_roofline_fraction: float | None = Field(default=None, gt=0, le=1,
                                                description="likewise, the fraction of the floor")

    def requirement(self, point: BenchPoint) -> tuple[float, float | None]:
        """(required speedup, required fraction of the roofline or None) at one point."""
        return (point.required_speedup or self.required_speedup,
                point.min_roofline_fraction or self.min_roofline_fraction)


class Resources(_Strict):
    max_registers: int | None = Field(default=None, gt=0)
    max_spill_bytes: int | None = Field(default=None, ge=0)
    max_shared_bytes: int | None = Field(default=None, ge=0)


class Contract(_Strict):
    schema_version: Literal[1]
    op: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str = Field(min_length=1)
    implementation: str = Field(pattern=r"^[\w.]+:\w+$", description="module:function of the specialized kernel")
    reference: str = Field(pattern=r"^[\w.]+:\w+$")
    standard: str = Field(pattern=r"^[\w.]+:\w+$")
    backend: Literal["cutedsl", "triton", "torch"]
    replaces: list[str] = Field(min_length=1, description="standard ops this kernel replaces or fuses")
    hardware: HardwareSupport
    tp_sizes: list[int] = Field(min_length=1)
    batch: Range
    spec_tokens: Range = Field(description="draft tokens per sequence; 0 = plain decode")
    dtypes: Dtypes
    shapes: dict[str, list[int]] = Field(default_factory=dict, description="rank-local shape constraints")
    fallback: Literal["standard"]
    tolerance: Tolerance
    state_tolerance: Tolerance | None = Field(
        default=None, description="for the state an op updates in place, where it differs from `tolerance`")
    benchmark: Benchmark
    resources: Resources = Resources()
    owners: list[str] = Field(min_length=1)

    @property
    def tolerance_for_states(self) -> Tolerance:
        return self.state_tolerance or self.tolerance

    @field_validator("tp_sizes")
    @classmethod
    def _tp_positive(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v):
            raise ValueError("TP sizes must be >= 1")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate TP sizes in {v}")
        return v

    @field_validator("shapes")
    @classmethod
    def _shapes_sane(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for key, values in v.items():
            if not values or any(x < 1 for x in values):
                raise ValueError(f"{key}: needs at least one value, each >= 1 (got {values})")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Contract":
        if self.batch.min < 1:
            raise ValueError("batch: min must be >= 1")
        if not (self.hardware.validated or self.hardware.declared):
            raise ValueError("hardware: no validated or declared target")
        for i, hw in enumerate(self.hardware.validated):
            if hw.evidence is not None and hw.evidence.rstrip("/") != evidence_dir(self.op, hw.arch):
                raise ValueError(f"hardware.validated.{i}.evidence: {hw.evidence!r} is not where the gate "
                                 f"runner writes it ({evidence_dir(self.op, hw.arch)})")
        for i, point in enumerate(self.benchmark.points):
            if point.batch not in self.batch or point.spec_tokens not in self.spec_tokens:
                raise ValueError(f"benchmark.points.{i}: batch/spec_tokens outside the envelope")
            for key, value in point.shape.items():
                if key not in self.shapes or value not in self.shapes[key]:
                    raise ValueError(f"benchmark.points.{i}.shape.{key}: {value} outside shapes.{key}")
        return self

    @property
    def archs_validated(self) -> list[str]:
        return [h.arch for h in self.hardware.validated]

    def evidence_dirs(self) -> dict[str, str]:
        """{validated arch: its evidence bundle directory relative to the repository root}."""
        return {h.arch: evidence_dir(self.op, h.arch) for h in self.hardware.validated}


def parse_contract(data: object, source: str) -> Contract:
    return validate(Contract, data, source, ContractError)


def contract_files(directory: str | Path) -> list[Path]:
    """The contract files of a contracts directory (`<op>.yaml`), in name order."""
    return sorted(Path(directory).glob("*.yaml"))


def load_contract(path: str | Path) -> Contract:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ContractError(f"{path}: <file>: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ContractError(f"{path}: <file>: not valid YAML ({e})") from None
    contract = parse_contract(data, str(path))
    if contract.op != path.stem:
        raise ContractError(f"{path}: op: {contract.op!r} does not match the file name {path.stem!r}")
    return contract
