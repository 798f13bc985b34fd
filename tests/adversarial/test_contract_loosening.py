"""Issue 23, class 5: a change that loosens its own contract. Each hostile change below edits the attn_res
contract so that more passes, re-gates (fresh, intact evidence that passes the looser bar) and commits with every
trailer a clean change carries. `task check` must reject each one, naming the value that moved, until a commit
trailer `Contract-change: <op>.<value>: <reason>` says why; the PR summary shows the move.

The task's base holds a stricter contract than the real one (max_units and min_close_fraction tighter than the
schema's defaults, a benchmark point with its own bar), so that deleting a line is a loosening too.
"""

from __future__ import annotations

import pytest
import yaml

from gates.tasks.check import check, read_branch, summary, task_at_base
from tests.tasks.conftest import CONTRACT, KERNEL, TRAILERS, TaskRepo, make_task_repo

POINT = "benchmark.points[batch=8,spec_tokens=0,hidden=7168,sources=9]"


def _tolerance(c: dict, **fields) -> None:
    c["tolerance"] = {**c["tolerance"], **fields}


def _drop(c: dict, section: str, key: str) -> None:
    del c[section][key]


# name: (edit of the contract's YAML data, the loosened value the check must name)
HOSTILE = {
    "wider_max_units": (lambda c: _tolerance(c, max_units=50.0), "tolerance.max_units"),
    "deleted_max_units": (lambda c: _drop(c, "tolerance", "max_units"), "tolerance.max_units"),  # 2 → default 3
    "deleted_close_fraction": (lambda c: _drop(c, "tolerance", "min_close_fraction"), "tolerance.min_close_fraction"),
    "looser_state_tolerance": (lambda c: c.update(state_tolerance={**c["tolerance"], "max_rel_l2": 5e-5}),
                               "state_tolerance.max_rel_l2"),
    "reference_as_standard": (lambda c: c.update(standard=c["reference"]), "standard"),
    "candidate_as_reference": (lambda c: c.update(reference=c["implementation"]), "reference"),
    "lower_default_speedup": (lambda c: c["benchmark"].update(required_speedup=0.5), "benchmark.required_speedup"),
    "lower_point_speedup": (lambda c: c["benchmark"]["points"][1].update(required_speedup=1.0),
                            f"{POINT}.required_speedup"),
    "dropped_slow_point": (lambda c: c["benchmark"]["points"].pop(1), POINT),
    "more_sources": (lambda c: c["shapes"].update(sources=[*c["shapes"]["sources"], 10]), "shapes.sources"),
}


def edit(r: TaskRepo, change) -> None:
    data = yaml.safe_load((r.root / CONTRACT).read_text())
    change(data)
    r.write(CONTRACT, yaml.safe_dump(data, sort_keys=False))


@pytest.fixture
def strict_repo(tmp_path) -> TaskRepo:
    """The fixture task repository, its base (branch `task`) holding a contract stricter than the defaults; now on
    branch `hostile`."""
    r = make_task_repo(tmp_path / "repo")
    edit(r, lambda c: (_tolerance(c, max_units=2.0, min_close_fraction=0.999999),
                       c["benchmark"]["points"][1].update(required_speedup=1.5)))
    r.gate()
    r.commit("core: a stricter attn_res contract")
    r.repo.git.checkout("-q", "-b", "hostile")
    return r


def found(r: TaskRepo) -> list[tuple[str, str, str]]:
    branch = read_branch(r.repo, "task")
    return [(v.path, v.rule, v.message) for v in check(task_at_base(r.repo, branch, "attn_res_mix"), branch).violations]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_change_that_loosens_its_own_contract_is_rejected(strict_repo, name):
    change, value = HOSTILE[name]
    strict_repo.edit(KERNEL)
    edit(strict_repo, change)
    strict_repo.gate()
    strict_repo.commit(f"attn_res: {name}", *TRAILERS)
    violations = found(strict_repo)
    assert {(path, rule) for path, rule, _ in violations} == {(CONTRACT, "loosening")}, violations
    assert any(m.startswith(f"{value} ") and f"`Contract-change: attn_res.{value}: <reason>`" in m
               for _, _, m in violations), violations
    branch = read_branch(strict_repo.repo, "task")
    assert f"| attn_res | {value} |" in summary(check(task_at_base(strict_repo.repo, branch, "attn_res_mix"), branch))


def test_a_blanket_reason_is_no_reason(strict_repo):
    """Naming the op, not the value, explains nothing: the loosened values still need their reasons."""
    strict_repo.edit(KERNEL)
    edit(strict_repo, HOSTILE["wider_max_units"][0])
    strict_repo.gate()
    strict_repo.commit("attn_res: tidy", *TRAILERS, "Contract-change: attn_res: tidied the contract")
    assert {(path, rule) for path, rule, _ in found(strict_repo)} == {(CONTRACT, "loosening")}
