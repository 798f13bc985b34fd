"""Contract checks the gate runs first, as `file: field: problem` lines: the schema, the op registry, that every
entry point imports, and that each arch the contract calls validated has intact, fresh evidence in which every
gate that applies on that arch PASSED (validated means passed: a gate that did not run validated nothing).

Entry points are imported in a spawned process (gates.core.sandbox): importing a candidate runs its top-level code,
which must never run inside the gate. The arch the gate is producing evidence for right now is not checked.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gates.core.registry import unjudged
from gates.core.sandbox import Sandbox, SandboxError
from gates.core.sources import REPO_ROOT
from gates.evidence.bundle import Bundle, load_bundle
from gates.evidence.verify import verify_bundle
from kernels.contract import Contract, ContractError, contract_files, evidence_dir, load_contract
from kernels.strict_yaml import load_yaml, yaml_problem
from model.kimi_k3.ops.registry import registry_problems

ENTRY_FIELDS = ("implementation", "reference", "standard")


def text_problem(e: UnicodeDecodeError) -> str:
    """One line for a file that is not UTF-8 text: the first byte that is not, and where."""
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"


def load_contracts(contracts_dir: Path) -> tuple[dict[Path, Contract], list[str]]:
    """Every contract that parses, and the problems of those that do not: one line for a YAML syntax error or a
    duplicate key (read strictly here: kernels.contract keeps a duplicate's last value), one per schema problem."""
    contracts, problems = {}, []
    for path in contract_files(contracts_dir):
        try:
            load_yaml(path.read_text())
        except yaml.YAMLError as e:
            problems.append(f"{path}: <file>: not valid YAML ({yaml_problem(e)})")
            continue
        except UnicodeDecodeError as e:
            problems.append(f"{path}: <file>: {text_problem(e)}")
            continue
        except OSError:
            pass  # load_contract says why the file cannot be read
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


def validation_problems(bundle: Bundle, contract: Contract, arch: str) -> list[str]:
    """Why `bundle` does not validate `arch` for `contract`: it holds another op or arch, or a gate that applies
    there did not pass (gates.core.registry.unjudged: exactly what keeps a bundle's verdict from PASSED; a bundle
    made before verdicts meant judged may say PASSED with such a gate NOT_RUN, so the gates are read, not the
    verdict)."""
    if (bundle.op, bundle.arch) != (contract.op, arch):
        return [f"holds {bundle.op} on {bundle.arch}, not {contract.op} on {arch}"]
    return unjudged(contract, arch, bundle.gates)


def evidence_problems(path: Path, contract: Contract, evidence_root: Path, producing_arch: str | None) -> list[str]:
    """Each validated arch's bundle must be intact and fresh against the tree holding evidence_root, and must have
    passed every gate that applies on that arch."""
    problems = []
    for i, hw in enumerate(contract.hardware.validated):
        if hw.arch == producing_arch:
            continue
        where = f"{path}: hardware.validated.{i}: {hw.arch} is validated"
        directory = evidence_root / evidence_dir(contract.op, hw.arch).removeprefix("evidence/")
        if unsound := verify_bundle(directory, root=evidence_root.parent):
            problems += [f"{where}, but its evidence is not sound: {p}" for p in unsound]
        else:
            problems += [f"{where}, but its bundle did not pass: {p}"
                         for p in validation_problems(load_bundle(directory), contract, hw.arch)]
    return problems


def check_contracts(contracts_dir: str | Path, evidence_root: str | Path = REPO_ROOT / "evidence",
                    producing_arch: str | None = None) -> list[str]:
    """Every problem with the contracts in `contracts_dir`; [] when all are sound."""
    contracts_dir = Path(contracts_dir)
    if not contracts_dir.is_dir():
        return [f"{contracts_dir}: <dir>: no such contracts directory"]
    return parsed_contract_problems(*load_contracts(contracts_dir), evidence_root, producing_arch)


def parsed_contract_problems(contracts: dict[Path, Contract], problems: list[str],
                             evidence_root: str | Path = REPO_ROOT / "evidence",
                             producing_arch: str | None = None) -> list[str]:
    """check_contracts for contracts already parsed (with their parse `problems`): the gate runner parses them
    before any candidate code runs, since importing an entry point runs it, and it could rewrite a contract file."""
    problems = list(problems)
    for path, contract in contracts.items():
        problems += registry_problems(contract, str(path), imports=False)
        problems += evidence_problems(path, contract, Path(evidence_root), producing_arch)
    return problems + entry_problems(contracts)
