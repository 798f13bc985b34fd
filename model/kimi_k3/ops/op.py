"""What an op declares about itself: its name, its reference, the named shapes and operand dtypes a contract may
constrain, the function that reads them from a call, and its standard.

Every op module `model/kimi_k3/ops/<op>.py` ends with one `OP = Op(...)` whose `name` is the module's name; the
registry (`ops/registry.py`) finds them by discovery, so adding an op touches no shared file.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from functools import cache
from typing import Callable

import torch

from kernels.contract import Tolerance

log = logging.getLogger(__name__)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8_e4m3"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The contract's name for a dtype ('bf16', 'fp32', ...); strings (e.g. 'mxfp4') pass through."""
    return dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def entry_point(fn: Callable) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def import_entry_point(spec: str) -> Callable:
    """`package.module:function` -> the function (import errors propagate)."""
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class Signature:
    """An op call as a contract sees it: named rank-local dims and the dtypes of named operands."""

    shapes: dict[str, int]
    dtypes: dict[str, str]  # keys of the contract's `dtypes` (activations come from the model, not the call)


@dataclass(frozen=True)
class Cost:
    """What one call must move and compute at the least: every input read once, every output written once
    (kernels.roofline turns it into a floor)."""

    bytes: float
    flops: float


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# bf16 operands with fp32 accumulation against an fp32 reference (gates/PRACTICES.md: bf16 lands between 1e-3
# and 1e-2 in relative L2); ops whose output is fp32 end to end declare tighter bounds.
BF16_TOLERANCE = Tolerance(atol=2e-2, rtol=1.6e-2, max_rel_l2=1e-2, min_close_fraction=0.999)


@dataclass(frozen=True)
class Op:
    """One decode-path op.

    `signature(*args)` reads (dims, dtypes) from a call's own arguments, in the order of `shapes` and `dtypes`;
    `cost_of(*args)` is the op's one cost model (the problem, the benchmarks and the layer bench all use it).
    `gpu_standard` names the library composition a stock engine runs on a GPU (`module:function`, imported on
    first GPU use); without one, or where it does not import, the reference serves as standard and
    `standard_label` says so. `standard_tolerance` bounds the standard against the reference (checked by the
    layer bench at every point it times)."""

    name: str
    reference: Callable
    shapes: tuple[str, ...]
    dtypes: tuple[str, ...]
    signature_of: Callable[..., tuple[tuple[int, ...], tuple[torch.dtype | str, ...]]]
    cost_of: Callable[..., Cost]
    gpu_standard: str | None = None
    standard_label: str = "the reference (plain PyTorch)"
    standard_tolerance: Tolerance = BF16_TOLERANCE

    @property
    def standard_entry_point(self) -> str:
        return self.gpu_standard or entry_point(self.reference)

    def standard(self, gpu: bool) -> Callable:
        """The standard implementation on a GPU or on CPU (the reference where no GPU standard imports)."""
        if gpu and self.gpu_standard:
            return _gpu_standard(self.name, self.gpu_standard) or self.reference
        return self.reference

    def signature(self, *args, **kwargs) -> Signature:
        dims, dtypes = self.signature_of(*args, **kwargs)
        return Signature(dict(zip(self.shapes, dims, strict=True)),
                         {k: dtype_name(d) for k, d in zip(self.dtypes, dtypes, strict=True)})


@cache
def _gpu_standard(op: str, spec: str) -> Callable | None:
    """Imported once; a missing library is logged (the reference then serves) rather than crashing decode."""
    try:
        return import_entry_point(spec)
    except Exception as e:  # noqa: BLE001 - any import-time failure of an optional GPU library
        log.warning("%s: GPU standard %s does not import (%s: %s); the reference serves as standard",
                    op, spec, type(e).__name__, e)
        return None
