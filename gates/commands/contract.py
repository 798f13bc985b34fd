"""`k3forge contract check` validates every contract; `k3forge contract show OP` prints one.

check (gates.core.contracts.check_contracts, the gate's own first check): the schema, the registry (known op,
entry points that are the registry's, constraints on dims and operands the op has), entry points that
import (in a spawned process: a candidate's top-level code never runs in the checker), and for each
validated arch an intact, fresh evidence bundle `evidence/<op>/<arch>/`. Problems print as
`file: field: problem` lines; any problem exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gates.checks.benchmarks import never_timed
from gates.core.contracts import check_contracts, load_contracts
from kernels.contract import contract_files, load_contract
from model.kimi_k3.errors import EXIT_OK, EXIT_USAGE, UsageError
from model.kimi_k3.ops.registry import REPO_ROOT, registry_problems

BUNDLE = "bundle.json"


def register(sub) -> None:
    p = sub.add_parser("contract", help="validate and inspect kernel contracts (contracts/<op>.yaml)")
    verbs = p.add_subparsers(dest="verb", required=True)
    check = verbs.add_parser("check", help="validate every contract: schema, registry, entry points, evidence")
    show = verbs.add_parser("show", help="print one contract")
    show.add_argument("op", help="op name, e.g. attn_res")
    for v in (check, show):
        v.add_argument("--root", type=Path, default=REPO_ROOT,
                       help="repository root holding contracts/ and evidence/ (default: this checkout)")
    check.set_defaults(func=run_check)
    show.set_defaults(func=run_show)


def _relative(path: Path) -> Path:
    """Relative to the working directory when inside it (messages name files the way the user would)."""
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def run_check(args) -> int:
    directory = _relative(args.root / "contracts")
    problems = check_contracts(directory, args.root / "evidence")
    contracts, _ = load_contracts(directory)
    passed = [c for path, c in contracts.items() if not any(p.startswith(f"{path}:") for p in problems)]
    if passed:
        table = Table(title="contracts")
        for col in ("op", "backend", "validated", "declared", "tp", "batch", "spec tokens", "activations"):
            table.add_column(col)
        for c in passed:
            table.add_row(c.op, c.backend, ", ".join(c.archs_validated) or "-",
                          ", ".join(h.arch for h in c.hardware.declared) or "-", escape(str(c.tp_sizes)),
                          f"{c.batch.min}..{c.batch.max}", f"{c.spec_tokens.min}..{c.spec_tokens.max}",
                          c.dtypes.activations)
        Console().print(table)
        for c in passed:
            if note := never_timed(c):
                print(f"note: {note}")
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s); {len(passed)} contract(s) pass", file=sys.stderr)
        return EXIT_USAGE
    print(f"{len(passed)} contract(s) pass" if passed else "no contracts")
    return EXIT_OK


def run_show(args) -> int:
    path = args.root / "contracts" / f"{args.op}.yaml"
    if not path.is_file():
        ops = [p.stem for p in contract_files(args.root / "contracts")]
        raise UsageError(f"contract show: no contract for op {args.op!r}; contracts: {', '.join(ops) or 'none'}")
    source = str(_relative(path))
    contract = load_contract(source)
    table = Table(title=f"{source} (schema v{contract.schema_version})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in contract.model_dump(mode="json", exclude={"schema_version"}, exclude_none=True).items():
        text = (value if isinstance(value, str)
                else yaml.safe_dump(value, default_flow_style=None, sort_keys=False).strip())
        table.add_row(key, escape(text))
    for arch, rel in contract.evidence_dirs().items():
        present = (args.root / rel / BUNDLE).is_file()
        table.add_row(f"evidence {arch}", f"{rel}/{BUNDLE} " + ("present" if present else "[red]missing[/]"))
    problems = registry_problems(contract, source, imports=False)
    table.add_row("registry", "consistent" if not problems else "[red]" + escape("\n".join(problems)) + "[/]")
    Console().print(table)
    return EXIT_OK
