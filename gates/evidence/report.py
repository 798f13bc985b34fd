"""Render a bundle as report.md and report.html (jinja2 templates in gates/evidence/templates/), the eval report
and the evidence index; `rerender` renders a committed bundle's reports again with this tree's templates.

Each gate's section comes from `templates/gates/<gate>.{md,html}.j2`; a gate without one is shown by `_generic`,
a table of its details.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from gates.core.status import Status, worst
from gates.evidence.bundle import BUNDLE_FILE, Bundle, parse_bundle, write_bundle
from gates.evidence.plots import bar_chart, by_batch
from gates.evidence.signing import KEY_FILE_VAR, KEY_VAR, SIGNATURE_FILE
from gates.evidence.verify import check_integrity, check_signature, off_schema

TEMPLATES = Path(__file__).with_name("templates")
REPORT_MD, REPORT_HTML = "report.md", "report.html"
EVAL_REPORT_MD, EVAL_REPORT_HTML = "eval_report.md", "eval_report.html"
STATUS_CLASS = {Status.PASSED: "pass", Status.NOT_RUN: "skip", Status.SLOWER: "warn"}


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html.j2"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(
        us=lambda v: "–" if v is None else f"{v:,.2f} µs",
        pct=lambda v: "–" if v is None else f"{v:.1%}",
        fraction=lambda v: f"{v:.3%}",
        sci=lambda v: "–" if v is None else f"{v:.3g}",
        short=lambda digest: digest[:12],
        status_class=lambda s: STATUS_CLASS.get(Status(s), "fail"),
        pretty=lambda v: json.dumps(v, indent=2, default=str),
        md_cell=lambda v: str(v).replace("|", "\\|").replace("\n", " "),
        cell=_cell,
        ranges=_ranges,
    )
    return env


def _ranges(values: list[int]) -> str:
    """Sorted integers as runs: [1, 2, 3, 5, 7, 8] reads "1–3, 5, 7–8"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _cell(value) -> str:
    """A table cell of an eval: 4 significant digits, ✓/✗ for booleans, – for nothing."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "✓" if value else "✗"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _plots(bundle: Bundle) -> dict[str, list[Markup]]:
    """SVG plots per gate: speedup and fraction of the roofline per batch size, one bar per shape; per eval
    (key "eval:<name>") the plots it declared."""
    plots: dict[str, list[Markup]] = {}
    bench = next((g for g in bundle.gates if g.gate == "benchmarks" and g.details.get("rows")), None)
    if bench is not None:
        # the contract's points: the drawn ones change every run and have no bar of the contract's to draw
        rows, d = [r for r in bench.details["rows"] if not r.get("drawn")], bench.details
        categories, speedups = by_batch(rows, "speedup")
        charts = [bar_chart("Speedup over the standard implementation", categories, speedups, y_label="speedup (×)",
                            lines=[(d["required_speedup"], f"required {d['required_speedup']:g}×"), (1.0, "1×")],
                            value_format="{:.2f}×")]
        if any(r["roofline_fraction"] is not None for r in rows):
            _, fractions = by_batch(rows, "roofline_fraction")
            required = [(d["min_roofline_fraction"], "required")] if d["min_roofline_fraction"] else []
            lines = [(1.0, "roofline")] + required
            charts.append(bar_chart("Fraction of the roofline", categories, fractions, y_label="floor / measured",
                                    lines=lines, value_format="{:.0%}"))
        plots["benchmarks"] = [Markup(c) for c in charts]
    evals = next((g for g in bundle.gates if g.gate == "evals"), None)
    return plots | (_eval_plots(evals.details.get("evals", {})) if evals else {})


def _eval_plots(evals: dict[str, dict]) -> dict[str, list[Markup]]:
    """Each eval's declared plots, keyed "eval:<name>", from its JSON result."""
    return {f"eval:{name}": [Markup(_eval_chart(p)) for p in result.get("plots", [])] for name, result in evals.items()}


def _eval_chart(plot: dict) -> str:
    """An eval's Plot (gates.evals.result) as bars; a NaN or infinite value (a string in the JSON) leaves a gap."""
    series = {name: [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]
              for name, values in plot["series"].items()}
    lines = [(plot["bound"], "bound")] if plot.get("bound") is not None else []
    return bar_chart(plot["title"], plot["categories"], series, y_label=plot["y_label"], x_label=plot["x_label"],
                     lines=lines, value_format="{:.3g}")


def _context(bundle: Bundle) -> dict:
    return {"b": bundle, "verdict": bundle.verdict, "plots": _plots(bundle), "Status": Status}


def render_markdown(bundle: Bundle) -> str:
    return _env().get_template("report.md.j2").render(**_context(bundle))


def render_html(bundle: Bundle) -> str:
    return _env().get_template("report.html.j2").render(**_context(bundle))


def render_reports(bundle: Bundle) -> dict[str, str]:
    return {REPORT_MD: render_markdown(bundle), REPORT_HTML: render_html(bundle)}


def render_eval_report(subject: dict, results: list[dict], command: str) -> dict[str, str]:
    """`k3forge eval --report`: {file name: text} of the evals run on `subject` (its JSON results), laid out as
    the evals gate's section of an evidence report."""
    status = worst(Status(r["status"]) for r in results)
    evals = {r["name"]: r for r in results}
    g = {"details": {"model": subject["notes"], "paths": f"{subject['candidate']} vs {subject['reference']}",
                     "kernel_calls": {}, "evals": evals}}
    context = {"subject": subject, "verdict": status.value, "g": g, "plots": _eval_plots(evals), "command": command}
    env = _env()
    return {name: env.get_template(f"eval_report.{kind}.j2").render(**context)
            for name, kind in ((EVAL_REPORT_MD, "md"), (EVAL_REPORT_HTML, "html"))}


def render_index(rows: list[dict]) -> str:
    return _env().get_template("index.md.j2").render(rows=rows)


def rerender(directory: Path, key: bytes | None = None) -> list[str]:
    """Render the reports of the bundle at `directory` again from its bundle.json with this tree's templates,
    atomically; nothing measured or judged changes. Refused (the reasons returned, nothing written) unless the
    bundle is intact and this schema writes its bundle.json back byte for byte. A signed bundle stays signed: it
    needs `key`, which must match its signature; an unsigned one stays unsigned (signing it now would vouch for
    whatever it holds)."""
    directory = Path(directory)
    signed = (directory / SIGNATURE_FILE).exists()
    if signed and key is None:
        return [f"{directory / SIGNATURE_FILE}: the bundle is signed, and rendering it again rewrites the manifest "
                f"the signature covers: set {KEY_VAR} or {KEY_FILE_VAR}"]
    if problems := check_integrity(directory) + check_signature(directory, key if signed else None, required=False):
        return problems
    path = directory / BUNDLE_FILE
    text = path.read_text()
    try:
        bundle = parse_bundle(text)
    except ValueError as e:
        return [off_schema(path, e)]
    if bundle.model_dump_json(indent=2) + "\n" != text:
        return [f"{path}: this tree's bundle schema would not write it back unchanged; re-run the gate instead"]
    write_bundle(directory, bundle, render_reports(bundle), key if signed else None)
    return []
