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
# Contract fields whose change moves the bar a kernel is judged by.
JUDGED_FIELDS = ("hardware", "tp_sizes", "batch", "spec_tokens", "dtypes", "shapes", "tolerance", "benchmark")


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
    contract: dict[str, tuple] = field(default_factory=dict)  # judged contract fields that moved
    loosened: list[str] = field(default_factory=list)  # the moves that lower the bar
    evals: dict[str, tuple] = field(default_factory=dict)  # eval metrics that moved


def _gate(bundle: dict | None, name: str) -> dict:
    for g in (bundle or {}).get("gates", []):
        if g.get("gate") == name:
            return g
    return {}


def _points(bundle: dict | None) -> dict[str, dict]:
    return {r["point"]: r for r in _gate(bundle, "benchmarks").get("details", {}).get("rows", [])}


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
    for c in _gate(bundle, "compile").get("details", {}).get("compiles", []):
        for k in c.get("kernels", []):
            out[f"{c['arch']} {c['key']}"] = (k.get("registers"), k.get("spill_bytes"))
    return out


def _eval_metrics(bundle: dict | None) -> dict[str, float]:
    out = {}
    for name, ev in _gate(bundle, "evals").get("details", {}).get("evals", {}).items():
        for metric, value in (ev.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{name}.{metric}"] = value
    return out


def loosened(field_name: str, base, head) -> bool:
    """Whether a judged contract field moved so that more passes: wider tolerances, lower required speedups or
    fractions, a wider envelope (more TP sizes, batches, tokens, shape values or archs)."""
    if field_name == "tolerance":
        b, h = base or {}, head or {}
        return any(h.get(k, 0) > b.get(k, 0) for k in ("atol", "rtol", "max_rel_l2", "max_units")) or \
            h.get("min_close_fraction", 1) < b.get("min_close_fraction", 1)
    if field_name == "benchmark":
        def bars(bm):
            bm = bm or {}
            return {(p.get("batch"), json.dumps(p.get("shape", {}), sort_keys=True)):
                    (p.get("required_speedup") or bm.get("required_speedup") or 0,
                     p.get("min_roofline_fraction") or bm.get("min_roofline_fraction") or 0)
                    for p in bm.get("points", [])}
        b, h = bars(base), bars(head)
        return any(k not in h for k in b) or any(h[k][0] < b[k][0] or h[k][1] < b[k][1] for k in b if k in h)
    if field_name in ("batch", "spec_tokens"):
        b, h = base or {}, head or {}
        return h.get("min", 0) < b.get("min", 0) or h.get("max", 0) > b.get("max", 0)
    if field_name == "tp_sizes":
        return bool(set(head or []) - set(base or []))
    if field_name == "shapes":
        return any(set((head or {}).get(k, [])) - set((base or {}).get(k, [])) for k in (head or {}))
    if field_name == "hardware":
        archs = lambda hw: {v.get("arch") for v in (hw or {}).get("validated", [])}  # noqa: E731
        return bool(archs(head) - archs(base))
    return base != head


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
        s = (_gate(base, name).get("status"), _gate(head, name).get("status"))
        if s[0] != s[1]:
            d.gates[name] = s
    pb, ph = _points(base), _points(head)
    for point in list(pb) + [p for p in ph if p not in pb]:
        fb, fh = _figures(pb.get(point)), _figures(ph.get(point))
        if fb != fh:
            d.points.append({"point": point, "base": fb, "head": fh})
    cb, ch = _compiles(base), _compiles(head)
    for key in sorted(set(cb) | set(ch)):
        if cb.get(key) != ch.get(key):
            d.compile.append({"config": key, "base": cb.get(key), "head": ch.get(key)})
    kb, kh = (base or {}).get("contract") or {}, (head or {}).get("contract") or {}
    for f in JUDGED_FIELDS:
        if kb.get(f) != kh.get(f):
            d.contract[f] = (kb.get(f), kh.get(f))
            if base is not None and head is not None and loosened(f, kb.get(f), kh.get(f)):
                d.loosened.append(f)
    eb, eh = _eval_metrics(base), _eval_metrics(head)
    for k in sorted(set(eb) | set(eh)):
        if _moved(eb.get(k), eh.get(k)):
            d.evals[k] = (eb.get(k), eh.get(k))
    if change == "changed" and not (d.gates or d.points or d.compile or d.contract or d.evals
                                    or d.verdict[0] != d.verdict[1]):
        d.change = "unchanged"
    return d


def diff(base_rev: str, head_rev: str | None = None, root: Path = REPO_ROOT) -> list[BundleDiff]:
    base, head = bundles_at(base_rev, root), bundles_at(head_rev, root)
    return [diff_bundles(base.get(key), head.get(key), *key) for key in sorted(set(base) | set(head))]


def contract_changes(base_rev: str, head_rev: str | None = None, root: Path = REPO_ROOT) -> list[dict]:
    """Judged fields of `contracts/*.yaml` that differ between two revisions (None: the working tree), each with
    whether it loosens the bar; a contract added or removed is one entry with field None."""
    import yaml

    def contracts(rev: str | None) -> dict[str, dict]:
        if rev is None:
            return {p.name: yaml.safe_load(p.read_text()) or {} for p in (root / "contracts").glob("*.yaml")}
        names = [p for p in _git(root, "ls-tree", "--name-only", rev, "contracts/").split() if p.endswith(".yaml")]
        return {Path(p).name: yaml.safe_load(_git(root, "show", f"{rev}:{p}")) or {} for p in names}

    base, head = contracts(base_rev), contracts(head_rev)
    out = []
    for name in sorted(set(base) | set(head)):
        b, h = base.get(name), head.get(name)
        if b is None or h is None:
            out.append({"contract": name, "field": None, "base": b is not None, "head": h is not None,
                        "loosened": False})
            continue
        for f in JUDGED_FIELDS:
            if b.get(f) != h.get(f):
                out.append({"contract": name, "field": f, "base": b.get(f), "head": h.get(f),
                            "loosened": loosened(f, b.get(f), h.get(f))})
    return out


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render_markdown(diffs: list[BundleDiff], base_rev: str, head_rev: str | None,
                    contracts: list[dict] | None = None) -> str:
    """The diff as Markdown: the contracts' judged fields that moved (loosening first), then one section per bundle
    that moved, tables of the moves."""
    lines = [f"## Evidence diff: `{base_rev}` → `{head_rev or 'working tree'}`", ""]
    if contracts:
        lines += ["| contract | field | base | head | |", "|---|---|---|---|---|"]
        for c in sorted(contracts, key=lambda c: not c["loosened"]):
            if c["field"] is None:
                lines.append(f"| {c['contract']} | (whole contract) | {'present' if c['base'] else '-'} | "
                             f"{'present' if c['head'] else '-'} | {'added' if c['head'] else 'removed'} |")
            else:
                lines.append(f"| {c['contract']} | {c['field']} | `{json.dumps(c['base'])}` | `{json.dumps(c['head'])}` | "
                             f"{'**loosened: say why**' if c['loosened'] else ''} |")
        lines.append("")
    moved = [d for d in diffs if d.change != "unchanged"]
    if not moved:
        return "\n".join(lines + ["No evidence bundle changed.", ""])
    for d in moved:
        lines += [f"### {d.op} / {d.arch}: {d.change}, verdict {d.verdict[0] or '-'} → {d.verdict[1] or '-'}", ""]
        if d.loosened:
            lines += [f"**The bar moved down** in the contract: {', '.join(d.loosened)}. The pull request must say "
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
            lines += ["| contract field | base | head |", "|---|---|---|"]
            lines += [f"| {f}{' (loosened)' if f in d.loosened else ''} | `{json.dumps(b)}` | `{json.dumps(h)}` |"
                      for f, (b, h) in d.contract.items()] + [""]
        if d.evals:
            lines += ["| eval metric | base | head |", "|---|---|---|"]
            lines += [f"| {k} | {_num(b, '.4g')} | {_num(h, '.4g')} |" for k, (b, h) in d.evals.items()] + [""]
    return "\n".join(lines)
