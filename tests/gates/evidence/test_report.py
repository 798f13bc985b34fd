"""The report a reviewer reads: Markdown and HTML from one bundle, plots inline, rendered by a real browser."""

import json
import re
import shutil
import subprocess

import pytest

from gates.core.status import GateResult, Status
from gates.evals.result import Check, EvalResult, Plot, Table
from gates.evidence.plots import bar_chart, by_batch, nice_step
from gates.evidence.report import render_html, render_markdown
from tests.gates.fixtures.helpers import rejudged

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                                    "(apt-get install -y chromium); the report is then checked without a browser")


def test_markdown_says_what_ran_and_what_did_not(gated):
    _, out = gated
    text = (out / "kda_decode" / "cpu" / "report.md").read_text()
    # the fixture's eval model never enters its envelope: evals, required on cpu, did not run, so nothing is PASSED
    assert text.startswith("# kda_decode on cpu: NOT_RUN (not judged: 1 gate(s) required on cpu did not run)")
    assert "- **Compile**: torch backend: nothing to compile (not required on cpu)" in text
    assert "- **Benchmarks**: needs a CUDA GPU; this machine has none (not required on cpu)" in text
    assert ("- **Model-level evals**: the eval model never entered this kernel's envelope (required on cpu: the "
            "verdict cannot be PASSED without it)") in text
    assert "| outputs share no memory with inputs | ✓ | 0 |" in text
    # every batch of 1-8 ran: the drawn points' and the sweep's, the runs of consecutive values written as ranges
    assert "Envelope covered: batch 1–8: 1–8;" in text
    assert re.search(r"Batch sweep: one mixed input at each of \d more batches \([\d–, ]+\) at heads 2 · head_dim 16 · "
                     r"bf16, each run \d times: ✓ every one passed\.", text), text


def test_benchmarks_render_as_plots_and_tables(gpu_like_bundle):
    html = render_html(gpu_like_bundle)
    bench = html[html.index('id="gate-benchmarks"'):html.index('id="gate-evals"')]
    assert bench.count("<svg") == 2  # speedup and fraction of the roofline, per batch size
    assert "Speedup over the standard implementation" in html and "Fraction of the roofline" in html
    assert "required 1.5×" in html
    md = render_markdown(gpu_like_bundle)
    assert re.search(r"\| batch 64 · heads 12 · head_dim 128 · bf16 \| [\d.]+ µs ± [\d.]+ \| [\d.]+ µs ± [\d.]+ "
                     r"\(alone [\d.]+ µs\) \|", md)  # the standard beside the candidate, and alone
    assert re.search(r"± [\d.]+, alone [\d.]+ µs</span>", bench)
    # a drawn point is marked, and left out of the plots (no bar of the contract's; new ones every run)
    assert "| batch 17 · heads 12 · head_dim 128 · bf16 (drawn) |" in md and ">drawn</span>" in bench
    assert "a drawn point is one the contract admits besides its own" in md
    assert 'text-anchor="middle">17</text>' not in bench and 'text-anchor="middle">33</text>' in bench
    clock = ("SM clock at the start of the timed sessions: 1965 MHz in the candidate's process, 1980 MHz with the "
             "standard alone (the GPU's maximum 1980 MHz).")
    assert clock in md and clock in bench
    roofline = ("Roofline: 4.25e+12 B/s (the arch's declared figure 4.3e+12 B/s), 7.9e+14 FLOP/s (copy bandwidth "
                "measured in this process on NVIDIA H200)")
    assert roofline in md and roofline in bench


def test_a_bundle_from_before_the_bandwidth_was_measured_shows_its_declared_peaks(gpu_like_bundle):
    bench = next(g for g in gpu_like_bundle.gates if g.gate == "benchmarks")
    old = bench.model_copy(update={"details": {**bench.details, "peaks": {"mem_bw_Bps": 4.3e12, "flops": 790e12,
                                                                          "source": "declared"}}})
    bundle = rejudged(gpu_like_bundle, [old if g.gate == "benchmarks" else g for g in gpu_like_bundle.gates])
    roofline = "Roofline: 4.3e+12 B/s, 7.9e+14 FLOP/s (declared)"
    assert roofline in render_markdown(bundle) and roofline in render_html(bundle)


def test_a_plugged_in_gate_renders_without_its_own_template(gpu_like_bundle):
    evals = GateResult(gate="evals_structured_output", title="Structured output", status=Status.FAILED_EVAL,
                       reason="JSON validity 91% with the kernel, 99% without", summary="validity dropped",
                       details={"valid_with": 0.91, "valid_without": 0.99})
    gates = [*gpu_like_bundle.gates, evals]
    bundle = rejudged(gpu_like_bundle, gates)
    assert bundle.verdict is Status.FAILED_EVAL
    html = render_html(bundle)
    assert "JSON validity 91% with the kernel" in html and "valid_without" in html
    assert '"valid_with": 0.91' in render_markdown(bundle)


def test_a_gate_that_raised_renders_its_traceback_not_its_template(gpu_like_bundle):
    """A gate that raised carries only the traceback (gates/core/runner.py): its own template's fields are
    absent, and the report still renders, with the traceback."""
    raised = GateResult(gate="compile", title="Compile", status=Status.ERROR, reason="RuntimeError: boom",
                        summary="the gate raised", details={"traceback": "Traceback ...\nRuntimeError: boom"})
    gates = [raised if g.gate == "compile" else g for g in gpu_like_bundle.gates]
    bundle = rejudged(gpu_like_bundle, gates)
    assert bundle.verdict is Status.ERROR
    assert "RuntimeError: boom" in render_markdown(bundle) and "RuntimeError: boom" in render_html(bundle)


def test_evals_render_as_checks_tables_and_plots(gpu_like_bundle):
    drift = Plot(title="max logit drift from the reference", x_label="context tokens", y_label="max |dlogit|",
                 categories=["4096", "131072"], series={"candidate": [2.37, float("nan")], "standard": [2.30, 2.21]},
                 bound=7.59)
    result = EvalResult.from_checks(
        "long_context", [Check.at_most("max logit drift", 2.37, 7.59, "tightest bucket: 4096 tokens")],
        tables=[Table(title="per context-length bucket", columns=["context tokens", "cand correct"],
                      rows=[[4096, False], [131072, True]])],
        plots=[drift], notes=["random k3 weights (seed 0)", "on random weights it measures agreement"])
    evals = GateResult(gate="evals", title="Model-level evals", status=Status.PASSED, summary="1/1 evals passed",
                       details={"model": ["random k3 weights (seed 0)"], "paths": "latency_specialized vs reference",
                                "kernel_calls": {"specialized": 262, "standard": 0, "fallbacks": {}},
                                "evals": {"long_context": json.loads(result.model_dump_json())}})
    gates = [g for g in gpu_like_bundle.gates if g.gate != "evals"] + [evals]
    bundle = gpu_like_bundle.model_copy(update={"gates": gates})
    html = render_html(bundle)
    section = html[html.index('id="gate-evals"'):]
    assert '<tr data-check="max logit drift">' in section and '"checks"' not in section  # a table, not a JSON dump
    (svg,) = re.findall(r"<svg.*?</svg>", section, re.S)
    assert "max logit drift from the reference" in svg and ">bound<" in svg
    assert svg.count("<rect") == 3 + 2  # three bars (the NaN is a gap), two legend swatches
    assert section.count("random k3 weights (seed 0)") == 1  # the model line, not again in the eval's notes
    md = render_markdown(bundle)
    assert "| max logit drift | ✓ | 2.37 | 7.59 | tightest bucket: 4096 tokens |" in md
    assert "| 131072 | ✓ |" in md and "- on random weights it measures agreement" in md


def test_flags_are_shown_first(gpu_like_bundle):
    flagged = gpu_like_bundle.gates[-1].model_copy(update={"flags": ["batch 1: 14.0× over the standard"]})
    bundle = gpu_like_bundle.model_copy(update={"gates": [*gpu_like_bundle.gates[:-1], flagged]})
    html = render_html(bundle)
    assert html.index("Look at these first") < html.index('id="gates"')


@pytest.mark.parametrize("value, step", [(0.3, 0.5), (1.0, 1.0), (1.01, 2.0), (2.3, 2.5), (7, 10), (130, 200)])
def test_nice_step(value, step):
    assert nice_step(value) == step


def test_bar_chart_leaves_gaps_for_missing_values():
    rows = [{"batch": 1, "series": "heads 12", "speedup": 2.0}, {"batch": 64, "series": "heads 6", "speedup": 1.5}]
    categories, series = by_batch(rows, "speedup")
    assert categories == ["1", "64"] and series == {"heads 12": [2.0, None], "heads 6": [None, 1.5]}
    svg = bar_chart("t", categories, series, y_label="×", lines=[(1.2, "required")])
    assert svg.count("<rect") == 2 + 2  # two bars, two legend swatches


@needs_chromium
def test_report_renders_in_headless_chromium(gpu_like_bundle, tmp_path):
    page = tmp_path / "report.html"
    html = render_html(gpu_like_bundle)
    page.write_text(html)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert re.search(r'id="verdict" data-status="SLOWER"', dom)
    # the benchmarks' two plots and the CPU evals' (sampling's TV, long context's drift and state error)
    assert dom.count("<svg") == html.count("<svg") == 5 and dom.count('data-gate="') == 5
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120,
                   check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# Written into the page after layout: what a reader at 1280 px would find clipped.
CLIPPED = """<script>window.addEventListener('load', () => {
  const found = [];
  document.querySelectorAll('section').forEach(s => {
    if (s.scrollWidth > s.clientWidth + 1) found.push('section ' + s.id + ' wider than the page'); });
  document.querySelectorAll('table').forEach((t, i) => {
    if (!t.parentElement.classList.contains('scroll')) found.push('table ' + i + ' outside a scroll box'); });
  const wide = [...document.querySelectorAll('.scroll')].filter(d => d.scrollWidth > d.clientWidth + 1).length;
  const out = document.createElement('pre');
  out.id = 'clipped';
  out.textContent = JSON.stringify({found, wide});
  document.body.appendChild(out);
});</script>"""


@needs_chromium
def test_wide_tables_scroll_in_their_own_box(gpu_like_bundle, tmp_path):
    """A table wider than the page (the benchmarks' and numerics' rows are) scrolls under itself, its last column
    reachable, instead of widening its section past the page, where the last column was cut off at 1280 px."""
    page = tmp_path / "report.html"
    page.write_text(render_html(gpu_like_bundle).replace("</body>", CLIPPED + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=800,2000", "--virtual-time-budget=5000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    report = json.loads(re.search(r'<pre id="clipped">(.*?)</pre>', dom).group(1))
    assert report["found"] == [] and report["wide"] > 0, report
