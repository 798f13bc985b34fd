"""Real temporary git repositories for `k3forge task check`: a base commit on main holding the minimum a check
reads (a task template, the CPU example's attn_res contract, its kernel and reference, its CPU evidence), and
helpers to change, re-gate and commit on a task branch."""

from __future__ import annotations

from pathlib import Path

import git
import pytest
import yaml

from gates.checks.benchmarks import judge_point
from gates.core.registry import verdict_of
from gates.core.runner import detect, environment, new_options
from gates.core.status import GateResult, Status
from gates.evidence.bundle import Bundle, GitState, covered_sources, now, write_bundle
from gates.evidence.report import render_reports
from gates.problems import Point
from kernels.contract import load_contract
from tests.gates.fixtures.helpers import CPU_EXAMPLE, timed

REPO = Path(__file__).resolve().parents[2]
# The minimum of the real tree that the CPU example's evidence covers (its contract is written beside them).
COPIED = ("model/__init__.py", "model/kimi_k3/__init__.py", "model/kimi_k3/ops/__init__.py",
          "model/kimi_k3/ops/attn_res.py", "model/kimi_k3/ops/attn_res_standard.py", "model/kimi_k3/ops/op.py",
          "model/kimi_k3/specialized/__init__.py", "model/kimi_k3/specialized/attn_res_fused.py")
KERNEL = "model/kimi_k3/specialized/attn_res_fused.py"
CONTRACT = "contracts/attn_res.yaml"
TASK = {
    "schema_version": 1,
    "name": "attn_res_mix",
    "title": "AttnRes mix in one pass",
    "goal": "Score and mix the AttnRes sources without normalized temporaries.",
    "ops": ["attn_res"],
    "allowed": ["model/kimi_k3/specialized/{op}_fused.py", "contracts/{op}.yaml", "tests/specialized/**"],
    "required_gates": ["contracts", "numerics"],
    "envelope": {"archs": ["cpu"], "tp_sizes": [1], "batch": {"min": 1, "max": 64},
                 "spec_tokens": {"min": 0, "max": 7}},
    "success": {"numerics": {"max_rel_l2": 1e-4}},
    "checklist": ["The mix sums the sources in fp32."],
}
OWNER = "Signed-off-by: Ada Lovelace <ada@example.com>"
AGENT = "Assisted-by: Claude <noreply@anthropic.com>"
TRAILERS = ("Task: attn_res_mix", AGENT, OWNER)


def passed(gate: str) -> GateResult:
    return GateResult(gate=gate, title=gate.title(), status=Status.PASSED, summary="passed")


def not_run(gate: str) -> GateResult:
    return GateResult.not_run(gate, gate.title(), "needs a CUDA GPU; this machine has none")


def benchmarks(speedups: dict[int, float], drawn: dict[int, float] | None = None) -> GateResult:
    """A benchmarks result as a GPU run would record it, from made-up timings with these speedups by batch (at the
    contract's points, then at points the gate drew between them)."""
    rows = []
    for batch, speedup, is_drawn in [(*kv, False) for kv in speedups.items()] + [(*kv, True) for kv in
                                                                                  (drawn or {}).items()]:
        point = Point(batch, 0, (("sources", 9 - is_drawn), ("hidden", 7168)), "fp32")
        rows.append(judge_point(point, *timed([10.0] * 5, [10.0 * speedup] * 5), None, 1.0, None)[0]
                    | ({"drawn": True} if is_drawn else {}))
    return GateResult(gate="benchmarks", title="Benchmarks", status=Status.PASSED, summary="synthetic",
                      details={"rows": rows, "required_speedup": 1.0, "min_roofline_fraction": None, "peaks": None,
                               "method": "made-up timings", "recheck_failures": []})


def failed(gate: str, status: Status, reason: str) -> GateResult:
    return GateResult(gate=gate, title=gate.title(), status=status, reason=reason, summary=reason)


# every gate that applies to a torch backend on cpu passed (compile and benchmarks do not apply there)
CPU_GATES = (passed("contracts"), not_run("compile"), passed("numerics"), not_run("benchmarks"), passed("evals"))


class TaskRepo:
    """A git repository in a temporary directory, on branch `task` after the base commit on `main`."""

    def __init__(self, root: Path):
        self.root = root
        self.repo = git.Repo.init(root, initial_branch="main")
        with self.repo.config_writer() as config:
            config.set_value("user", "name", "Ada Lovelace")
            config.set_value("user", "email", "ada@example.com")
            config.set_value("commit", "gpgsign", "false")  # whatever the machine's global git config says

    def write(self, path: str, text: str) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def edit(self, path: str, line: str = "# changed\n") -> None:
        self.write(path, (self.root / path).read_text() + line)

    def edit_contract(self, **fields) -> None:
        data = yaml.safe_load((self.root / CONTRACT).read_text())
        data.update(fields or {"description": data["description"] + " Changed."})
        self.write(CONTRACT, yaml.safe_dump(data, sort_keys=False))

    def write_task(self, data: dict, brief: str = "# Brief\n\nWhat to do.\n") -> None:
        self.write(f"agent_tasks/{data['name']}.yaml", yaml.safe_dump(data, sort_keys=False))
        self.write(f"agent_tasks/{data['name']}.md", brief)

    def gate(self, op: str = "attn_res", arch: str = "cpu", gates: tuple[GateResult, ...] = CPU_GATES,
             isolation: str | None = None) -> Path:
        """Write the bundle `k3forge gate` would write for the tree as it is now (gate results given; `isolation`:
        how its candidate code was walled in)."""
        path = self.root / "contracts" / f"{op}.yaml"
        contract = load_contract(path)
        bundle = Bundle(op=op, arch=arch, created=now(), command="k3forge gate", git=GitState(commit=None, branch=None,
                        dirty=None), contract_path=f"contracts/{op}.yaml", contract=contract.model_dump(mode="json"),
                        owners=contract.owners, sources=covered_sources(contract, path, None, self.root),
                        environment=ENVIRONMENT.model_copy(update={"candidate_isolation": isolation}),
                        options=new_options(1), gates=list(gates),
                        verdict=verdict_of(contract, arch, list(gates)))
        return write_bundle(self.root / "evidence" / op / arch, bundle, render_reports(bundle))

    def commit(self, subject: str, *trailers: str) -> str:
        self.repo.git.add(A=True)
        self.repo.git.commit("-m", subject + ("\n\n" + "\n".join(trailers) if trailers else ""))
        return self.repo.head.commit.hexsha


ENVIRONMENT = environment(detect())


def make_task_repo(root: Path) -> TaskRepo:
    """Base on main: the fixture task, the attn_res contract and sources, fresh CPU evidence. Now on `task`."""
    r = TaskRepo(root)
    for rel in COPIED:
        r.write(rel, (REPO / rel).read_text())
    r.write(CONTRACT, CPU_EXAMPLE.read_text())
    r.write("README.md", "# k3forge\n")
    r.write_task(TASK)
    r.gate()
    r.commit("base")
    r.repo.git.checkout("-b", "task")
    return r


@pytest.fixture
def task_repo(tmp_path) -> TaskRepo:
    return make_task_repo(tmp_path / "repo")
