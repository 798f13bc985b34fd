"""Whether an independent re-run of the gate agrees with the committed evidence.

CI's GPU job gates the tree again with a fresh secret seed on its own machine. A committed bundle made by a
tampered run, or one that only passed by luck of the draw, shows here as a re-run that disagrees: another verdict
or gate status, a speedup outside what the two runs' timing noise allows, another kernel count. Bundles are
compared by op and arch; those only one side has (a runner of another arch re-runs nothing committed for this one),
and re-run bundles equal to the committed ones (not made again: the re-run's folder starts as the tree's), are
listed, not judged.

Speedups agree when their 95 % intervals overlap or they differ by at most `slack` (two machines of one kind
differ by a few percent in clocks and memory: the intervals only know one machine's noise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gates.evidence.diff import BUNDLE, DiffError, gate_of, timed_points

SLACK = 0.05


def bundles_in(directory: Path) -> dict[tuple[str, str], dict]:
    """{(op, arch): bundle} of an evidence folder (`<op>/<arch>/bundle.json`)."""
    if not directory.is_dir():
        raise DiffError(f"{directory}: no such directory")
    found = {}
    for path in sorted(directory.glob(f"*/*/{BUNDLE}")):
        try:
            found[(path.parent.parent.name, path.parent.name)] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DiffError(f"{path}: not a readable bundle ({type(e).__name__}: {e})") from None
    return found


def _speedups_agree(a: float | None, a_ci, b: float | None, b_ci, slack: float) -> bool:
    if a is None or b is None:
        return a is b
    overlap = bool(a_ci and b_ci) and a_ci[0] <= b_ci[1] and b_ci[0] <= a_ci[1]
    return overlap or abs(b - a) <= slack * abs(a)


@dataclass
class Comparison:
    op: str
    arch: str
    problems: list[str] = field(default_factory=list)  # each a disagreement, one line
    points: list[dict] = field(default_factory=list)  # per benchmark point: both runs' figures and the call


def compare(committed: dict, rerun: dict, op: str, arch: str, slack: float = SLACK) -> Comparison:
    c = Comparison(op, arch)
    if committed.get("verdict") != rerun.get("verdict"):
        c.problems.append(f"verdict {committed.get('verdict')} committed, {rerun.get('verdict')} re-run")
    for gate in [g.get("gate") for g in committed.get("gates", [])]:
        was, now = gate_of(committed, gate).get("status"), gate_of(rerun, gate).get("status")
        if was != now:
            c.problems.append(f"gate {gate}: {was} committed, {now or 'absent'} re-run")
    was_points, now_points = timed_points(committed), timed_points(rerun)
    for point, row in was_points.items():
        if (again := now_points.get(point)) is None:
            c.problems.append(f"{point}: not timed in the re-run")
            continue
        entry = {"point": point}
        for name, get in (("in-pipeline", lambda r: r), ("one per graph", lambda r: r.get("one_per_graph") or {})):
            a, b = get(row), get(again)
            agrees = _speedups_agree(a.get("speedup"), a.get("speedup_ci"), b.get("speedup"), b.get("speedup_ci"),
                                     slack)
            entry[name] = {"committed": a.get("speedup"), "rerun": b.get("speedup"), "agrees": agrees}
            if not agrees:
                c.problems.append(f"{point}: {name} speedup {_x(a.get('speedup'))} committed "
                                  f"({_interval(a.get('speedup_ci'))}), {_x(b.get('speedup'))} re-run "
                                  f"({_interval(b.get('speedup_ci'))})")
        kernels = [(r.get("kernels") or {}).get("candidate") for r in (row, again)]
        entry["kernels"] = kernels
        if kernels[0] != kernels[1]:
            c.problems.append(f"{point}: {kernels[0]} kernels a call committed, {kernels[1]} re-run")
        c.points.append(entry)
    return c


def _interval(ci) -> str:
    return f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "no interval"


@dataclass
class Agreement:
    compared: list[Comparison]
    committed_only: list[tuple[str, str]]
    rerun_only: list[tuple[str, str]]

    @property
    def agrees(self) -> bool:
        return not any(c.problems for c in self.compared)


def agreement(committed_dir: Path, rerun_dir: Path, slack: float = SLACK) -> Agreement:
    committed, rerun = bundles_in(committed_dir), bundles_in(rerun_dir)
    # a bundle equal to the committed one was not made again (the re-run's folder starts as a copy of the tree)
    rerun = {key: b for key, b in rerun.items() if b != committed.get(key)}
    both = sorted(set(committed) & set(rerun))
    return Agreement([compare(committed[key], rerun[key], *key, slack=slack) for key in both],
                     sorted(set(committed) - set(rerun)), sorted(set(rerun) - set(committed)))


def render_markdown(result: Agreement, committed_dir: Path, rerun_dir: Path, slack: float = SLACK) -> str:
    lines = [f"## Re-run agreement: `{committed_dir}` (committed) against `{rerun_dir}` (re-run)", ""]
    if not result.compared:
        lines += ["Nothing to compare: no op and arch has a bundle on both sides.", ""]
    for c in result.compared:
        lines += [f"### {c.op} / {c.arch}: {'agrees' if not c.problems else 'DISAGREES'}", ""]
        lines += [f"- {p}" for p in c.problems] + ([""] if c.problems else [])
        if c.points:
            lines += ["| point | in-pipeline committed → re-run | one per graph committed → re-run | kernels |",
                      "|---|---|---|---|"]
            for p in c.points:
                cells = []
                for name in ("in-pipeline", "one per graph"):
                    f = p[name]
                    mark = "✓" if f["agrees"] else "✗"
                    cells.append(f"{_x(f['committed'])} → {_x(f['rerun'])} {mark}")
                lines.append(f"| {p['point']} | {cells[0]} | {cells[1]} | {p['kernels'][0]} → {p['kernels'][1]} |")
            lines.append("")
    for title, keys in (("Committed, not re-run here", result.committed_only),
                        ("Re-run, not committed", result.rerun_only)):
        if keys:
            lines += [f"{title}: {', '.join(f'{op}/{arch}' for op, arch in keys)}", ""]
    lines.append(f"Speedups agree when their 95 % intervals overlap or they differ by at most {slack:.0%}.")
    return "\n".join(lines) + "\n"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"
