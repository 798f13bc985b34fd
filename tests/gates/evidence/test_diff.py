"""`k3forge evidence diff`: what moved between two bundles, on the committed H200 bundle of kda_decode."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest

from gates.evidence.diff import diff, diff_bundles, loosened, render_markdown
from model.kimi_k3.ops.registry import REPO_ROOT

REAL = REPO_ROOT / "evidence" / "kda_decode" / "sm_90" / "bundle.json"


@pytest.fixture
def bundle():
    return json.loads(REAL.read_text())


def _bench_rows(b):
    return next(g for g in b["gates"] if g["gate"] == "benchmarks")["details"]["rows"]


def test_an_identical_bundle_is_unchanged(bundle):
    assert diff_bundles(bundle, copy.deepcopy(bundle), "kda_decode", "sm_90").change == "unchanged"


def test_speedups_verdicts_and_a_loosened_tolerance_show(bundle):
    head = copy.deepcopy(bundle)
    _bench_rows(head)[0]["speedup"] = 1.01
    next(g for g in head["gates"] if g["gate"] == "numerics")["status"] = "FAILED_NUMERICS"
    head["verdict"] = "FAILED_NUMERICS"
    head["contract"]["tolerance"]["atol"] *= 10
    d = diff_bundles(bundle, head, "kda_decode", "sm_90")
    assert d.verdict == ("PASSED", "FAILED_NUMERICS") and d.gates == {"numerics": ("PASSED", "FAILED_NUMERICS")}
    assert [p["point"] for p in d.points] == [_bench_rows(bundle)[0]["point"]]
    assert d.loosened == ["tolerance"]
    text = render_markdown([d], "base", "head")
    assert "The bar moved down" in text and "1.01" in text and "FAILED_NUMERICS" in text


@pytest.mark.parametrize("field, base, head, looser", [
    ("tolerance", {"atol": 1e-3, "rtol": 1e-2}, {"atol": 1e-3, "rtol": 2e-2}, True),
    ("tolerance", {"atol": 1e-3, "min_close_fraction": 0.999}, {"atol": 1e-3, "min_close_fraction": 0.99}, True),
    ("tolerance", {"atol": 1e-3}, {"atol": 1e-4}, False),
    ("batch", {"min": 1, "max": 64}, {"min": 1, "max": 128}, True),
    ("batch", {"min": 1, "max": 64}, {"min": 2, "max": 64}, False),
    ("benchmark", {"required_speedup": 2.0, "points": [{"batch": 1}]}, {"required_speedup": 1.5, "points": [{"batch": 1}]}, True),
    ("benchmark", {"required_speedup": 2.0, "points": [{"batch": 1}, {"batch": 64}]},
     {"required_speedup": 2.0, "points": [{"batch": 1}]}, True),
    ("shapes", {"heads": [12]}, {"heads": [12, 24]}, True),
])
def test_what_counts_as_loosening(field, base, head, looser):
    assert loosened(field, base, head) is looser


def test_two_commits_of_the_repository():
    """Two real bundles from history, where the clone has them (a shallow clone skips)."""
    revs = subprocess.run(["git", "log", "--format=%H", "-n", "2", "--", str(REAL)], cwd=REPO_ROOT,
                          capture_output=True, text=True).stdout.split()
    if len(revs) < 2:
        pytest.skip("this clone holds fewer than two commits of the H200 bundle")
    diffs = diff(revs[1], revs[0])
    moved = [d for d in diffs if (d.op, d.arch) == ("kda_decode", "sm_90")]
    assert moved and moved[0].change in ("changed", "unchanged")
    assert "Evidence diff" in render_markdown(diffs, revs[1], revs[0])


def test_a_loosened_contract_field_is_flagged_between_revisions(tmp_path):
    """Working tree against HEAD: a wider tolerance in a contract file shows, loosening first."""
    from gates.evidence.diff import contract_changes

    root = tmp_path / "repo"
    (root / "contracts").mkdir(parents=True)
    contract = root / "contracts" / "op.yaml"
    contract.write_text("op: op\ntolerance: {atol: 0.001, rtol: 0.01, max_rel_l2: 0.001}\nbatch: {min: 1, max: 8}\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    contract.write_text("op: op\ntolerance: {atol: 0.01, rtol: 0.01, max_rel_l2: 0.001}\nbatch: {min: 2, max: 8}\n")
    changes = contract_changes("HEAD", None, root)
    assert {(c["field"], c["loosened"]) for c in changes} == {("tolerance", True), ("batch", False)}
    text = render_markdown([], "HEAD", None, changes)
    assert text.index("tolerance") < text.index("batch") and "loosened: say why" in text
