"""`k3forge evidence diff`: what moved between two bundles, on the committed H200 bundle of kda_decode."""

from __future__ import annotations

import copy
import subprocess

import pytest

from gates.evidence.diff import DiffError, contract_changes, contract_moves, diff, diff_bundles, render_markdown
from kernels.contract import load_contract
from model.kimi_k3.ops.registry import REPO_ROOT
from tests.gates.fixtures.helpers import CPU_EXAMPLE, REAL_BUNDLE, bench_rows


def test_an_identical_bundle_is_unchanged(bundle):
    assert diff_bundles(bundle, copy.deepcopy(bundle), "kda_decode", "sm_90").change == "unchanged"


def test_speedups_verdicts_and_a_loosened_tolerance_show(bundle):
    head = copy.deepcopy(bundle)
    bench_rows(head)[0]["speedup"] = 1.01
    next(g for g in head["gates"] if g["gate"] == "numerics")["status"] = "FAILED_NUMERICS"
    head["verdict"] = "FAILED_NUMERICS"
    head["contract"]["tolerance"]["atol"] *= 10
    d = diff_bundles(bundle, head, "kda_decode", "sm_90")
    assert d.verdict == ("PASSED", "FAILED_NUMERICS") and d.gates == {"numerics": ("PASSED", "FAILED_NUMERICS")}
    assert [p["point"] for p in d.points] == [bench_rows(bundle)[0]["point"]]
    assert [(m.path, m.loosened) for m in d.contract] == [("tolerance.atol", True)]
    text = render_markdown([d], "base", "head")
    assert "The bar moved down" in text and "1.01" in text and "FAILED_NUMERICS" in text


def test_a_bundle_from_another_device_says_so(bundle):
    """A regate on another card of the arch (an H100 after an H200) moves every time and fraction by the machine
    alone: the diff names both devices and the bandwidths their floors were at."""
    head = copy.deepcopy(bundle)
    head["environment"]["device_name"] = "NVIDIA H100 80GB HBM3"
    next(g for g in head["gates"] if g["gate"] == "benchmarks")["details"]["peaks"]["mem_bw_Bps"] = 2.98e12
    d = diff_bundles(bundle, head, "kda_decode", "sm_90")
    assert d.change == "changed" and d.devices == ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
    assert d.bandwidths == (4.3e12, 2.98e12)
    text = render_markdown([d], "base", "head")
    assert "**Two machines:** base on NVIDIA H200, head on NVIDIA H100 80GB HBM3" in text
    assert "4.30 TB/s → 2.98 TB/s" in text
    assert diff_bundles(bundle, copy.deepcopy(bundle), "kda_decode", "sm_90").devices is None


def _attn_res() -> dict:
    return load_contract(CPU_EXAMPLE).model_dump(mode="json")


def _set(path: str, value):
    """An edit of a contract dump: the value at a dotted path (a list index as a number) set, or deleted (None)."""
    def edit(c: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            c = c[int(key)] if isinstance(c, list) else c.setdefault(key, {})
        if value is None:
            del c[last]
        else:
            c[last] = value
    return edit


POINT = "benchmark.points[batch=8,spec_tokens=0,hidden=7168,sources=9]"


@pytest.mark.parametrize("edit, expected", [
    (_set("tolerance.rtol", 2e-5), [("tolerance.rtol", True)]),
    (_set("tolerance.min_close_fraction", 0.99), [("tolerance.min_close_fraction", True)]),
    (_set("tolerance.atol", 1e-6), [("tolerance.atol", False)]),
    (_set("state_tolerance", {"atol": 1e-4, "rtol": 1e-5, "max_rel_l2": 1e-5, "min_close_fraction": 0.99999,
                              "max_units": 3.0}), [("state_tolerance.atol", True)]),
    (_set("batch.max", 128), [("batch.max", True)]),
    (_set("batch.min", 2), [("batch.min", False)]),
    (_set("spec_tokens.max", 3), [("spec_tokens.max", False)]),
    (_set("tp_sizes", [1, 2]), [("tp_sizes", True)]),
    (_set("shapes.sources", [2, 3, 4, 5, 6, 7, 8, 9, 10]), [("shapes.sources", True)]),
    (_set("shapes.hidden", None), [("shapes.hidden", True)]),  # a constraint dropped admits every value
    (_set("dtypes.activations", "bf16"), [("dtypes.activations", True)]),
    (_set("standard", "model.kimi_k3.ops.slow:attn_res"), [("standard", True)]),
    (_set("reference", "model.kimi_k3.specialized.attn_res_fused:attn_res_fused"), [("reference", True)]),
    (_set("hardware.validated", [{"arch": "cpu", "devices": ["cpu"]}, {"arch": "sm_90", "devices": ["H200"]}]),
     [("hardware.validated.sm_90", True)]),
    (_set("benchmark.required_speedup", 1.0), [("benchmark.required_speedup", True)]),
    (_set("benchmark.min_roofline_fraction", 0.5), [("benchmark.min_roofline_fraction", False)]),
    (_set("benchmark.points.1.required_speedup", 1.1), [(f"{POINT}.required_speedup", True)]),
    (_set("benchmark.points.1.required_speedup", 1.5), [(f"{POINT}.required_speedup", False)]),
    (lambda c: c["benchmark"]["points"].pop(1), [(POINT, True)]),
    (_set("resources.max_registers", 128), [("resources.max_registers", False)]),
    (_set("description", "Another description."), []),
])
def test_what_counts_as_loosening(edit, expected):
    """Each judged value that moves is one Move; loosened when more passes at head than at base."""
    base, head = _attn_res(), _attn_res()
    edit(head)
    assert [(m.path, m.loosened) for m in contract_moves("attn_res", base, head)] == expected


def test_two_commits_of_the_repository():
    """Two real bundles from history, where the clone has them (a shallow clone skips)."""
    revs = subprocess.run(["git", "log", "--format=%H", "-n", "2", "--", str(REAL_BUNDLE)], cwd=REPO_ROOT,
                          capture_output=True, text=True).stdout.split()
    if len(revs) < 2:
        pytest.skip("this clone holds fewer than two commits of the H200 bundle")
    diffs = diff(revs[1], revs[0])
    moved = [d for d in diffs if (d.op, d.arch) == ("kda_decode", "sm_90")]
    assert moved and moved[0].change in ("changed", "unchanged")
    assert "Evidence diff" in render_markdown(diffs, revs[1], revs[0])


def _repo(root, contract: str):
    (root / "contracts").mkdir(parents=True)
    (root / "contracts" / "attn_res.yaml").write_text(contract)
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    return root / "contracts" / "attn_res.yaml"


def test_a_loosened_contract_value_is_flagged_between_revisions(tmp_path):
    """Working tree against HEAD: a wider tolerance in a contract file shows, loosening first."""
    text = (CPU_EXAMPLE).read_text()
    contract = _repo(tmp_path, text)
    contract.write_text(text.replace("rtol: 1.0e-5", "rtol: 1.0e-3").replace("max: 64}", "max: 32}"))
    changes = contract_changes("HEAD", None, tmp_path)
    assert [(m.name, m.base, m.head, m.loosened) for m in changes] == [
        ("attn_res.batch.max", 64, 32, False), ("attn_res.tolerance.rtol", 1e-5, 1e-3, True)]
    text = render_markdown([], "HEAD", None, changes, {"attn_res.tolerance.rtol": "the fused sum's order"})
    assert text.index("tolerance.rtol") < text.index("batch.max")
    assert "| attn_res | tolerance.rtol | `1e-05` | `0.001` | loosened; why: the fused sum's order |" in text


def test_deleting_a_line_that_was_stricter_than_the_default_is_loosening(tmp_path):
    """max_units defaults to 3: a contract that said 2 and no longer says anything now admits 3."""
    text = (CPU_EXAMPLE).read_text().replace("max_rel_l2: 1.0e-5",
                                                                            "max_rel_l2: 1.0e-5\n  max_units: 2")
    contract = _repo(tmp_path, text)
    contract.write_text(text.replace("\n  max_units: 2", ""))
    assert [(m.name, m.base, m.head, m.loosened) for m in contract_changes("HEAD", None, tmp_path)] == [
        ("attn_res.tolerance.max_units", 2.0, 3.0, True)]
    assert "**loosened: say why**" in render_markdown([], "HEAD", None, contract_changes("HEAD", None, tmp_path))


def test_a_contract_that_is_not_yaml_is_a_diff_error(tmp_path):
    contract = _repo(tmp_path, (CPU_EXAMPLE).read_text())
    contract.write_text("tolerance: {atol: [\n")
    with pytest.raises(DiffError, match=r"^contracts/attn_res.yaml: not valid YAML \("):
        contract_changes("HEAD", None, tmp_path)


def test_drawn_points_are_not_compared(bundle):
    """A drawn point (the benchmarks gate draws new ones each run) is neither a new point nor a removed one."""
    head = copy.deepcopy(bundle)
    drawn = {**copy.deepcopy(bench_rows(head)[0]), "point": "batch 3 · heads 12 · head_dim 128 · bf16", "batch": 3,
             "drawn": True}
    bench_rows(head).append(drawn)
    assert diff_bundles(bundle, head, "kda_decode", "sm_90").points == []


MISSHAPEN = r"a field the diff reads is not what a bundle holds \("


@pytest.mark.parametrize("text, why", [("[1, 2]", r"not a bundle \(a JSON object\)"),
                                       ('{"gates": 5}', MISSHAPEN + "TypeError"),
                                       ('{"environment": ["x"], "gates": []}', MISSHAPEN + "AttributeError")])
def test_a_bundle_of_another_shape_is_a_diff_error_naming_it(tmp_path, text, why):
    """JSON that is not a bundle's shape (hand-edited, or truncated by a tool) is one line naming the revision and
    the file, never a traceback."""
    (tmp_path / "evidence" / "linear" / "cpu").mkdir(parents=True)
    (tmp_path / "evidence" / "linear" / "cpu" / "bundle.json").write_text(text)
    _repo(tmp_path, CPU_EXAMPLE.read_text())
    with pytest.raises(DiffError, match=rf"^HEAD:evidence/linear/cpu/bundle.json: {why}"):
        diff("HEAD", None, tmp_path)
