"""The decode bundle: `evidence/decode/<arch>/`, what `k3forge bench layer` and `bench step` measured for a whole
decode layer and step, both backends side by side, with the per-op trace tables and plots.

It is made from the JSON records the benches write (`--json`): every record must come from one commit and one
device, and together they name the sha256 of every repository source the runs loaded (dynamic imports included)
and of every contract. Like an op bundle it has a manifest (integrity) and is fresh only while the measured path's
sources (all but the gate tooling under gates/, whose changes are a note) are unchanged; unlike one it judges
nothing: it reports measurements, and the task checks and contracts read only op bundles.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Literal

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from pydantic import BaseModel, ConfigDict, Field

from gates.core.sources import REPO_ROOT, resolve, sha256_file
from gates.evidence.bundle import now, write_bundle
from gates.evidence.plots import bar_chart

KIND = "decode"
TEMPLATES = Path(__file__).with_name("templates")
BACKEND_LABEL = {"auto": "standard (auto)", "latency_specialized": "specialized"}  # the backends evidence may hold


class DecodeError(ValueError):
    """Records that cannot make one bundle (different commits or devices, a source hashed two ways); names the file."""


class DecodeBundle(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["decode"] = KIND
    schema_version: Literal[1] = 1
    arch: str
    created: str
    commit: str | None
    environment: dict
    commands: list[dict] = Field(description="each bench run: command and options")
    sources: dict[str, str] = Field(description="repository path -> sha256 of every source the runs loaded")
    layers: list[dict] = Field(description="bench layer rows (model.kimi_k3.bench.run.LayerRow)")
    steps: list[dict] = Field(description="bench step rows (model.kimi_k3.bench.run.StepRow)")


def is_decode_bundle(directory: Path) -> bool:
    try:
        return json.loads((Path(directory) / "bundle.json").read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def from_records(paths: list[Path]) -> DecodeBundle:
    """One bundle from bench records; an error naming the file where they disagree."""
    if not paths:
        raise DecodeError("no bench records given")
    records = []
    for path in paths:
        try:
            records.append((path, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            raise DecodeError(f"{path}: not a bench record ({e})") from None
    first_path, first = records[0]
    env = first.get("environment", {})
    sources: dict[str, str] = {}
    for path, rec in records:
        other = rec.get("environment", {})
        for key in ("commit", "device", "arch"):
            if other.get(key) != env.get(key):
                raise DecodeError(f"{path}: environment.{key} {other.get(key)!r} differs from {first_path}'s "
                                  f"{env.get(key)!r}: one bundle holds one commit on one device")
        other_backends = {row.get("backend") for row in rec.get("rows", [])} - set(BACKEND_LABEL)
        if other_backends:  # `declared` rows time kernels no gate has validated on this arch
            raise DecodeError(f"{path}: rows of backend {', '.join(map(repr, sorted(other_backends, key=str)))}: "
                              f"only {' and '.join(BACKEND_LABEL)} rows can be evidence (bench with --backend both)")
        for src, digest in rec.get("sources", {}).items():
            if sources.setdefault(src, digest) != digest:
                raise DecodeError(f"{path}: sources.{src} was hashed differently by another record")
    return DecodeBundle(arch=env.get("arch") or "unknown", created=now(), commit=env.get("commit"), environment=env,
                        commands=[{"command": r["command"], "options": r.get("options", {})} for _, r in records],
                        sources=dict(sorted(sources.items())),
                        layers=[row for _, r in records if r["command"] == "layer" for row in r["rows"]],
                        steps=[row for _, r in records if r["command"] == "step" for row in r["rows"]])


# The gate tooling that launched the benches and renders their records (the CLI, the gate, the evidence code): its
# hashes are recorded, but a change there cannot change what ran or how it was timed (the benches, the dispatcher,
# the timing and every kernel live under model/ and kernels/; what ran is in the rows), so, as for an op bundle
# judged by other gate code, it is a note and not staleness.
TOOLING = "gates/"
CONTRACTS = "contracts"  # the directory the specialized path loads its kernels' contracts from


def _changed(bundle: DecodeBundle, root: Path) -> list[tuple[str, str]]:
    """(path, why) for each recorded source that is gone or hashes differently now, and each contract the runs did not
    read: the specialized path runs every kernel whose contract validates the arch, so a contract added since changes
    what the measured path would run (a hash of the files that were there cannot see it)."""
    changed = []
    for path, digest in bundle.sources.items():
        file = resolve(path, root)
        if not file.is_file():
            changed.append((path, "no longer exists"))
        elif sha256_file(file) != digest:
            changed.append((path, "changed since the measurements were made"))
    if any(path.startswith(f"{CONTRACTS}/") for path in bundle.sources):
        for file in sorted((root / CONTRACTS).glob("*.yaml")):
            path = f"{CONTRACTS}/{file.name}"
            if path not in bundle.sources:
                changed.append((path, "is a contract added since the measurements were made"))
    return changed


def check_freshness(bundle: DecodeBundle, root: Path = REPO_ROOT) -> list[str]:
    """Stale where a source of the measured path (everything recorded outside TOOLING) changed or is gone."""
    return [f"stale: {path} {why}" for path, why in _changed(bundle, root) if not path.startswith(TOOLING)]


def tooling_note(bundle: DecodeBundle, root: Path = REPO_ROOT) -> str | None:
    """A note when the gate tooling recorded with the measurements differs from this tree's; not staleness."""
    changed = [path for path, _ in _changed(bundle, root) if path.startswith(TOOLING)]
    if not changed:
        return None
    return (f"launched and rendered by gate tooling that differs from this tree's ({len(changed)} file(s) under "
            f"{TOOLING}, e.g. {changed[0]}); the measured path is unchanged")


def _series(row: dict) -> str:
    """A layer row's series in the plots: its backend, whether its time includes the TP collectives (a bench with
    --collectives records both rows at one batch; one series would keep only the last) and an fp8 MLA cache."""
    label = BACKEND_LABEL.get(row["backend"], row["backend"])
    if row.get("kv_cache", "auto") != "auto":
        label = f"{label}, {row['kv_cache']} MLA cache"
    return label if row.get("collectives", "excluded") == "excluded" else f"{label} + collectives"


def _plots(bundle: DecodeBundle) -> dict[str, Markup]:
    """µs per layer by batch (standard, specialized, floor), one chart per layer kind and TP; per-op time at each
    batch for both backends; the step's tokens/s."""
    plots = {}
    groups = defaultdict(list)
    for r in bundle.layers:
        groups[(r["kind"], r["tp"])].append(r)
    for (kind, tp), rows in sorted(groups.items()):
        batches = sorted({r["batch"] for r in rows})
        series: dict[str, list] = {}
        floor: list = [None] * len(batches)
        for r in rows:
            if r["us"] is None:
                continue
            series.setdefault(_series(r), [None] * len(batches))[batches.index(r["batch"])] = r["us"]
            floor[batches.index(r["batch"])] = r["floor_us"]
        if series:
            series["floor"] = floor
            plots[f"layer {kind} TP{tp}"] = Markup(bar_chart(
                f"{kind.upper()} layer, TP{tp}: µs per layer in-pipeline", [str(b) for b in batches], series,
                y_label="µs per layer", value_format="{:.0f}"))
        for batch in batches:
            at = [r for r in rows if r["batch"] == batch and r["ops"]]
            ops = sorted({op for r in at for op in r["ops"]}, key=lambda op: -max(r["ops"].get(op, {}).get("us", 0)
                                                                                 for r in at))
            if not ops:
                continue
            per_op = {_series(r): [r["ops"].get(op, {}).get("us") for op in ops] for r in at}
            plots[f"ops {kind} TP{tp} batch {batch}"] = Markup(bar_chart(
                f"{kind.upper()} layer, TP{tp}, batch {batch}: kernel µs per op", ops, per_op, y_label="µs",
                value_format="{:.1f}", x_label="op"))
    steps = [r for r in bundle.steps if r["tokens_per_s"] is not None]
    if steps:
        cats = sorted({(r["batch"], r["spec_tokens"]) for r in steps})
        series = {}
        for r in steps:
            series.setdefault(BACKEND_LABEL.get(r["backend"], r["backend"]), [None] * len(cats))[
                cats.index((r["batch"], r["spec_tokens"]))] = r["tokens_per_s"]
        plots["step"] = Markup(bar_chart("Whole step: tokens/s (accepted, in speculative mode)",
                                         [f"b{b}" + (f" K{k}" if k else "") for b, k in cats], series,
                                         y_label="tokens/s", value_format="{:.0f}", x_label="batch, draft tokens"))
    return plots


def floors(rows: list[dict]) -> str:
    """A sentence naming the bandwidth the rows' floors are at: each distinct figure with its source (measured on which
    device, or declared for which arch). Rows recorded before the bench recorded it (older bundles) were at their
    arch's declared figure."""
    def figure(r: dict) -> str:
        if not r.get("floor_bandwidth_Bps"):
            return "the arch's declared copy bandwidth (not recorded in these rows)"
        return f"{r['floor_bandwidth_Bps'] / 1e12:.2f} TB/s (copy bandwidth {r.get('floor_bandwidth_source')})"
    return f"Floors at {'; '.join(dict.fromkeys(map(figure, rows)))}."


def block_tables(rows: list[dict]) -> list[dict]:
    """Per point of a layer kind (TP, batch, MLA cache, collectives) whose rows carry a per-block breakdown (older
    records have none): each block's µs per layer under the standard and the specialized backend (the eager trace's
    sums; and in-pipeline where the block was timed alone, the FFN's: `us_in_pipeline`), the speedups, and the bytes
    its op calls must move with their floor (the specialized row's where there is one; the ops' cost models count what
    the layer must move, whichever backend moves it). `piped` says whether any block of the table was timed alone."""
    points: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r.get("blocks"):
            point = (r["tp"], r["batch"], r.get("kv_cache", "auto"), r.get("collectives", "excluded"))
            points[point][r["backend"]] = r
    tables = []
    for (tp, batch, kv_cache, collectives), by_backend in points.items():
        std, spec = by_backend.get("auto"), by_backend.get("latency_specialized")
        shown = spec or std

        def us(r: dict | None, block: str, key: str = "us") -> float | None:
            return r["blocks"].get(block, {}).get(key) if r else None

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        blocks = [{"block": block, "standard_us": us(std, block), "specialized_us": us(spec, block),
                   "speedup": ratio(us(std, block), us(spec, block)),
                   "standard_piped_us": us(std, block, "us_in_pipeline"),
                   "specialized_piped_us": us(spec, block, "us_in_pipeline"),
                   "piped_speedup": ratio(us(std, block, "us_in_pipeline"), us(spec, block, "us_in_pipeline")),
                   **{key: shown["blocks"].get(block, {}).get(key) for key in ("bytes", "floor_us")}}
                  for block in dict.fromkeys(b for r in (std, spec) if r for b in r["blocks"])]
        title = (f"TP{tp}, batch {batch}" + (f", {kv_cache} MLA cache" if kv_cache != "auto" else "")
                 + (f", with the collectives ({collectives})" if collectives != "excluded" else ""))
        tables.append({"title": title, "blocks": blocks,
                       "piped": any(b["standard_piped_us"] or b["specialized_piped_us"] for b in blocks)})
    return tables


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html.j2"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(num=lambda v, spec=".1f": "–" if v is None else format(v, spec),
                       pct=lambda v: "–" if v is None else f"{v:.0%}", backend=lambda b: BACKEND_LABEL.get(b, b),
                       by_time=lambda ops: sorted(ops.items(), key=lambda item: -item[1]["us"]), floors=floors,
                       block_tables=block_tables)
    return env


def render_reports(bundle: DecodeBundle) -> dict[str, str]:
    context = {"b": bundle, "plots": _plots(bundle)}
    env = _env()
    return {"report.md": env.get_template("decode_report.md.j2").render(**context),
            "report.html": env.get_template("decode_report.html.j2").render(**context)}


def write(bundle: DecodeBundle, directory: Path) -> Path:
    return write_bundle(directory, bundle, render_reports(bundle))


def load(directory: Path) -> DecodeBundle:
    return DecodeBundle.model_validate_json((Path(directory) / "bundle.json").read_text())
