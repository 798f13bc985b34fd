"""`k3forge evidence verify [PATH]`, `show PATH` and `render [PATH]`: can the evidence be trusted (intact, signed
where a key is configured, consistent, fresh), what did it find, and its reports rendered again with this
tree's templates.

verify exits 1 unless every bundle can be trusted and records no failure, or when there is no bundle to verify;
`--allow-failed` accepts a trustworthy bundle that records a failure. A verdict is PASSED only when every gate
the contract requires on the bundle's arch ran and passed; a bundle some of whose required gates could not run
there (a GPU kernel's CPU bundle) says NOT_RUN, not judged here, and validates nothing (`contract check`). The
key for signatures comes from K3FORGE_EVIDENCE_KEY or K3FORGE_EVIDENCE_KEY_FILE (gates.evidence.signing).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from gates.core.sources import REPO_ROOT, harness_digest, relative
from gates.core.status import Status
from gates.evidence import decode
from gates.evidence.agree import SLACK, agreement
from gates.evidence.agree import render_markdown as render_agreement
from gates.evidence.bundle import BUNDLE_FILE, Bundle, load_bundle
from gates.evidence.diff import DiffError, contract_changes, render_markdown
from gates.evidence.diff import diff as evidence_diff
from gates.evidence.report import rerender
from gates.evidence.signing import KEY_FILE_VAR, KEY_VAR, SIGNATURE_FILE, signing_key
from gates.evidence.verify import find_bundles, judged_by_other_gate_code, off_schema, verify_bundle, verify_tree
from model.kimi_k3.errors import EXIT_FAILED, EXIT_OK, UsageError

STYLE = {Status.PASSED: "green", Status.NOT_RUN: "dim", Status.SLOWER: "yellow"}


def register(sub) -> None:
    p = sub.add_parser("evidence", help="verify or show evidence bundles")
    verbs = p.add_subparsers(dest="verb", required=True)
    verify = verbs.add_parser("verify", help="check that bundles can be trusted (intact, fresh) and PASSED",
                              description="Check each bundle: its files (manifest), its signature (where "
                                          f"{KEY_VAR} or {KEY_FILE_VAR} gives the key), what bundle.json says "
                                          "(schema, and each gate's numbers against its status), its freshness "
                                          "(source hashes), and its verdict. Exits 1 when a bundle fails any of "
                                          "that (with --allow-failed: any but a failed verdict), or when there is "
                                          "no bundle. A bundle not judged here (NOT_RUN) is reported, not failed.")
    verify.add_argument("path", nargs="?", type=Path,
                        help="a bundle directory or a directory of bundles (default: evidence/)")
    verify.add_argument("--allow-failed", action="store_true",
                        help="accept a trustworthy bundle whose verdict is a failure (a recorded failure)")
    verify.add_argument("--require-signature", action="store_true",
                        help=f"reject unsigned bundles too (needs the key: {KEY_VAR} or {KEY_FILE_VAR})")
    verify.set_defaults(func=run_verify)
    show = verbs.add_parser("show", help="print a bundle's summary")
    show.add_argument("path", type=Path, help="a bundle directory (evidence/<op>/<arch>)")
    show.set_defaults(func=run_show)
    render = verbs.add_parser("render", help="render bundles' reports again with this tree's templates",
                              description="Render report.md and report.html again from each bundle.json (nothing "
                                          "measured or judged changes) and rewrite the manifest. Refused for a "
                                          "bundle that is not intact, and for a signed one without its key.")
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
    agree = verbs.add_parser("agree", help="whether an independent re-run's bundles agree with the committed ones",
                             description="Per op and arch present on both sides: the same verdict and gate "
                                         "statuses, every contract point timed again with a speedup (in-pipeline "
                                         "and one call per graph) whose 95 % interval overlaps the committed one "
                                         "or within --slack of it, and the same kernel count. Exit 1 on any "
                                         "disagreement. Bundles only one side has, or equal on both (not made "
                                         "again), are listed, not judged.")
    agree.add_argument("committed", type=Path, help="the committed evidence folder (e.g. a copy of evidence/)")
    agree.add_argument("rerun", type=Path, help="the re-run's evidence folder")
    agree.add_argument("--slack", type=float, default=SLACK,
                       help=f"relative speedup difference that still agrees (default {SLACK})")
    agree.add_argument("--out", type=Path, help="also write the Markdown to this file")
    agree.set_defaults(func=run_agree)
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


def _verdict(bundle: Bundle) -> str:
    """`PASSED`, `PASSED (not required on cpu: compile, benchmarks)` or `NOT_RUN (not judged here: numerics,
    evals)`: what the verdict covers."""
    skipped = [g.gate for g in bundle.not_run if g.gate in bundle.not_required]
    if bundle.verdict is Status.NOT_RUN:
        return f"NOT_RUN (not judged here: {', '.join(g.gate for g in bundle.not_run if g.gate not in skipped)})"
    return bundle.verdict.value + (f" (not required on {bundle.arch}: {', '.join(skipped)})" if skipped else "")


def run_verify(args) -> int:
    key = signing_key()
    if args.require_signature and key is None:
        raise UsageError(f"--require-signature: no key to check signatures with; set {KEY_VAR} or {KEY_FILE_VAR}")
    path = _existing(args.path) if args.path else REPO_ROOT / "evidence"
    results = verify_tree(path, key=key, require_signature=args.require_signature) if path.is_dir() else {}
    out, harness = Console(highlight=False), harness_digest()
    if not results:
        out.print(f"no evidence bundles under {escape(relative(path))}: nothing verified", soft_wrap=True)
        return EXIT_FAILED
    trusted = failed = 0
    for directory, problems in results.items():
        name = escape(relative(directory))
        if problems:
            out.print(f"[red]✗[/] {name}", soft_wrap=True)
            for problem in problems:
                out.print(f"    {escape(problem)}", soft_wrap=True)
            continue
        trusted += 1
        if decode.is_decode_bundle(directory):  # measurements, no verdict
            out.print(f"[green]✓[/] {name}: intact and fresh, decode measurements (no verdict)", soft_wrap=True)
            if note := decode.tooling_note(decode.load(directory)):
                out.print(f"    [dim]note: {escape(note)}[/]", soft_wrap=True)
            continue
        bundle = load_bundle(directory)
        if not bundle.verdict.failed or args.allow_failed:
            out.print(f"[green]✓[/] {name}: intact and fresh, verdict {_verdict(bundle)}", soft_wrap=True)
        else:
            failed += 1
            out.print(f"[red]✗[/] {name}: intact and fresh, but its verdict is {_verdict(bundle)} "
                      "(--allow-failed accepts a recorded failure)", soft_wrap=True)
        if key is None and (directory / SIGNATURE_FILE).exists():
            out.print("    [dim]note: signed; the signature was not checked (no key configured)[/]", soft_wrap=True)
        if note := judged_by_other_gate_code(directory, harness):
            out.print(f"    [dim]note: {escape(note)}[/]", soft_wrap=True)
    summary = f"{trusted} of {len(results)} bundle(s) intact and fresh"
    out.print(summary + (f"; {failed} did not pass" if failed else ""))
    return EXIT_FAILED if trusted < len(results) or failed else EXIT_OK


def run_show(args) -> int:
    directory = _existing(args.path)
    if find_bundles(directory) != [directory]:
        raise UsageError(f"{directory}: not a bundle directory (expected bundle.json and manifest.json)")
    try:
        bundle = load_bundle(directory)
    except ValueError as e:
        raise UsageError(off_schema(directory / BUNDLE_FILE, e)) from None
    out = Console(highlight=False)
    verdict = bundle.verdict
    commit = (bundle.git.commit or "no commit")[:12] + (" (uncommitted changes)" if bundle.git.dirty else "")
    out.print(Panel.fit(
        f"[bold]{escape(bundle.op)}[/] on {escape(bundle.arch)} ({escape(bundle.environment.device_name)})\n"
        f"verdict [{STYLE.get(verdict, 'red')}]{verdict.value}[/] · commit {escape(commit)} · "
        f"{escape(bundle.created)}\n"
        f"owners {escape(', '.join(bundle.owners))} · backend {escape(str(bundle.contract.get('backend')))}",
        title="evidence"))
    table = Table()
    for col in ("gate", "status", "result"):
        table.add_column(col)
    for g in bundle.gates:
        table.add_row(escape(g.title), f"[{STYLE.get(g.status, 'red')}]{g.status.value}[/]",
                      escape(g.reason if g.status is Status.NOT_RUN else g.summary))
    out.print(table)
    for g in bundle.gates:
        if g.status.failed and g.reason:
            out.print(f"[red]{escape(g.title)}:[/] {escape(g.reason)}", soft_wrap=True)
    for flag in bundle.flags:
        out.print(f"[yellow]⚠[/] {escape(flag)}", soft_wrap=True)
    problems = verify_bundle(directory, key=signing_key())
    out.print("[green]intact and fresh[/]" if not problems else
              "[red]not trustworthy:[/]\n  " + "\n  ".join(map(escape, problems)), soft_wrap=True)
    out.print(f"report: {escape(relative(directory / 'report.html'))}", soft_wrap=True)
    return EXIT_OK


def run_render(args) -> int:
    key = signing_key()
    path = _existing(args.path) if args.path else REPO_ROOT / "evidence"
    out, refused = Console(highlight=False), 0
    for directory in find_bundles(path):
        name = escape(relative(directory))
        if problems := rerender(directory, key):
            refused += 1
            out.print(f"[red]✗[/] {name}: not rendered", soft_wrap=True)
            for problem in problems:
                out.print(f"    {escape(problem)}", soft_wrap=True)
        else:
            out.print(f"[green]✓[/] {name}: reports rendered again", soft_wrap=True)
    return EXIT_FAILED if refused else EXIT_OK


def run_diff(args) -> int:
    try:
        text = render_markdown(evidence_diff(args.base, args.head), args.base, args.head,
                               contract_changes(args.base, args.head))
    except DiffError as e:
        raise UsageError(str(e)) from None
    Console(highlight=False, soft_wrap=True).print(text, markup=False)
    if args.out:
        args.out.write_text(text)
    return EXIT_OK


def run_agree(args) -> int:
    if not 0 <= args.slack < 1:
        raise UsageError(f"--slack: {args.slack} is not a fraction in [0, 1)")
    try:
        result = agreement(args.committed, args.rerun, args.slack)
    except DiffError as e:
        raise UsageError(str(e)) from None
    text = render_agreement(result, args.committed, args.rerun, args.slack)
    Console(highlight=False, soft_wrap=True).print(text, markup=False)
    if args.out:
        args.out.write_text(text)
    return EXIT_OK if result.agrees else EXIT_FAILED


def run_decode(args) -> int:
    try:
        bundle = decode.from_records(args.records)
    except decode.DecodeError as e:
        raise UsageError(str(e)) from None
    out = decode.write(bundle, args.out or REPO_ROOT / "evidence" / "decode" / bundle.arch)
    Console(highlight=False).print(f"wrote {relative(out)}: {len(bundle.layers)} layer rows, {len(bundle.steps)} step "
                                   f"rows, {len(bundle.sources)} sources covered", markup=False)
    return EXIT_OK
