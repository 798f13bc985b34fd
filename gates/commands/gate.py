"""`k3forge gate`: run every gate for every contract this machine can run, write the evidence bundles (signed
where K3FORGE_EVIDENCE_KEY or K3FORGE_EVIDENCE_KEY_FILE gives a key). --out is checked before any gate runs."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from gates.core.registry import Gate, registered
from gates.core.runner import Reporter, gate_all, new_options
from gates.core.sources import REPO_ROOT, relative
from gates.core.status import GateResult, Status
from gates.evidence.signing import signing_key
from gates.tasks.check import unlisted_gate_device, unsaid_kernel_changes
from kernels.arch import detect
from kernels.contract import contract_files
from model.kimi_k3.cli import output_directory
from model.kimi_k3.errors import UsageError

STYLE = {Status.PASSED: "green", Status.NOT_RUN: "dim", Status.SLOWER: "yellow"}
MARK = {Status.PASSED: "✓", Status.NOT_RUN: "–"}


def register(sub) -> None:
    p = sub.add_parser("gate", help="run the gates and write evidence bundles",
                       description="Run every gate for every contract (or --ops) and write evidence/<op>/<arch>/.")
    p.add_argument("--ops", help="comma-separated op names (default: every contract)")
    p.add_argument("--contracts", type=Path, default=REPO_ROOT / "contracts", help="contracts directory")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "evidence", help="evidence directory")
    p.add_argument("--seed", type=int, help="fix the master seed (to reproduce a failure; recorded as given)")
    p.add_argument("--trials", type=int, default=2, help="seeded inputs per envelope point and distribution")
    p.add_argument("--runs", type=int, default=4, help="candidate runs per input, all bitwise identical")
    p.add_argument("--steps", type=int, default=32, help="consecutive steps of a stateful op")
    p.add_argument("--bench-pairs", type=int, default=50, help="interleaved candidate/standard replay pairs per block")
    p.add_argument("--max-blocks", type=int, default=12,
                   help="timed blocks per benchmark point at most (fewer once the speedup is settled)")
    p.add_argument("--drawn-points", type=int, default=2,
                   help="points the contract admits besides its benchmark points, drawn from the seed and timed "
                        "too: the candidate must not be slower than the standard there")
    p.add_argument("--contract-unchanged", action="store_true",
                   help="gate an op whose kernel changed since its bundle while its contract did not (refused "
                        "otherwise: `task check` still asks the contract to say what changed)")
    p.set_defaults(func=run)


class RichReporter(Reporter):
    """The progress bar on a terminal; written to a log (no terminal: the bar is not drawn), every step as a line
    with the seconds since the gate started, so a log shows where a long gate spends its time."""

    def __init__(self, progress: Progress, task, console: Console):
        self.progress, self.task, self.console, self.current = progress, task, console, ""
        self.started = time.monotonic()

    def gate_started(self, op: str, gate: Gate) -> None:
        self.current = f"{op} · {gate.title.lower()}"
        self.progress.update(self.task, description=self.current)
        self._log(self.current)

    def note(self, text: str) -> None:
        line = f"{self.current}: {text}" if self.current else text  # before the first gate: the run's own notes
        self.progress.update(self.task, description=line)
        self._log(line)

    def _log(self, text: str) -> None:
        if not self.console.is_terminal:
            self.console.print(f"  {time.monotonic() - self.started:8.1f} s  {escape(text)}", highlight=False,
                               soft_wrap=True)

    def gate_done(self, op: str, result: GateResult) -> None:
        style = STYLE.get(result.status, "red")
        self.console.print(f"  [{style}]{result.status.value:<15}[/] {escape(op)} · {escape(result.title)}: "
                           f"{escape(result.summary)}",
                           highlight=False, soft_wrap=True)
        self.progress.advance(self.task)


def progress_bar(console: Console) -> Progress:
    """The bar `k3forge gate` and `k3forge bench` draw on a terminal (RichReporter logs lines elsewhere)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


def option_error(err: dict) -> str:
    """A pydantic error on GateOptions as the command line names it: `--max-blocks: ...`."""
    option = "-".join(map(str, err["loc"])).replace("_", "-")
    message = err["msg"].removeprefix("Value error, ")
    return f"--{option}: {message}" if option else message


def parse_ops(text: str | None) -> list[str] | None:
    """--ops as a list of op names, None when not given (every contract)."""
    return [o.strip() for o in text.split(",") if o.strip()] if text else None


def run(args) -> int:
    ops = parse_ops(args.ops)
    try:
        options = new_options(args.seed, trials=args.trials, runs=args.runs, steps=args.steps,
                              bench_pairs=args.bench_pairs, max_blocks=args.max_blocks,
                              drawn_points=args.drawn_points)
    except ValidationError as e:
        raise UsageError("; ".join(option_error(err) for err in e.errors())) from None
    output_directory(args.out, "--out")
    contracts = Path(args.contracts).resolve()
    if contracts.name == "contracts" and contracts.is_dir():
        machine = detect()
        if machine.is_gpu and (unlisted := unlisted_gate_device(contracts.parent, ops, machine.arch,
                                                                 machine.device_name)):
            raise UsageError("; ".join(unlisted))
        if not args.contract_unchanged and (unsaid := unsaid_kernel_changes(contracts.parent, ops, machine.arch)):
            raise UsageError("; ".join(unsaid) + " (--contract-unchanged gates anyway)")
    key = signing_key()
    console = Console(stderr=True)
    n_ops = len(ops) if ops else len(contract_files(args.contracts))
    command = "k3forge " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["gate"] else "k3forge gate"
    with progress_bar(console) as progress:
        task = progress.add_task("checking contracts", total=n_ops * len(registered()))
        outcome = gate_all(args.contracts, args.out, ops, options, RichReporter(progress, task, console), command,
                           key)
    for problem in outcome.contract_problems:
        console.print(f"[bold red]contract:[/] {escape(problem)}", highlight=False, soft_wrap=True)
    if not outcome.bundles:
        console.print(f"no bundles written (contracts: {escape(str(args.contracts))})", highlight=False)
        return outcome.exit_code
    for directory in outcome.kept:
        console.print(f"kept {escape(relative(directory))} as it was: the same judgement on the same code (a CPU "
                      "bundle is rewritten only when that changes)", highlight=False, soft_wrap=True)
    table = Table(title=f"evidence ({len(outcome.bundles)} bundle(s))")
    for col in ("op", "arch", "verdict", "gates", "report"):
        table.add_column(col, overflow="fold")
    for directory, bundle in outcome.bundles:
        gates = " ".join(f"[{STYLE.get(g.status, 'red')}]{MARK.get(g.status, '✗')} {escape(g.gate)}[/]"
                         for g in bundle.gates)
        table.add_row(escape(bundle.op), escape(bundle.arch),
                      f"[{STYLE.get(bundle.verdict, 'red')}]{bundle.verdict.value}[/]", gates,
                      escape(relative(directory / "report.html")))
    Console().print(table)
    return outcome.exit_code
