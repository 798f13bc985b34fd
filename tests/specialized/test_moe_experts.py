"""moe_experts: the specialized kernel against the reference at each benchmark point of contracts/moe_experts.yaml.

Scaffolded by `k3forge task new` (task small_batch_proj). The gate checks much more (every envelope point,
every input distribution, determinism, poisoned outputs, timing); this is the quick loop while writing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gates.problems import ProblemError, bench_point, load_problem
from gates.core.trees import clone, leaves
from kernels.contract import load_contract
from model.kimi_k3.ops.registry import import_entry_point, registry_problems

CONTRACT_FILE = Path(__file__).resolve().parents[2] / "contracts" / "moe_experts.yaml"
CONTRACT = load_contract(CONTRACT_FILE)
DEVICE = "cuda"


def point_id(point) -> str:
    return "-".join([f"batch{point.batch}", f"spec{point.spec_tokens}", *(f"{k}{v}" for k, v in point.shape.items())])


def test_contract_names_this_kernel():
    assert CONTRACT.implementation == "model.kimi_k3.specialized.moe_experts.kernel:moe_experts_cute"
    assert registry_problems(CONTRACT, str(CONTRACT_FILE), imports=False) == []


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("point", CONTRACT.benchmark.points, ids=point_id)
def test_matches_reference(point, dist):
    try:
        problem = load_problem("moe_experts")
    except ProblemError as e:
        pytest.skip(f"the gate has no problem for moe_experts yet: {e}")
    case = problem.generate_input(bench_point(CONTRACT, problem, point), 0, dist)
    kernel = import_entry_point(CONTRACT.implementation)
    got_args, ref_args = clone(case.args, DEVICE), clone(case.args, DEVICE)
    got, ref = kernel(*got_args), problem.reference(*ref_args)
    pairs = list(zip(leaves(got, "out"), leaves(ref, "out"), strict=True))
    for i in case.state:  # state updated in place must match too
        pairs += zip(leaves(got_args[i], f"args[{i}]"), leaves(ref_args[i], f"args[{i}]"), strict=True)
    for (name, g), (_, r) in pairs:
        result = problem.check(name, g, r, CONTRACT.tolerance)
        assert result.passed, result.problems
