"""One real gate run over the fixture contract, shared by the evidence, report and CLI tests."""

from __future__ import annotations

import random
import shutil

import pytest

from gates.checks.benchmarks import judge_point
from gates.cli import main
from gates.core.status import GateResult, Status
from gates.evidence.bundle import load_bundle
from gates.problems import Point
from tests.gates.fixtures.helpers import CONTRACTS, paired_block, rejudged, timed


@pytest.fixture(scope="session")
def gated(tmp_path_factory):
    """(exit code, evidence directory) of `k3forge gate` over the fixture contracts, on this CPU machine."""
    out = tmp_path_factory.mktemp("evidence")
    code = main(["gate", "--contracts", str(CONTRACTS), "--out", str(out), "--seed", "7", "--trials", "1",
                 "--runs", "3", "--steps", "8"])
    return code, out


@pytest.fixture
def bundle_dir(gated, tmp_path):
    """A private copy of the gated bundle, free to tamper with."""
    _, out = gated
    return shutil.copytree(out / "kda_decode" / "cpu", tmp_path / "kda_decode" / "cpu")


def synthetic_benchmarks(required: float = 1.5) -> GateResult:
    """A benchmarks result as an H200 run would produce it, from made-up raw samples (for rendering tests)."""
    rng = random.Random(0)
    rows, flags, slower = [], [], []
    # the contract's points, then one drawn between them (judged by between_points_bound: 1x)
    points = [(heads, base, batch, False) for heads, base in ((12, 20.0), (6, 11.0)) for batch in (1, 33, 64)]
    for heads, base, batch, drawn in points + [(12, 20.0, 17, True)]:
        point = Point(batch, 0, (("heads", heads), ("head_dim", 128)), "bf16")
        cand, std = base * (1 + batch / 40), base * (1 + batch / 40) * (2.2 - batch / 80)
        blocks = [paired_block([cand * rng.uniform(0.98, 1.05) for _ in range(50)],
                               [std * rng.uniform(0.98, 1.05) for _ in range(50)]) for _ in range(3)]
        _, finish = timed([cand] * 10, [std] * 10)
        row, f, s = judge_point(point, blocks, finish, floor_us=cand * 0.55, required=1.0 if drawn else required,
                                min_fraction=None)
        row["standard_alone_us"] = row["standard"]["median_us"] * 0.99  # as `standard_alone` records it
        row.update({"drawn": True} if drawn else {})
        rows.append(row), flags.extend(f), slower.extend(s)
    return GateResult(gate="benchmarks", title="Benchmarks", status=Status.SLOWER if slower else Status.PASSED,
                      reason="; ".join(slower), flags=flags, summary="synthetic", seconds=12.0,
                      details={"rows": rows, "required_speedup": required, "min_roofline_fraction": None,
                               "peaks": {"mem_bw_Bps": 4.25e12, "declared_mem_bw_Bps": 4.3e12, "flops": 790e12,
                                         "source": "copy bandwidth measured in this process on NVIDIA H200"},
                               "sm_clock_mhz": {"alone": 1980.0, "beside": 1965.0, "max": 1980.0},
                               "method": "synthetic samples", "recheck_failures": []})


@pytest.fixture
def gpu_like_bundle(gated):
    """The gated bundle with its benchmarks result replaced by a synthetic H200 one."""
    _, out = gated
    bundle = load_bundle(out / "kda_decode" / "cpu")
    gates = [synthetic_benchmarks() if g.gate == "benchmarks" else g for g in bundle.gates]
    return rejudged(bundle, gates, arch="sm_90")
