"""`k3forge op list` / `k3forge op show OP`: where every piece of an op lives, and its latest verdict per arch.

An op's pieces, one place per kind: its module (`model/kimi_k3/ops/<op>.py`: reference and declaration), its
standard, its specialized kernels (contracts naming the op), the contract, the problem (`gates/problems/<op>.py`),
the task templates that name it, its tests, the kernel's NOTES.md and the evidence bundles with their verdicts.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernels.contract import ContractError, contract_files, load_contract
from model.kimi_k3.errors import EXIT_OK, UsageError
from model.kimi_k3.ops.registry import OPS, REPO_ROOT, Op, import_entry_point

out = Console(highlight=False)


def register(sub) -> None:
    p = sub.add_parser("op", help="the decode-path ops and where each one's pieces are")
    verbs = p.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="every op: reference, standard, kernels, latest verdicts").set_defaults(func=run_list)
    show = verbs.add_parser("show", help="every piece of one op and where it lives")
    show.add_argument("op", help="op name, e.g. kda_decode")
    show.set_defaults(func=run_show)


@dataclass(frozen=True)
class OpPlaces:
    """Repository-relative paths of an op's pieces (empty where the op has none yet)."""

    module: str
    standard: str
    contract: str | None
    kernels: tuple[str, ...]
    problem: str | None
    tasks: tuple[str, ...]
    tests: tuple[str, ...]
    notes: tuple[str, ...]
    verdicts: dict[str, str]  # arch -> verdict of evidence/<op>/<arch>/bundle.json


def _rel(path: Path | str) -> str:
    return str(Path(path).resolve().relative_to(REPO_ROOT))


def _source(entry: str) -> str:
    try:
        return f"{_rel(inspect.getsourcefile(import_entry_point(entry)))} ({entry.partition(':')[2]})"
    except Exception as e:  # noqa: BLE001 - a standard whose library is missing here still has a place
        module = entry.partition(":")[0].replace(".", "/") + ".py"
        return f"{module} ({type(e).__name__} here: {e})"


def places(op: Op, root: Path = REPO_ROOT) -> OpPlaces:
    contract_path = root / "contracts" / f"{op.name}.yaml"
    contract = None
    if contract_path.is_file():
        try:
            contract = load_contract(contract_path)
        except ContractError:
            contract = None
    kernels = []
    for path in contract_files(root / "contracts"):
        try:
            c = load_contract(path)
        except ContractError:
            continue
        if c.op == op.name:
            module = c.implementation.partition(":")[0].replace(".", "/")
            found = [p for p in (root / f"{module}.py", root / module / "__init__.py") if p.is_file()]
            kernels.append(f"{_rel(found[0]) if found else module} ({c.implementation.partition(':')[2]})")
    tasks = sorted(_rel(p) for p in (root / "agent_tasks").glob("*.yaml")
                   if op.name in (yaml.safe_load(p.read_text()) or {}).get("ops", []))
    tests = sorted({_rel(p) for p in (root / "tests").rglob(f"test_{op.name}*.py")}
                   | {_rel(p) for p in (root / "tests").rglob("test_*.py") if f'"{op.name}"' in p.read_text()})
    notes = sorted(_rel(p) for p in (root / "model/kimi_k3/specialized").glob(f"{op.name}*/NOTES.md"))
    verdicts = {}
    for bundle in sorted((root / "evidence" / op.name).glob("*/bundle.json")):
        try:
            verdicts[bundle.parent.name] = json.loads(bundle.read_text()).get("verdict", "unreadable")
        except (OSError, ValueError):
            verdicts[bundle.parent.name] = "unreadable"
    problem = root / "gates" / "problems" / f"{op.name}.py"
    return OpPlaces(module=_rel(inspect.getsourcefile(op.reference)),
                    standard=f"{_source(op.standard_entry_point)}: {op.standard_label}",
                    contract=_rel(contract_path) if contract is not None or contract_path.is_file() else None,
                    kernels=tuple(kernels), problem=_rel(problem) if problem.is_file() else None,
                    tasks=tuple(tasks), tests=tuple(tests), notes=tuple(notes), verdicts=verdicts)


def run_list(args) -> int:
    table = Table(title="ops (model/kimi_k3/ops/<op>.py)")
    table.add_column("op", no_wrap=True, min_width=max(map(len, OPS)))  # a name is never cut: it is what one types
    for col in ("shapes", "standard", "specialized", "verdicts"):
        table.add_column(col)
    for op in OPS.values():
        p = places(op)
        table.add_row(op.name, ", ".join(op.shapes), op.standard_entry_point.partition(":")[0].rpartition(".")[2],
                      escape("\n".join(p.kernels) or "-"),
                      ", ".join(f"{arch} {v}" for arch, v in p.verdicts.items()) or "-")
    out.print(table)
    return EXIT_OK


def run_show(args) -> int:
    op = OPS.get(args.op)
    if op is None:
        raise UsageError(f"op {args.op!r}: no such op; ops: {', '.join(OPS)}")
    p = places(op)
    table = Table(title=f"{op.name}", show_header=False)
    table.add_column("piece")
    table.add_column("where")
    rows = [("reference + declaration", p.module), ("shapes / operand dtypes", f"{', '.join(op.shapes)} / "
                                                                              f"{', '.join(op.dtypes)}"),
            ("standard", p.standard), ("specialized", "\n".join(p.kernels) or "none yet"),
            ("contract", p.contract or f"none (contracts/{op.name}.yaml)"),
            ("problem", p.problem or f"none (gates/problems/{op.name}.py)"),
            ("task templates", "\n".join(p.tasks) or "none"), ("tests", "\n".join(p.tests) or "none"),
            ("notes", "\n".join(p.notes) or "none"),
            ("evidence", "\n".join(f"evidence/{op.name}/{arch}: {v}" for arch, v in p.verdicts.items()) or "none")]
    for piece, where in rows:
        table.add_row(piece, escape(where))
    out.print(table)
    return EXIT_OK
