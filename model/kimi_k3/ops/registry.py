"""The decode-path ops, found by discovery, and their implementations.

- reference: plain PyTorch, the numerics ground truth, in the op's own module `model/kimi_k3/ops/<op>.py`.
- standard: what a strong stock serving engine runs, named by the op's declaration (`Op.gpu_standard`); on
  CPU, and for ops without one, the reference serves.
- specialized: a contracted kernel. It exists only through a contract (`contracts/<op>.yaml`) whose
  `implementation` names it; `load_specialized` reads a contracts directory and is the one way to get one.

Every module of this package that defines `OP` is an op (`OP.name` is the module's name); modules without one
hold shared math (`kda.py`) or standards (`<op>_standard.py`). The gate runner enumerates contracts and gets
every implementation of each:

    for spec in load_specialized().values():
        reference, standard, specialized = spec.implementations(gpu=True)
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import yaml

from kernels.contract import Contract, ContractError, contract_files, load_contract
from kernels.sources import REPO_ROOT
from kernels.strict_yaml import load_yaml, yaml_problem

from .op import Op, Signature, dtype_name, entry_point, import_entry_point

__all__ = ["OPS", "Op", "Signature", "Specialized", "Implementations", "dtype_name", "entry_point",
           "import_entry_point", "registry_problems", "load_specialized", "discover", "REPO_ROOT", "CONTRACTS_DIR"]

CONTRACTS_DIR = REPO_ROOT / "contracts"


def discover() -> dict[str, Op]:
    """{name: Op} for every module of this package that declares `OP`; a name that is not its module's is an error."""
    package = __name__.rpartition(".")[0]
    found = {}
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        module = importlib.import_module(f"{package}.{info.name}")
        op = getattr(module, "OP", None)
        if op is None:
            continue
        if not isinstance(op, Op) or op.name != info.name:
            raise TypeError(f"model/kimi_k3/ops/{info.name}.py: OP must be an Op named {info.name!r}, got {op!r}")
        found[op.name] = op
    return found


OPS: dict[str, Op] = discover()


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


def strict_parse(path: Path) -> None:
    """Raise ContractError for a contract file the gates' loader refuses before the schema (a key twice in one
    mapping, which kernels.load_contract's PyYAML reads as the last value): the dispatcher reads what was judged.
    Belongs in kernels.load_contract itself, which the KDA bundle covers: moves there at its next H200 gate."""
    try:
        load_yaml(path.read_text())
    except OSError as e:
        raise ContractError(f"{path}: <file>: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ContractError(f"{path}: <file>: {yaml_problem(e)}") from None


def load_specialized(directory: str | Path = CONTRACTS_DIR, arch: str | None = None) -> dict[str, Specialized]:
    """Every contract in `directory`, checked against the registry, as {op: Specialized}.

    With `arch`, only kernels validated on that arch are imported (and their entry points checked): a
    GPU kernel is not imported on a CPU machine. Raises ContractError listing every problem found.
    """
    found, problems = {}, []
    for path in contract_files(directory):
        try:
            strict_parse(path)
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
