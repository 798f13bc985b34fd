"""`k3forge evidence verify [PATH]`, `show PATH` and `render [PATH]`: is the evidence intact, fresh, what it says,
and its reports rendered again with this tree's templates."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from gates.core.sources import REPO_ROOT, harness_digest, relative
from gates.core.status import Status
from gates.evidence import decode
from gates.evidence.bundle import load_bundle
from gates.evidence.diff import DiffError, contract_changes, render_markdown
from gates.evidence.diff import diff as evidence_diff
from gates.evidence.report import rerender
from gates.evidence.verify import find_bundles, judged_by_other_gate_code, verify_bundle, verify_tree
from model.kimi_k3.errors import EXIT_OK, UsageError

STYLE = {Status.PASSED: "green", Status.NOT_RUN: "dim", Status.SLOWER: "yellow"}


def register(sub) -> None:
    p = sub.add_parser("evidence", help="verify or show evidence bundles")
    verbs = p.add_subparsers(dest="verb", required=True)
    verify = verbs.add_parser("verify", help="check integrity (manifest) and freshness (source hashes)")
    verify.add_argument("path", nargs="?", type=Path,
                        help="a bundle directory or a directory of bundles (default: evidence/)")
    verify.set_defaults(func=run_verify)
    show = verbs.add_parser("show", help="print a bundle's summary")
    show.add_argument("path", type=Path, help="a bundle directory (evidence/<op>/<arch>)")
    show.set_defaults(func=run_show)
    render = verbs.add_parser("render", help="render bundles' reports again with this tree's templates",
                              description="Render report.md and report.html again from each bundle.json (nothing "
                                          "measured or judged changes) and rewrite the manifest. Refused for a "
                                          "bundle that is not intact.")
    render.add_argument("path", nargs="?", type=Path,
                        help="a bundle directory or a directory of bundles (default: evidence/)")
    render.set_defaults(func=run_render)
    diff = verbs.add_parser("diff", help="what moved between two commits' bundles, per op and arch",
                            description="Per op and arch: verdict and gate statuses, per-point speedups with their "
                                        "intervals (in-pipeline and one call per graph), fractions of the floor, "
                                        "kernel counts, registers and spills, the contract fields the bundle was "
                                        "judged by (loosening flagged), eval figures; bundles added or removed.")
    diff.add_argument("base", help="base revision (a commit, branch or tag)")
    diff.add_argument("head", nargs="?", help="head revision (default: the working tree)")
    diff.add_argument("--out", type=Path, help="also write the Markdown to this file")
    diff.set_defaults(func=run_diff)
    dec = verbs.add_parser("decode", help="make the decode bundle from `bench layer` / `bench step` records",
                           description="One bundle (evidence/decode/<arch>/ by default) from the JSON records of "
                                       "`k3forge bench layer|step --json`: one commit, one device; it covers every "
                                       "source the runs loaded.")
    dec.add_argument("records", nargs="+", type=Path, help="JSON records written by bench layer / bench step")
    dec.add_argument("--out", type=Path, help="bundle directory (default: evidence/decode/<arch>)")
    dec.set_defaults(func=run_decode)


def _existing(path: Path) -> Path:
    if not path.is_dir():
        raise UsageError(f"{path}: no such directory")
    return path


def run_verify(args) -> int:
    path = _existing(args.path) if args.path else REPO_ROOT / "evidence"  # no evidence/ yet: nothing to verify
    results = verify_tree(path)
    out, harness = Console(highlight=False), harness_digest()
    if not results:
        out.print(f"no evidence bundles under {relative(path)}")
        return 0
    for directory, problems in results.items():
        if problems:
            out.print(f"[red]✗[/] {relative(directory)}")
            for problem in problems:
                out.print(f"    {problem}", soft_wrap=True)
        else:
            out.print(f"[green]✓[/] {relative(directory)}: intact and fresh")
            if note := judged_by_other_gate_code(directory, harness):
                out.print(f"    [dim]note: {note}[/]", soft_wrap=True)
    bad = sum(1 for p in results.values() if p)
    out.print(f"{len(results) - bad} of {len(results)} bundle(s) intact and fresh")
    return 1 if bad else 0


def run_show(args) -> int:
    directory = _existing(args.path)
    if find_bundles(directory) != [directory]:
        raise UsageError(f"{directory}: not a bundle directory (expected bundle.json and manifest.json)")
    bundle = load_bundle(directory)
    out = Console(highlight=False)
    verdict = bundle.verdict
    commit = (bundle.git.commit or "no commit")[:12] + (" (uncommitted changes)" if bundle.git.dirty else "")
    out.print(Panel.fit(
        f"[bold]{bundle.op}[/] on {bundle.arch} ({bundle.environment.device_name})\n"
        f"verdict [{STYLE.get(verdict, 'red')}]{verdict.value}[/] · commit {commit} · {bundle.created}\n"
        f"owners {', '.join(bundle.owners)} · backend {bundle.contract['backend']}", title="evidence"))
    table = Table()
    for col in ("gate", "status", "result"):
        table.add_column(col)
    for g in bundle.gates:
        table.add_row(g.title, f"[{STYLE.get(g.status, 'red')}]{g.status.value}[/]",
                      g.reason if g.status is Status.NOT_RUN else g.summary)
    out.print(table)
    for g in bundle.gates:
        if g.status.failed and g.reason:
            out.print(f"[red]{g.title}:[/] {g.reason}", soft_wrap=True)
    for flag in bundle.flags:
        out.print(f"[yellow]⚠[/] {flag}", soft_wrap=True)
    problems = verify_bundle(directory)
    out.print("[green]intact and fresh[/]" if not problems else "[red]not trustworthy:[/]\n  " + "\n  ".join(problems),
              soft_wrap=True)
    out.print(f"report: {relative(directory / 'report.html')}")
    return 0


def run_render(args) -> int:
    path = _existing(args.path) if args.path else REPO_ROOT / "evidence"
    out, refused = Console(highlight=False), 0
    for directory in find_bundles(path):
        if problems := rerender(directory):
            refused += 1
            out.print(f"[red]✗[/] {relative(directory)}: not rendered")
            for problem in problems:
                out.print(f"    {problem}", soft_wrap=True)
        else:
            out.print(f"[green]✓[/] {relative(directory)}: reports rendered again")
    return 1 if refused else 0


def run_diff(args) -> int:
    try:
        text = render_markdown(evidence_diff(args.base, args.head), args.base, args.head,
                               contract_changes(args.base, args.head))
    except DiffError as e:
        raise UsageError(str(e)) from None
    Console(highlight=False).print(text, markup=False)
    if args.out:
        args.out.write_text(text)
    return EXIT_OK


def run_decode(args) -> int:
    try:
        bundle = decode.from_records(args.records)
    except decode.DecodeError as e:
        raise UsageError(str(e)) from None
    out = decode.write(bundle, args.out or REPO_ROOT / "evidence" / "decode" / bundle.arch)
    Console(highlight=False).print(f"wrote {relative(out)}: {len(bundle.layers)} layer rows, {len(bundle.steps)} step "
                                   f"rows, {len(bundle.sources)} sources covered", markup=False)
    return EXIT_OK
