"""What changed between two commits' evidence: per op and arch, the verdict and every gate's status, per-point
speedups with their intervals (both timings), fractions of the floor, kernel counts, registers and spills, the
envelope and tolerances the bundle was judged by, and the eval figures; points and bundles added or removed.

A reviewer of a kernel change reads this instead of two whole reports; `task check` renders it into the pull
request summary. Bundles are read from git (`git show REV:evidence/<op>/<arch>/bundle.json`), or from the working
tree for HEAD = None.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from model.kimi_k3.ops.registry import REPO_ROOT

BUNDLE = "bundle.json"


class DiffError(ValueError):
    """A revision git does not know, or a bundle that does not parse; names the revision and the file."""


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode:
        raise DiffError(f"git {' '.join(args)}: {done.stderr.strip() or 'failed'}")
    return done.stdout


def bundles_at(rev: str | None, root: Path = REPO_ROOT) -> dict[tuple[str, str], dict]:
    """{(op, arch): bundle} at a revision (None: the working tree)."""
    found = {}
    if rev is None:
        paths = [p.relative_to(root).as_posix() for p in (root / "evidence").glob(f"*/*/{BUNDLE}")]
    else:
        _git(root, "rev-parse", "--verify", f"{rev}^{{commit}}")
        paths = [p for p in _git(root, "ls-tree", "-r", "--name-only", rev, "--", "evidence").split()
                 if p.endswith(f"/{BUNDLE}") and p.count("/") == 3]
    for path in paths:
        _, op, arch, _ = path.split("/")
        text = (root / path).read_text() if rev is None else _git(root, "show", f"{rev}:{path}")
        try:
            found[(op, arch)] = json.loads(text)
        except ValueError as e:
            raise DiffError(f"{rev or 'working tree'}:{path}: not JSON ({e})") from None
        if not isinstance(found[(op, arch)], dict):
            raise DiffError(f"{rev or 'working tree'}:{path}: not a bundle (a JSON object)")
    return found


@dataclass
class BundleDiff:
    op: str
    arch: str
    change: str  # "added", "removed", "changed", "unchanged"
    verdict: tuple[str | None, str | None]
    gates: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # only gates whose status moved
    points: list[dict] = field(default_factory=list)  # per benchmark point: base and head figures
    compile: list[dict] = field(default_factory=list)  # per kernel config: registers / spills that moved
    contract: list[Move] = field(default_factory=list)  # judged contract values that moved (contract_moves)
    evals: dict[str, tuple] = field(default_factory=dict)  # eval metrics that moved
    # (base, head) device names and the copy bandwidths (bytes/s) their floors were at, where the two differ: each
    # speedup is its own run's (candidate and standard side by side), but the times and the fractions of the floor
    # then compare two machines
    devices: tuple[str | None, str | None] | None = None
    bandwidths: tuple[float | None, float | None] | None = None


def gate_of(bundle: dict | None, name: str) -> dict:
    for g in (bundle or {}).get("gates", []):
        if g.get("gate") == name:
            return g
    return {}


def timed_points(bundle: dict | None) -> dict[str, dict]:
    """The contract's benchmark points by label; drawn points (drawn anew each gate run) have nothing to compare."""
    rows = gate_of(bundle, "benchmarks").get("details", {}).get("rows", [])
    return {r["point"]: r for r in rows if not r.get("drawn")}


def _device(bundle: dict | None) -> str | None:
    return ((bundle or {}).get("environment") or {}).get("device_name")


def _bandwidth(bundle: dict | None) -> float | None:
    """The copy bandwidth the bundle's floors were computed at (measured on its device, or the arch's declared)."""
    return ((gate_of(bundle, "benchmarks").get("details") or {}).get("peaks") or {}).get("mem_bw_Bps")


def _figures(row: dict | None) -> dict | None:
    if row is None:
        return None
    one = row.get("one_per_graph") or {}
    return {"speedup": row.get("speedup"), "ci": row.get("speedup_ci"),
            "candidate_us": row.get("candidate", {}).get("median_us"),
            "standard_us": row.get("standard", {}).get("median_us"),
            "fraction": row.get("roofline_fraction"), "kernels": (row.get("kernels") or {}).get("candidate"),
            "one_per_graph_speedup": one.get("speedup")}


def _compiles(bundle: dict | None) -> dict[str, tuple[int, int]]:
    out = {}
    for c in gate_of(bundle, "compile").get("details", {}).get("compiles", []):
        for k in c.get("kernels", []):
            out[f"{c['arch']} {c['key']}"] = (k.get("registers"), k.get("spill_bytes"))
    return out


def _eval_metrics(bundle: dict | None) -> dict[str, float]:
    out = {}
    for name, ev in gate_of(bundle, "evals").get("details", {}).get("evals", {}).items():
        for metric, value in (ev.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{name}.{metric}"] = value
    return out


@dataclass(frozen=True)
class Move:
    """One judged value of a contract that differs between two revisions, and whether more now passes."""

    contract: str  # the op (contracts/<op>.yaml)
    path: str | None  # the value's dotted path, e.g. tolerance.atol; None: the whole contract added or removed
    base: object
    head: object
    loosened: bool

    @property
    def name(self) -> str:
        """How a pull request names it: <op>.<path>."""
        return f"{self.contract}.{self.path}" if self.path else self.contract


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _looser(base, head, higher_is_looser: bool) -> bool:
    """A bound that moved so that more passes. No bound before: any bound now is tighter. A bound removed, or one
    that is not a number, counts as looser."""
    if base is None:
        return False
    if not (_is_number(base) and _is_number(head)):
        return True
    return head > base if higher_is_looser else head < base


def _point_key(p: dict) -> str:
    shape = "".join(f",{k}={v}" for k, v in sorted((p.get("shape") or {}).items()))
    return f"batch={p.get('batch')},spec_tokens={p.get('spec_tokens', 0)}{shape}"


def contract_moves(op: str, base: dict, head: dict) -> list[Move]:
    """Every judged value of a contract that moved from `base` to `head` (contracts as dumped with their defaults,
    `Contract.model_dump(mode="json")`, so that deleting a line that held a stricter value than the default shows):
    the reference and standard (another judge or baseline: the bar moved, which way is unknown), the validated
    archs and devices, the envelope (TP sizes, batch, spec tokens, dtypes, shapes), the tolerances (the state's
    own where it has one), the benchmark bars per point (a point dropped is a point no longer measured) and the
    resource limits. Loosened: more passes at head than at base."""
    moves: list[Move] = []

    def add(path: str, b, h, looser: bool) -> None:
        if b != h:
            moves.append(Move(op, path, b, h, looser))

    for f in ("reference", "standard"):
        add(f, base.get(f), head.get(f), True)

    def archs(c: dict, kind: str) -> dict[str, list[str]]:
        return {hw.get("arch"): sorted(hw.get("devices") or []) for hw in (c.get("hardware") or {}).get(kind, [])}

    vb, vh = archs(base, "validated"), archs(head, "validated")
    for arch in sorted(set(vb) | set(vh), key=str):
        b, h = vb.get(arch), vh.get(arch)
        add(f"hardware.validated.{arch}", b, h, bool(set(h or ()) - set(b or ())))
    add("hardware.declared", sorted(archs(base, "declared"), key=str), sorted(archs(head, "declared"), key=str), False)
    tb, th = sorted(base.get("tp_sizes") or []), sorted(head.get("tp_sizes") or [])
    add("tp_sizes", tb, th, bool(set(th) - set(tb)))
    for f in ("batch", "spec_tokens"):
        rb, rh = base.get(f) or {}, head.get(f) or {}
        add(f"{f}.min", rb.get("min"), rh.get("min"), _looser(rb.get("min"), rh.get("min"), False))
        add(f"{f}.max", rb.get("max"), rh.get("max"), _looser(rb.get("max"), rh.get("max"), True))
    db, dh = base.get("dtypes") or {}, head.get("dtypes") or {}
    for k in sorted(set(db) | set(dh)):
        add(f"dtypes.{k}", db.get(k), dh.get(k), True)
    sb, sh = base.get("shapes") or {}, head.get("shapes") or {}
    for k in sorted(set(sb) | set(sh)):
        b, h = sb.get(k), sh.get(k)
        add(f"shapes.{k}", b and sorted(b), h and sorted(h), b is not None and (h is None or bool(set(h) - set(b))))
    for f in ("tolerance", "state_tolerance"):
        if f == "state_tolerance" and base.get(f) == head.get(f):
            continue  # both absent: the states are held to `tolerance`, whose moves are listed
        b, h = base.get(f) or base.get("tolerance") or {}, head.get(f) or head.get("tolerance") or {}
        for k in sorted(set(b) | set(h)):
            add(f"{f}.{k}", b.get(k), h.get(k), _looser(b.get(k), h.get(k), k != "min_close_fraction"))
    bb, bh = base.get("benchmark") or {}, head.get("benchmark") or {}
    for k in ("required_speedup", "min_roofline_fraction"):
        add(f"benchmark.{k}", bb.get(k), bh.get(k), _looser(bb.get(k), bh.get(k), False))
    pb = {_point_key(p): p for p in bb.get("points") or []}
    ph = {_point_key(p): p for p in bh.get("points") or []}
    for key in [*pb, *(k for k in ph if k not in pb)]:
        path = f"benchmark.points[{key}]"
        if key not in pb or key not in ph:
            add(path, "measured" if key in pb else None, "measured" if key in ph else None, key not in ph)
            continue
        for k in ("required_speedup", "min_roofline_fraction"):  # the bar at the point: its own, else the default
            add(f"{path}.{k}", pb[key].get(k), ph[key].get(k),
                _looser(pb[key].get(k) or bb.get(k), ph[key].get(k) or bh.get(k), False))
    rb, rh = base.get("resources") or {}, head.get("resources") or {}
    for k in sorted(set(rb) | set(rh)):
        add(f"resources.{k}", rb.get(k), rh.get(k), _looser(rb.get(k), rh.get(k), True))
    return moves


def _moved(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return not math.isclose(a, b, rel_tol=1e-9)
    return a != b


def diff_bundles(base: dict | None, head: dict | None, op: str, arch: str) -> BundleDiff:
    change = "added" if base is None else "removed" if head is None else "changed"
    d = BundleDiff(op, arch, change, ((base or {}).get("verdict"), (head or {}).get("verdict")))
    names = [g.get("gate") for g in (base or {}).get("gates", [])] + \
        [g.get("gate") for g in (head or {}).get("gates", []) if g.get("gate") not in
         {x.get("gate") for x in (base or {}).get("gates", [])}]
    for name in names:
        s = (gate_of(base, name).get("status"), gate_of(head, name).get("status"))
        if s[0] != s[1]:
            d.gates[name] = s
    pb, ph = timed_points(base), timed_points(head)
    for point in list(pb) + [p for p in ph if p not in pb]:
        fb, fh = _figures(pb.get(point)), _figures(ph.get(point))
        if fb != fh:
            d.points.append({"point": point, "base": fb, "head": fh})
    cb, ch = _compiles(base), _compiles(head)
    for key in sorted(set(cb) | set(ch)):
        if cb.get(key) != ch.get(key):
            d.compile.append({"config": key, "base": cb.get(key), "head": ch.get(key)})
    if base is not None and head is not None:
        d.contract = contract_moves(op, base.get("contract") or {}, head.get("contract") or {})
    eb, eh = _eval_metrics(base), _eval_metrics(head)
    for k in sorted(set(eb) | set(eh)):
        if _moved(eb.get(k), eh.get(k)):
            d.evals[k] = (eb.get(k), eh.get(k))
    if base is not None and head is not None and _device(base) != _device(head) and (pb or ph):  # timed only
        d.devices, d.bandwidths = (_device(base), _device(head)), (_bandwidth(base), _bandwidth(head))
    if change == "changed" and not (d.gates or d.points or d.compile or d.contract or d.evals or d.devices
                                    or d.verdict[0] != d.verdict[1]):
        d.change = "unchanged"
    return d


_SHAPE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError)  # a field of another shape


def _misshapen(bundle: dict | None, op: str, arch: str) -> str | None:
    """Why the diff cannot read `bundle` (a field it reads holds something else), or None."""
    try:
        diff_bundles(bundle, bundle, op, arch)
    except _SHAPE_ERRORS as e:
        return f"{type(e).__name__}: {e}"
    return None


def diff(base_rev: str, head_rev: str | None = None, root: Path = REPO_ROOT) -> list[BundleDiff]:
    base, head = bundles_at(base_rev, root), bundles_at(head_rev, root)
    diffs = []
    for op, arch in sorted(set(base) | set(head)):
        try:
            diffs.append(diff_bundles(base.get((op, arch)), head.get((op, arch)), op, arch))
        except _SHAPE_ERRORS:  # name the side that holds it, read alone
            sides = ((base_rev, base.get((op, arch))), (head_rev, head.get((op, arch))))
            rev, why = next(((rev, why) for rev, bundle in sides if (why := _misshapen(bundle, op, arch))),
                            (f"{base_rev} or {head_rev or 'working tree'}", "the two together"))
            raise DiffError(f"{rev or 'working tree'}:evidence/{op}/{arch}/{BUNDLE}: a field the diff reads is not "
                            f"what a bundle holds ({why})") from None
    return diffs


def _contract_dump(text: str, where: str) -> dict:
    """A contract file's judged values: as the schema fills its defaults where it parses, else as written (the
    `contract` rule of task check and `contract check` say why it does not parse)."""
    import yaml

    from kernels.contract import ContractError, parse_contract

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DiffError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        return parse_contract(data, where).model_dump(mode="json")
    except ContractError:
        return data if isinstance(data, dict) else {}


def contract_changes(base_rev: str, head_rev: str | None = None, root: Path = REPO_ROOT) -> list[Move]:
    """The judged values of `contracts/<op>.yaml` that moved between two revisions (None: the working tree),
    contract_moves of each; a contract added or removed is one Move with path None."""
    def contracts(rev: str | None) -> dict[str, dict]:
        if rev is None:
            return {p.stem: _contract_dump(p.read_text(), p.relative_to(root).as_posix())
                    for p in (root / "contracts").glob("*.yaml")}
        names = [p for p in _git(root, "ls-tree", "--name-only", rev, "contracts/").split() if p.endswith(".yaml")]
        return {Path(p).stem: _contract_dump(_git(root, "show", f"{rev}:{p}"), f"{rev}:{p}") for p in names}

    base, head = contracts(base_rev), contracts(head_rev)
    out = []
    for op in sorted(set(base) | set(head)):
        b, h = base.get(op), head.get(op)
        if b is None or h is None:
            out.append(Move(op, None, None if b is None else "present", None if h is None else "present", False))
        else:
            out += contract_moves(op, b, h)
    return out


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _value(v) -> str:
    return "-" if v is None else f"`{json.dumps(v)}`"


def render_markdown(diffs: list[BundleDiff], base_rev: str, head_rev: str | None, contracts: list[Move] | None = None,
                    reasons: dict[str, str] | None = None) -> str:
    """The diff as Markdown: the contracts' judged values that moved (loosening first, each with the reason the
    pull request gives in `reasons`, by Move.name), then one section per bundle that moved, tables of the moves."""
    lines = [f"## Evidence diff: `{base_rev}` → `{head_rev or 'working tree'}`", ""]
    if contracts:
        lines += ["Contract values that moved, loosened first (a pull request says why each loosened one moved: "
                  "`Contract-change: <op>.<value>: <reason>`):", "",
                  "| contract | value | base | head | |", "|---|---|---|---|---|"]
        for m in sorted(contracts, key=lambda m: not m.loosened):
            if m.path is None:
                note = "added" if m.head else "removed"
            elif m.loosened:
                why = (reasons or {}).get(m.name)
                note = f"loosened; why: {why}" if why else "**loosened: say why**"
            else:
                note = ""
            cells = (m.base or "-", m.head or "-") if m.path is None else (_value(m.base), _value(m.head))
            lines.append(f"| {m.contract} | {m.path or '(whole contract)'} | {cells[0]} | {cells[1]} | "
                         f"{note.replace('|', chr(92) + '|')} |")
        lines.append("")
    moved = [d for d in diffs if d.change != "unchanged"]
    if not moved:
        return "\n".join(lines + ["No evidence bundle changed.", ""])
    for d in moved:
        lines += [f"### {d.op} / {d.arch}: {d.change}, verdict {d.verdict[0] or '-'} → {d.verdict[1] or '-'}", ""]
        if d.devices:
            tbps = " → ".join("-" if b is None else f"{b / 1e12:.2f} TB/s" for b in d.bandwidths)
            lines += [f"**Two machines:** base on {d.devices[0] or '-'}, head on {d.devices[1] or '-'} (floors at "
                      f"{tbps}). Each speedup is its own run's, candidate and standard side by side; the times and "
                      "the fractions of the floor compare two machines, not two kernels.", ""]
        if loose := [m.path for m in d.contract if m.loosened]:
            lines += [f"**The bar moved down** in the contract: {', '.join(loose)}. The pull request must say "
                      "why.", ""]
        if d.gates:
            lines += ["| gate | base | head |", "|---|---|---|"]
            lines += [f"| {g} | {b or '-'} | {h or '-'} |" for g, (b, h) in d.gates.items()] + [""]
        if d.points:
            lines += ["| point | speedup base | speedup head | 95 % interval head | µs head (cand. / std.) "
                      "| of floor base → head | kernels base → head |", "|---|---|---|---|---|---|---|"]
            for p in d.points:
                b, h = p["base"] or {}, p["head"] or {}
                ci = h.get("ci")
                lines.append(f"| {p['point']} | {_num(b.get('speedup'), '.2f')} | {_num(h.get('speedup'), '.2f')} | "
                             f"{'-' if not ci else f'[{ci[0]:.2f}, {ci[1]:.2f}]'} | "
                             f"{_num(h.get('candidate_us'), '.2f')} / {_num(h.get('standard_us'), '.2f')} | "
                             f"{_num(b.get('fraction'), '.1%')} → {_num(h.get('fraction'), '.1%')} | "
                             f"{_num(b.get('kernels'), '')} → {_num(h.get('kernels'), '')} |")
            lines.append("")
        if d.compile:
            lines += ["| kernel config | registers, spill bytes base | head |", "|---|---|---|"]
            lines += [f"| `{c['config']}` | {c['base']} | {c['head']} |" for c in d.compile] + [""]
        if d.contract:
            lines += ["| contract value | base | head |", "|---|---|---|"]
            lines += [f"| {m.path}{' (loosened)' if m.loosened else ''} | {_value(m.base)} | {_value(m.head)} |"
                      for m in d.contract] + [""]
        if d.evals:
            lines += ["| eval metric | base | head |", "|---|---|---|"]
            lines += [f"| {k} | {_num(b, '.4g')} | {_num(h, '.4g')} |" for k, (b, h) in d.evals.items()] + [""]
    return "\n".join(lines)
