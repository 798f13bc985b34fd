"""The decode-path ops every layer calls through the dispatcher, and their implementations.

- reference: plain PyTorch, the numerics ground truth.
- standard: what a strong stock serving engine runs. An op may name a library-composed GPU standard
  (`gpu_standard`, imported on first GPU use); on CPU, and for ops without one, the reference serves.
- specialized: a contracted kernel. It exists only through a contract (`contracts/<op>.yaml`) whose
  `implementation` names it; `load_specialized` reads a contracts directory and is the one way to get one.

The gate runner enumerates contracts and gets every implementation of each:

    for spec in load_specialized().values():
        reference, standard, specialized = spec.implementations(gpu=True)
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from kernels.contract import Contract, ContractError, contract_files, load_contract
from ..attn_res import attn_res
from ..mla import mla_decode
from ..moe import moe_experts, route
from .kda import kda_decode

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
CONTRACTS_DIR = REPO_ROOT / "contracts"

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
class Op:
    """One decode-path op. `probe(*args)` reads (dims, dtypes) from a call's own arguments, in the order of
    `shapes` and `dtypes`: the names a contract may constrain."""

    name: str
    reference: Callable
    shapes: tuple[str, ...]
    dtypes: tuple[str, ...]
    probe: Callable[..., tuple[tuple[int, ...], tuple[torch.dtype | str, ...]]]
    gpu_standard: str | None = None  # module:function composed from library kernels (FLA, cuBLAS, ...)

    @property
    def standard_entry_point(self) -> str:
        return self.gpu_standard or entry_point(self.reference)

    def standard(self, gpu: bool) -> Callable:
        """The standard implementation on a GPU or on CPU (the reference where no GPU standard imports)."""
        if gpu and self.gpu_standard:
            return _gpu_standard(self.name, self.gpu_standard) or self.reference
        return self.reference

    def signature(self, *args, **kwargs) -> Signature:
        dims, dtypes = self.probe(*args, **kwargs)
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


def _expert_weights(w13: tuple[torch.Tensor, ...]) -> torch.dtype | str:
    return "mxfp4" if len(w13) == 2 else w13[0].dtype


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("attn_res", attn_res, shapes=("sources", "hidden"), dtypes=("weights",),
           probe=lambda sources, norm_w, proj_w, eps: ((len(sources), sources[0].shape[-1]), (norm_w.dtype,))),
        Op("kda_decode", kda_decode, shapes=("heads", "head_dim"), dtypes=("weights", "ssm_state"),
           probe=lambda proj, conv, ssm, slots, w: ((ssm.shape[1], ssm.shape[3]), (w.f_b.dtype, ssm.dtype)),
           gpu_standard="model.kimi_k3.ops.kda_standard:kda_decode_standard"),
        Op("mla_decode", mla_decode, shapes=("heads", "kv_lora_rank", "rope_dim"), dtypes=("weights", "kv_cache"),
           probe=lambda q_nope, q_pe, kv, slots, lengths, w_uk, w_uv, scale: (
               (q_nope.shape[1], w_uk.shape[-1], q_pe.shape[-1]), (w_uk.dtype, kv.dtype))),
        Op("moe_route", route, shapes=("experts", "top_k", "hidden"), dtypes=("weights",),
           probe=lambda x, gate_w, bias, top_k, renormalize, scaling: (
               (gate_w.shape[0], top_k, gate_w.shape[1]), (gate_w.dtype,))),
        Op("moe_experts", moe_experts, shapes=("experts", "top_k", "latent_dim"), dtypes=("weights",),
           probe=lambda z, ids, weights, w13, w2, beta, beta_lin: (
               (w13[0].shape[0], ids.shape[1], z.shape[1]), (_expert_weights(w13),))),
    )
}


class Implementations(NamedTuple):
    reference: Callable
    standard: Callable
    specialized: Callable


@dataclass(frozen=True)
class Specialized:
    """A contracted kernel: its contract, the file it came from, and the kernel (None where it was not
    imported because no arch it is validated on is this machine's: it could never be chosen here)."""

    contract: Contract
    source: str
    fn: Callable | None

    def __post_init__(self) -> None:
        if not isinstance(self.contract, Contract):
            raise TypeError(f"a specialized implementation needs a Contract, got {type(self.contract).__name__}")
        if self.contract.op not in OPS:
            raise ContractError(f"{self.source}: op: unknown op {self.contract.op!r}")

    @property
    def op(self) -> Op:
        return OPS[self.contract.op]

    def implementations(self, gpu: bool) -> Implementations:
        if self.fn is None:
            raise RuntimeError(f"{self.source}: implementation was not imported (load with arch=None)")
        return Implementations(self.op.reference, self.op.standard(gpu), self.fn)


def registry_problems(contract: Contract, source: str, imports: bool = True) -> list[str]:
    """What a schema-valid contract gets wrong about the registry, as `file: field: problem` lines: unknown
    op, entry points that differ from the registry's or do not import, constraints on names the op lacks."""
    op = OPS.get(contract.op)
    if op is None:
        return [f"{source}: op: unknown op {contract.op!r}; registered ops: {', '.join(sorted(OPS))}"]
    problems = []
    for field, expected in (("reference", entry_point(op.reference)), ("standard", op.standard_entry_point)):
        if getattr(contract, field) != expected:
            problems.append(f"{source}: {field}: {getattr(contract, field)} is not the registry's {field} of "
                            f"{op.name} ({expected})")
    for key in contract.shapes:
        if key not in op.shapes:
            problems.append(f"{source}: shapes.{key}: {op.name} has no dim {key!r}; its dims: {', '.join(op.shapes)}")
    for key in ("kv_cache", "ssm_state"):
        if getattr(contract.dtypes, key) is not None and key not in op.dtypes:
            problems.append(f"{source}: dtypes.{key}: {op.name} has no {key} operand")
    if imports:
        for field in ("implementation", "reference", "standard"):
            spec = getattr(contract, field)
            try:
                import_entry_point(spec)
            except Exception as e:  # noqa: BLE001 - report whatever stops the import
                problems.append(f"{source}: {field}: cannot import {spec} ({type(e).__name__}: {e})")
    return problems


def load_specialized(directory: str | Path = CONTRACTS_DIR, arch: str | None = None) -> dict[str, Specialized]:
    """Every contract in `directory`, checked against the registry, as {op: Specialized}.

    With `arch`, only kernels validated on that arch are imported (and their entry points checked): a
    GPU kernel is not imported on a CPU machine. Raises ContractError listing every problem found.
    """
    found, problems = {}, []
    for path in contract_files(directory):
        try:
            contract = load_contract(path)
        except ContractError as e:
            problems.append(str(e))
            continue
        runnable = arch is None or arch in contract.archs_validated
        wrong = registry_problems(contract, str(path), imports=runnable)
        if wrong:
            problems.extend(wrong)
            continue
        fn = import_entry_point(contract.implementation) if runnable else None
        found[contract.op] = Specialized(contract, str(path), fn)
    if problems:
        raise ContractError("\n".join(problems))
    return found
