"""`k3forge bench`: the benchmark gate alone, for a kernel engineer's loop: every contracted op (or --ops)
against its standard at the contract's benchmark points (and `--drawn-points` more that it admits), side by side
in one run, with 95 % intervals and the fraction of the roofline. Writes no evidence (`k3forge gate` does);
`--json` keeps the rows.

Exit codes: 0 every op was timed and met its contract, 1 one was slower or failed, 2 a usage or contract
problem, or nothing was timed (no CUDA GPU here, or none of the ops can run on it).

`k3forge bench layer` and `k3forge bench step` time whole decode layers and the whole step at K3's rank shapes,
both backends side by side (model/kimi_k3/bench); `k3forge evidence decode` makes their records a bundle.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gates.checks import benchmarks
from gates.commands.gate import RichReporter, option_error, parse_ops, progress_bar
from gates.core.contracts import load_contracts
from gates.core.runner import new_options, run_gates, unknown_ops
from gates.core.sources import REPO_ROOT
from gates.core.status import Status
from kernels.arch import detect
from model.kimi_k3.bench.cli import add_commands as add_decode_benches
from model.kimi_k3.cli import output_file
from model.kimi_k3.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError


def register(sub) -> None:
    p = sub.add_parser("bench", help="time contracted kernels against their standards (no evidence written)",
                       description="Run the benchmark gate for every contract (or --ops) on this machine's GPU.")
    p.add_argument("--ops", help="comma-separated op names (default: every contract)")
    p.add_argument("--contracts", type=Path, default=REPO_ROOT / "contracts", help="contracts directory")
    p.add_argument("--bench-pairs", type=int, default=50, help="interleaved candidate/standard replay pairs per block")
    p.add_argument("--max-blocks", type=int, default=12, help="timed blocks per benchmark point at most")
    p.add_argument("--drawn-points", type=int, default=2,
                   help="points the contract admits besides its benchmark points, drawn at random and timed too")
    p.add_argument("--json", type=Path, help="also write every result (rows, flags, reasons) to this file")
    p.set_defaults(func=run)
    add_decode_benches(p.add_subparsers(dest="what", metavar="{layer,step}",
                                        description="whole decode layers or the whole step instead of the ops"))


def run(args) -> int:
    try:
        options = new_options(bench_pairs=args.bench_pairs, max_blocks=args.max_blocks,
                              drawn_points=args.drawn_points)
    except ValidationError as e:
        raise UsageError("; ".join(option_error(err) for err in e.errors())) from None
    if args.json:
        output_file(args.json, "--json")
    contracts, problems = load_contracts(args.contracts)
    by_op = {c.op: (path, c) for path, c in contracts.items()}
    ops = parse_ops(args.ops) or sorted(by_op)
    if unknown := unknown_ops(ops, by_op):
        raise UsageError(unknown)
    console, machine = Console(), detect()
    results = {}
    with progress_bar(console) as progress:
        reporter = RichReporter(progress, progress.add_task("timing", total=len(ops)), console)
        for op in ops:  # each op's table as soon as it is timed: a run cut short keeps what it measured
            path, contract = by_op[op]
            result = results[op] = run_gates(contract, path, machine, options, reporter=reporter,
                                             gates=[benchmarks.GATE])[0]
            console.print(_table(op, result) if result.details.get("rows") else
                          escape(f"{op}: {result.status.value}: {result.reason or result.summary}"), soft_wrap=True)
            for flag in result.flags:
                console.print(f"  [yellow]flag:[/] {escape(flag)}", soft_wrap=True, highlight=False)
    for problem in problems:
        console.print(f"[bold red]contract:[/] {escape(problem)}", soft_wrap=True, highlight=False)
    if args.json:
        args.json.write_text(json.dumps({op: r.model_dump(mode="json") for op, r in results.items()}, indent=1))
    if problems:
        return EXIT_USAGE
    if all(r.status is Status.NOT_RUN for r in results.values()):
        console.print("nothing was timed", highlight=False)
        return EXIT_USAGE
    return EXIT_FAILED if any(r.status.failed for r in results.values()) else EXIT_OK


def _table(op: str, result) -> Table:
    outcome = result.summary if result.status is Status.PASSED else result.reason
    table = Table(title=escape(f"{op}: {result.status.value} ({outcome})"))
    for col in ("point", "candidate µs", "standard µs", "speedup [95 %]", "blocks", "required", "of roofline",
                "kernels"):
        table.add_column(col, overflow="fold")
    for r in result.details["rows"]:
        low, high = r["speedup_ci"]
        interval = f" [{low:.2f}, {high:.2f}]" if low is not None else ""
        fraction = f"{r['roofline_fraction']:.0%}" if r["roofline_fraction"] is not None else "-"
        required = f"{r['required_speedup']:g}×" + (f", {r['min_roofline_fraction']:.0%}"
                                                    if r["min_roofline_fraction"] else "")
        point = r["point"] + (" (drawn)" if r.get("drawn") else "")
        table.add_row(escape(point), f"{r['candidate']['median_us']:.2f}", f"{r['standard']['median_us']:.2f}",
                      f"{r['speedup']:.2f}×{interval}", str(r["blocks"]), required, fraction,
                      f"{r['kernels']['candidate']} / {r['kernels']['standard']}")
    return table
