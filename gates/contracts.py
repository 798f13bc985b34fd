"""Contract checks the gate runs first: the schema, and that every entry point imports.

Entry points are imported in a spawned process (gates.sandbox): importing a candidate runs its top-level code,
which must never run inside the gate. Problems read `file: field: problem`, one per string.
"""

from __future__ import annotations

from pathlib import Path

from gates.sandbox import Sandbox, SandboxError
from kernels.contract import Contract, ContractError, load_contract

ENTRY_FIELDS = ("implementation", "reference", "standard")


def contract_files(contracts_dir: Path) -> list[Path]:
    return sorted(Path(contracts_dir).glob("*.yaml"))


def load_contracts(contracts_dir: Path) -> tuple[dict[Path, Contract], list[str]]:
    """Every contract that parses, and the schema problems of those that do not."""
    contracts, problems = {}, []
    for path in contract_files(contracts_dir):
        try:
            contracts[path] = load_contract(path)
        except ContractError as e:
            problems.extend(str(e).splitlines())
    return contracts, problems


def entry_problems(contracts: dict[Path, Contract]) -> list[str]:
    """`file: field: cannot import ...` for each entry point that does not import as a callable."""
    where = {(path, field): getattr(c, field) for path, c in contracts.items() for field in ENTRY_FIELDS}
    if not where:
        return []
    with Sandbox() as box:
        try:
            errors = box.request("probe", entries=sorted(set(where.values())))["errors"]
        except SandboxError as e:
            return [f"{path}: {field}: {e}" for path, field in where]
    return [f"{path}: {field}: cannot import {entry} ({errors[entry]})"
            for (path, field), entry in where.items() if entry in errors]


def check_contracts(contracts_dir: str | Path) -> list[str]:
    """Every problem with the contracts in `contracts_dir`: schema, then importability; [] when all are sound."""
    contracts_dir = Path(contracts_dir)
    if not contracts_dir.is_dir():
        return [f"{contracts_dir}: <dir>: no such contracts directory"]
    contracts, problems = load_contracts(contracts_dir)
    return problems + entry_problems(contracts)
