"""Inline SVG bar charts for the HTML report: no plotting library, no external files, crisp at any zoom."""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#2563eb", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2")
WIDTH, HEIGHT = 640, 320
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 58, 44
CHAR_W = 6.0  # approximate width of an 11 px legend character


def nice_step(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above `value`."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= value * (1 - 1e-9))


def bar_chart(title: str, categories: list[str], series: dict[str, list[float | None]], *, y_label: str,
              lines: list[tuple[float, str]] = (), value_format: str = "{:.2f}", x_label: str = "batch size") -> str:
    """Grouped bars: one group per category (batch size), one colored bar per series (shape), with dashed
    horizontal reference lines (e.g. the required speedup). Missing values leave a gap."""
    values = [v for vs in series.values() for v in vs if v is not None]
    highest = max(values + [v for v, _ in lines] + [0.0]) * 1.08
    step = nice_step(highest / 4)
    top = step * max(1, math.ceil(highest / step))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def y(v: float) -> float:
        return TOP + plot_h * (1 - v / top)

    group_w = plot_w / max(len(categories), 1)
    bar_w = min(44.0, group_w * 0.8 / max(len(series), 1))
    out = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
           f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
           f'<text x="{LEFT}" y="20" class="chart-title">{escape(title)}</text>']
    legend_x = LEFT
    for s, name in enumerate(series):
        out.append(f'<rect x="{legend_x:.1f}" y="31" width="10" height="10" fill="{PALETTE[s % len(PALETTE)]}" rx="2"/>'
                   f'<text x="{legend_x + 14:.1f}" y="40" class="legend">{escape(name)}</text>')
        legend_x += 28 + CHAR_W * len(name)
    for i in range(round(top / step) + 1):
        v = step * i
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
                   f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" class="tick" text-anchor="end">{v:g}</text>')
    for g, category in enumerate(categories):
        x0 = LEFT + g * group_w + (group_w - bar_w * len(series)) / 2
        for s, (name, vs) in enumerate(series.items()):
            v = vs[g]
            if v is None:
                continue
            x = x0 + s * bar_w
            out.append(f'<rect x="{x + 2:.1f}" y="{y(v):.1f}" width="{bar_w - 4:.1f}" '
                       f'height="{TOP + plot_h - y(v):.1f}" '
                       f'fill="{PALETTE[s % len(PALETTE)]}" rx="2"><title>{escape(name)}, {escape(category)}: '
                       f'{value_format.format(v)}</title></rect>'
                       f'<text x="{x + bar_w / 2:.1f}" y="{y(v) - 4:.1f}" class="value" text-anchor="middle">'
                       f'{value_format.format(v)}</text>')
        out.append(f'<text x="{LEFT + (g + 0.5) * group_w:.1f}" y="{TOP + plot_h + 16}" class="tick" '
                   f'text-anchor="middle">{escape(category)}</text>')
    for v, label in lines:
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="ref"/>'
                   f'<text x="{WIDTH - RIGHT - 4}" y="{y(v) - 4:.1f}" class="ref-label" text-anchor="end">'
                   f'{escape(label)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" class="axis"/>'
               f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" class="axis"/>'
               f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 8}" class="axis-label" text-anchor="middle">'
               f'{escape(x_label)}</text>'
               f'<text transform="translate(14 {TOP + plot_h / 2:.1f}) rotate(-90)" class="axis-label" '
               f'text-anchor="middle">{escape(y_label)}</text></svg>')
    return "".join(out)


def by_batch(rows: list[dict], value: str) -> tuple[list[str], dict[str, list[float | None]]]:
    """Benchmark rows -> (batch sizes as categories, {series: value per batch})."""
    batches = sorted({r["batch"] for r in rows})
    series: dict[str, list[float | None]] = {}
    for r in rows:
        series.setdefault(r["series"], [None] * len(batches))[batches.index(r["batch"])] = r[value]
    return [str(b) for b in batches], series
