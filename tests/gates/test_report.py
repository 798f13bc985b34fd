"""The report a reviewer reads: Markdown and HTML from one bundle, plots inline, rendered by a real browser."""

import re
import shutil
import subprocess

import pytest

from gates.plots import bar_chart, by_batch, nice_step
from gates.report import render_html, render_markdown
from gates.status import GateResult, Status, worst

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                                    "(apt-get install -y chromium); the report is then checked without a browser")


def test_markdown_says_what_ran_and_what_did_not(gated):
    _, out = gated
    text = (out / "kda_decode" / "cpu" / "report.md").read_text()
    assert text.startswith("# kda_decode on cpu: PASSED (3 of 5 gates not run here)")
    assert "- **Compile**: torch backend: nothing to compile" in text
    assert "- **Benchmarks**: needs a CUDA GPU; this machine has none" in text
    assert "| outputs share no memory with inputs | ✓ | 0 |" in text


def test_benchmarks_render_as_plots_and_tables(gpu_like_bundle):
    html = render_html(gpu_like_bundle)
    assert html.count("<svg") == 2  # speedup and fraction of the roofline, per batch size
    assert "Speedup over the standard implementation" in html and "Fraction of the roofline" in html
    assert "required 1.5×" in html
    md = render_markdown(gpu_like_bundle)
    assert re.search(r"\| batch 64 · heads 12 · head_dim 128 · bf16 \| [\d.]+ µs ± [\d.]+ \|", md)


def test_a_plugged_in_gate_renders_without_its_own_template(gpu_like_bundle):
    evals = GateResult(gate="evals_structured_output", title="Structured output", status=Status.FAILED_EVAL,
                       reason="JSON validity 91% with the kernel, 99% without", summary="validity dropped",
                       details={"valid_with": 0.91, "valid_without": 0.99})
    gates = [*gpu_like_bundle.gates, evals]
    bundle = gpu_like_bundle.model_copy(update={"gates": gates, "verdict": worst(g.status for g in gates)})
    assert bundle.verdict is Status.FAILED_EVAL
    html = render_html(bundle)
    assert "JSON validity 91% with the kernel" in html and "valid_without" in html
    assert '"valid_with": 0.91' in render_markdown(bundle)


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
    page.write_text(render_html(gpu_like_bundle))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert re.search(r'id="verdict" data-status="SLOWER"', dom)
    assert dom.count("<svg") == 2 and dom.count('data-gate="') == 5
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120,
                   check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
