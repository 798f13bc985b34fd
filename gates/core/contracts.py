"""Contract checks the gate runs first, as `file: field: problem` lines: the schema, the op registry, that every
entry point imports, and that each arch the contract calls validated has intact, fresh evidence.

Entry points are imported in a spawned process (gates.core.sandbox): importing a candidate runs its top-level code,
which must never run inside the gate. The arch the gate is producing evidence for right now is not checked.
"""

from __future__ import annotations

from pathlib import Path

from gates.core.sandbox import Sandbox, SandboxError
from gates.core.sources import REPO_ROOT
from gates.evidence.verify import verify_bundle
from kernels.contract import Contract, ContractError, contract_files, evidence_dir, load_contract
from model.kimi_k3.ops.registry import registry_problems

ENTRY_FIELDS = ("implementation", "reference", "standard")


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


def evidence_problems(path: Path, contract: Contract, evidence_root: Path, producing_arch: str | None) -> list[str]:
    """Each validated arch's bundle must be intact and fresh against the tree holding evidence_root."""
    problems = []
    for i, hw in enumerate(contract.hardware.validated):
        if hw.arch == producing_arch:
            continue
        directory = evidence_root / evidence_dir(contract.op, hw.arch).removeprefix("evidence/")
        problems += [f"{path}: hardware.validated.{i}: {hw.arch} is validated, but its evidence is not sound: {p}"
                     for p in verify_bundle(directory, root=evidence_root.parent)]
    return problems


def check_contracts(contracts_dir: str | Path, evidence_root: str | Path = REPO_ROOT / "evidence",
                    producing_arch: str | None = None) -> list[str]:
    """Every problem with the contracts in `contracts_dir`; [] when all are sound."""
    contracts_dir = Path(contracts_dir)
    if not contracts_dir.is_dir():
        return [f"{contracts_dir}: <dir>: no such contracts directory"]
    contracts, problems = load_contracts(contracts_dir)
    for path, contract in contracts.items():
        problems += registry_problems(contract, str(path), imports=False)
        problems += evidence_problems(path, contract, Path(evidence_root), producing_arch)
    return problems + entry_problems(contracts)
