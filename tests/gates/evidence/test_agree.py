"""`k3forge evidence agree`: an independent re-run judged against the committed bundles, on the committed H200
bundle of kda_decode."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from gates.evidence.agree import agreement, compare, render_markdown
from model.kimi_k3.ops.registry import REPO_ROOT
from tests.gates.fixtures.helpers import bench_rows


def timed(b):
    return [r for r in bench_rows(b) if not r.get("drawn")]


def test_the_same_bundle_agrees_point_by_point(bundle):
    c = compare(bundle, copy.deepcopy(bundle), "kda_decode", "sm_90")
    assert c.problems == [] and len(c.points) == len(timed(bundle)) > 0
    assert all(p["in-pipeline"]["agrees"] and p["one per graph"]["agrees"] for p in c.points)


def test_noise_within_the_intervals_or_the_slack_agrees(bundle):
    rerun = copy.deepcopy(bundle)
    first, second = timed(rerun)[:2]
    lo, hi = first["speedup_ci"]
    first["speedup"], first["speedup_ci"] = hi * 1.02, [hi * 0.999, hi * 1.05]  # intervals overlap
    second["speedup"] *= 1.04  # outside its interval, inside 5 %
    second["speedup_ci"] = [second["speedup"] * 0.999, second["speedup"] * 1.001]
    assert compare(bundle, rerun, "kda_decode", "sm_90").problems == []


def test_a_speedup_the_rerun_does_not_reproduce_disagrees_and_names_the_point(bundle):
    rerun = copy.deepcopy(bundle)
    row = timed(rerun)[0]
    was = row["speedup"]
    row["speedup"], row["speedup_ci"] = was * 0.7, [was * 0.69, was * 0.71]
    (problem,) = compare(bundle, rerun, "kda_decode", "sm_90").problems
    assert problem.startswith(f"{row['point']}: in-pipeline speedup {was:.2f}x committed")
    assert f"{was * 0.7:.2f}x re-run" in problem


def test_a_verdict_a_gate_a_kernel_count_or_a_point_left_untimed_disagrees(bundle):
    rerun = copy.deepcopy(bundle)
    rerun["verdict"] = "FAILED_NUMERICS"
    next(g for g in rerun["gates"] if g["gate"] == "numerics")["status"] = "FAILED_NUMERICS"
    timed(rerun)[0]["kernels"]["candidate"] += 1
    gone = timed(rerun)[1]
    bench_rows(rerun).remove(gone)
    problems = compare(bundle, rerun, "kda_decode", "sm_90").problems
    assert "verdict PASSED committed, FAILED_NUMERICS re-run" in problems
    assert "gate numerics: PASSED committed, FAILED_NUMERICS re-run" in problems
    assert any(p.endswith("kernels a call committed, " f"{timed(rerun)[0]['kernels']['candidate']} re-run")
               for p in problems)
    assert f"{gone['point']}: not timed in the re-run" in problems


def write(folder: Path, op: str, arch: str, bundle: dict) -> None:
    (folder / op / arch).mkdir(parents=True)
    (folder / op / arch / "bundle.json").write_text(json.dumps(bundle))


def test_bundles_only_one_side_has_or_not_made_again_are_listed_not_judged(tmp_path, bundle):
    write(tmp_path / "committed", "kda_decode", "sm_90", bundle)
    write(tmp_path / "committed", "linear", "sm_90", bundle)
    write(tmp_path / "rerun", "kda_decode", "sm_90", {**bundle, "created": "a re-run's time"})
    write(tmp_path / "rerun", "kda_decode", "sm_100", bundle)
    write(tmp_path / "rerun", "linear", "sm_90", bundle)  # the committed bundle, not made again
    result = agreement(tmp_path / "committed", tmp_path / "rerun")
    assert result.agrees and [(c.op, c.arch) for c in result.compared] == [("kda_decode", "sm_90")]
    assert result.committed_only == [("linear", "sm_90")] and result.rerun_only == [("kda_decode", "sm_100")]
    text = render_markdown(result, tmp_path / "committed", tmp_path / "rerun")
    assert "Committed, not re-run here: linear/sm_90" in text and "Re-run, not committed: kda_decode/sm_100" in text


def k3forge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gates.cli", "evidence", "agree", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_command_exits_1_on_disagreement_and_names_a_broken_bundle_in_one_line(tmp_path, bundle):
    write(tmp_path / "committed", "kda_decode", "sm_90", bundle)
    slower = copy.deepcopy(bundle)
    for row in timed(slower):
        row["speedup"], row["speedup_ci"] = row["speedup"] / 2, [row["speedup"] / 2.01, row["speedup"] / 1.99]
    write(tmp_path / "rerun", "kda_decode", "sm_90", slower)
    done = k3forge(str(tmp_path / "committed"), str(tmp_path / "rerun"), "--out", str(tmp_path / "agree.md"))
    assert done.returncode == 1 and "### kda_decode / sm_90: DISAGREES" in done.stdout
    assert (tmp_path / "agree.md").read_text() == done.stdout.rstrip("\n") + "\n"
    (tmp_path / "rerun" / "kda_decode" / "sm_90" / "bundle.json").write_text("{not json")
    done = k3forge(str(tmp_path / "committed"), str(tmp_path / "rerun"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"{tmp_path / 'rerun' / 'kda_decode' / 'sm_90' / 'bundle.json'}: not a readable bundle" in done.stderr
