"""Task templates: the repository's load and scaffold; a malformed one names its file and field; the path
globs; `k3forge task list | show | new`."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
import sys

import pytest
import torch
import yaml

from gates.cli import main
from gates.scope.policy import matches
from gates.tasks.scaffold import ScaffoldError, scaffold
from gates.tasks.schema import TASKS_DIR, TaskError, load_task, load_tasks
from model.kimi_k3.ops.registry import OPS
from tests.tasks.conftest import REPO, TASK

REPO_TASKS, _ = load_tasks(REPO / TASKS_DIR)
OWNER = "Ada Lovelace <ada@example.com>"


def test_the_repository_templates_load():
    tasks, problems = load_tasks(REPO / TASKS_DIR)
    assert problems == []
    assert {"fuse_decode_op", "small_batch_proj", "moe_router", "oproj_residual", "mla_decode",
            "kda_verify"} <= set(tasks)


@pytest.mark.parametrize("task, op", [(t, op) for t in REPO_TASKS.values() for op in t.ops], ids=str)
def test_every_template_scaffolds_its_registered_ops(task, op):
    if op not in OPS:
        with pytest.raises(ScaffoldError, match="no such op yet"):
            scaffold(task, op, "cutedsl", OWNER)
        return
    files = scaffold(task, op, "cutedsl", OWNER)  # the draft contract is checked against schema and registry
    assert len(files) == 4 and all(task.scope_problem(path) is None for path in files)
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")
            for module, names in re.findall(r"^from ([\w.]+) import ([\w, ]+)$", text, re.M):
                if not module.startswith("."):  # what the scaffold imports from the repository exists
                    imported = importlib.import_module(module)
                    assert all(hasattr(imported, n.strip()) for n in names.split(",")), (path, module, names)
    contract = yaml.safe_load(files[f"contracts/{op}.yaml"])
    assert contract["hardware"] == {"validated": [], "declared": [
        {"arch": a, "devices": [{"sm_90": "NVIDIA H200", "sm_100": "NVIDIA GB300"}[a]]} for a in task.envelope.archs]}
    assert contract["owners"] == [OWNER]
    assert contract["dtypes"]["weights"] == ("mxfp4" if op == "moe_experts" else "bf16")  # as the checkpoint has them
    assert sorted({p["batch"] for p in contract["benchmark"]["points"]}) == [s.batch for s in task.success.speedup]


def write_task(root, data, brief="# Brief\n"):
    (root / TASKS_DIR).mkdir(exist_ok=True)
    path = root / TASKS_DIR / "attn_res_mix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False) if isinstance(data, dict) else data)
    if brief is not None:
        path.with_suffix(".md").write_text(brief)
    return path


def changed(**updates) -> dict:
    data = copy.deepcopy(TASK)
    for key, value in updates.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("data, expected", [
    (changed(allowed=["gates/**"]), "allowed.0: 'gates/**' is outside model/kimi_k3/, contracts/, tests/"),
    (changed(allowed=["contracts/{op}.yaml", "tests/gates/**"]),
     "allowed.1: 'tests/gates/**' lies inside the core path 'tests/gates/**'"),
    (changed(allowed=["../secrets/**"]), "allowed.0: '../secrets/**': a path relative to the repository root"),
    (changed(forbidden=["model/kimi_k3/{name}.py"]),
     "forbidden.0: 'model/kimi_k3/{name}.py': the only placeholder is {op}"),
    (changed(goal=None), "goal: Field required"),
    (changed(owner="me"), "owner: Extra inputs are not permitted"),
    (changed(required_gates=["contracts", "speed"]), "required_gates.1: unknown gate 'speed'; gates: contracts"),
    (changed(envelope={**TASK["envelope"], "archs": ["h200"]}), "envelope.archs: ['h200']: an arch is sm_<digits>"),
    (changed(success={"speedup": [{"batch": 128, "min": 1.5}]}),
     "success.speedup.0.batch: 128 outside envelope.batch 1..64"),
    (changed(success={"speedup": [{"batch": 1, "min": 0}]}), "success.speedup.0.min: Input should be greater than 0"),
    (changed(shapes={"kda_decode": {"heads": [12]}}), "shapes.kda_decode: not one of the task's ops ['attn_res']"),
    (changed(name="another_name"), "name: 'another_name' does not match the file name 'attn_res_mix'"),
    ("- just\n- a list\n", "<root>: expected a mapping, got list"),
    ("name: [unclosed\n", "<file>: not valid YAML"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_malformed_template_names_the_file_and_field(tmp_path, capsys, data, expected):
    path = write_task(tmp_path, data)
    with pytest.raises(TaskError) as e:
        load_task(path)
    lines = str(e.value).splitlines()
    assert any(line.startswith(f"{path}: {expected}") for line in lines), lines
    assert main(["task", "list", "--root", str(tmp_path)]) == 2
    assert f"{path}: {expected}" in capsys.readouterr().err


def test_a_template_without_its_brief(tmp_path):
    path = write_task(tmp_path, TASK, brief=None)
    with pytest.raises(TaskError, match=rf"^{path}: brief: attn_res_mix.md is missing or empty"):
        load_task(path)


@pytest.mark.parametrize("pattern, path, expected", [
    ("model/kimi_k3/specialized/**", "model/kimi_k3/specialized/a/b/c.py", True),
    ("model/kimi_k3/specialized/**", "model/kimi_k3/specialized.py", False),
    ("tests/specialized/test_*.py", "tests/specialized/test_x.py", True),
    ("tests/specialized/test_*.py", "tests/specialized/sub/test_x.py", False),
    ("tests/**/test_?.py", "tests/test_a.py", True),
    ("tests/**/test_?.py", "tests/a/b/test_a.py", True),
    ("contracts/kda_decode.yaml", "contracts/kda_decode.yaml.bak", False),
    ("gates/**", "gatesx/a.py", False),
])
def test_globs(pattern, path, expected):
    assert matches(path, pattern) is expected


@pytest.fixture
def tasks_root(tmp_path):
    shutil.copytree(REPO / TASKS_DIR, tmp_path / TASKS_DIR)
    return tmp_path


def test_new_scaffolds_and_never_overwrites(tasks_root, capsys, monkeypatch):
    args = ["task", "new", "moe_router", "--op", "moe_route", "--owner", OWNER, "--root", str(tasks_root)]
    assert main(args) == 0
    out = capsys.readouterr().out
    written = [line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote ")]
    assert "note: no gates/problems/moe_route.py" in out  # this root has no problem for the op: the gates say so
    assert written == ["contracts/moe_route.yaml", "model/kimi_k3/specialized/moe_route/__init__.py",
                       "model/kimi_k3/specialized/moe_route/kernel.py", "tests/specialized/test_moe_route.py"]
    package = tasks_root / written[1]
    spec = importlib.util.spec_from_file_location("scaffolded", package,
                                                  submodule_search_locations=[str(package.parent)])
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scaffolded", module)  # its `from .kernel import DSL` resolves through it
    spec.loader.exec_module(module)
    assert module.available()[0] is torch.cuda.is_available()  # the DSL imports; CPU CI has no GPU
    assert "implementation: model.kimi_k3.specialized.moe_route:moe_route_cute" in (tasks_root / written[0]).read_text()
    with pytest.raises(NotImplementedError, match="moe_route_cute: the kernel is not written yet"):
        module.moe_route_cute(None, None, None, 16, True, 1.0)
    assert sys.modules["scaffolded.kernel"].Config.for_problem() == sys.modules["scaffolded.kernel"].Config()
    before = (tasks_root / written[0]).read_text()
    assert main(args) == 2
    assert "already there (a scaffold never overwrites)" in capsys.readouterr().err
    assert (tasks_root / written[0]).read_text() == before


def test_new_adopts_a_kernel_written_before_its_contract(tasks_root, capsys):
    """The kernel package and its test exist: --adopt writes the missing contract naming the kernel's own entry
    point, keeps the rest as they are, and lists them."""
    kernel = tasks_root / "model/kimi_k3/specialized/moe_route/__init__.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("def route_fast(*args):\n    raise NotImplementedError\n")
    entry = "model.kimi_k3.specialized.moe_route:route_fast"
    assert main(["task", "new", "moe_router", "--op", "moe_route", "--owner", OWNER, "--root", str(tasks_root),
                 "--adopt", entry]) == 0
    out = capsys.readouterr().out
    assert "kept model/kimi_k3/specialized/moe_route/__init__.py (already there)" in out
    assert "wrote contracts/moe_route.yaml" in out
    assert f"implementation: {entry}" in (tasks_root / "contracts/moe_route.yaml").read_text()
    assert kernel.read_text().startswith("def route_fast")
    assert main(["task", "new", "moe_router", "--op", "moe_route", "--owner", OWNER, "--root", str(tasks_root),
                 "--adopt", "model.kimi_k3.specialized.other:f"]) == 2
    assert "lives in model.kimi_k3.specialized.moe_route" in capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--op", "kda_decode", "--owner", OWNER], "--op kda_decode: not an op of task moe_router (its ops: moe_route)"),
    (["--op", "moe_route"], "name the contract's human owner with --owner"),  # no git identity in a bare dir
])
def test_new_refuses(tasks_root, capsys, args, expected):
    assert main(["task", "new", "moe_router", *args, "--root", str(tasks_root)]) == 2
    assert expected in capsys.readouterr().err


def test_show(capsys):
    assert main(["task", "show", "oproj_residual"]) == 0
    assert "oproj_residual (not in the op registry yet)" in capsys.readouterr().out
    assert main(["task", "show", "kda_verify"]) == 0
    out = capsys.readouterr().out
    assert "kda_verify (not in the op registry yet)" not in out
    assert "model/kimi_k3/specialized/kda_verify/**" in out and "gates/**" in out
    assert "Step 1: the op is registered" in out and "ReplaySSM" in out  # the brief, rendered
    assert main(["task", "show", "nope"]) == 2
    assert "no task 'nope'; tasks: fuse_decode_op" in capsys.readouterr().err
