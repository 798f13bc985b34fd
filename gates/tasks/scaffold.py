"""`k3forge task new NAME --op OP`: a task's first files, each inside the paths the task allows.

    contracts/<op>.yaml                                 a draft contract: the task's envelope as declared targets
    model/kimi_k3/specialized/<op>/__init__.py          the entry point, the reference's arguments, no body yet
    model/kimi_k3/specialized/<op>/kernel.py            the kernel (CuTe DSL: its config and compile skeleton)
    tests/specialized/test_<op>.py                      the kernel against the reference at the contract's points

The draft contract is checked against the schema and the op registry before anything is written, so a
scaffold always starts from a contract that `k3forge contract check` accepts (evidence aside).

A kernel written before its contract (`--adopt module:function`, the entry point it already has) gets the files
it lacks, the draft contract naming that entry point; the files that exist are kept as they are and listed.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import yaml

from gates.tasks.check import SPECIALIZED
from gates.tasks.render import render
from gates.tasks.schema import Task
from kernels.arch import known
from kernels.contract import ContractError, parse_contract
from model.kimi_k3.ops.registry import OPS, entry_point, registry_problems

BACKENDS = {"cutedsl": "cute", "triton": "triton", "torch": "fused"}  # backend: entry point suffix
# Starting tolerances for bf16 outputs (vLLM's kernel tests); a task's numerics bounds replace them.
DEFAULT_TOLERANCE = {"atol": 1e-3, "rtol": 1.6e-2, "max_rel_l2": 1e-2, "min_close_fraction": 0.99999}
# Operand dtypes K3 keeps (SPEC.md §3, §4): the fp32 SSM state, the bf16 MLA latent cache.
STATE_DTYPES = {"ssm_state": "fp32", "kv_cache": "bf16"}
# Weights as the checkpoint stores them (SPEC.md §10): the routed experts MXFP4, every other weight bf16.
WEIGHT_DTYPES = {"moe_experts": "mxfp4"}


class ScaffoldError(Exception):
    """The scaffold cannot be made as asked; names what to change."""


def _devices(arch: str) -> str:
    try:
        return known(arch).device_name
    except KeyError:
        return arch


def _bench_points(task: Task, shapes: dict[str, list[int]]) -> list[dict]:
    """The task's speedup batch sizes at both edges of the shapes: each key's first values (TP8 where the
    lists follow the TP sizes) and its last (TP16)."""
    batches = [s.batch for s in task.success.speedup] or [task.envelope.batch.min]
    edges = [{k: v[0] for k, v in shapes.items()}, {k: v[-1] for k, v in shapes.items()}]
    shapes_at = [e for i, e in enumerate(edges) if e not in edges[:i]]
    return [{"batch": b, "spec_tokens": task.envelope.spec_tokens.min, "shape": shape}
            for b in batches for shape in shapes_at]


def scaffold(task: Task, op: str, backend: str, owner: str, adopt: str | None = None) -> dict[str, str]:
    """{repository path: text} of the four files, after checking the draft contract; with `adopt`, the contract's
    implementation is that existing entry point (`module:function` under model/kimi_k3/specialized/<op>/)."""
    if op not in task.ops:
        raise ScaffoldError(f"--op {op}: not an op of task {task.name} (its ops: {', '.join(task.ops)})")
    registered = OPS.get(op)
    if registered is None:
        raise ScaffoldError(f"--op {op}: no such op yet: write model/kimi_k3/ops/{op}.py (its reference and its OP "
                            f"declaration; agent_tasks/{task.name}.md says how)")
    fn = f"{op}_{BACKENDS[backend]}"
    implementation = adopt or f"model.kimi_k3.specialized.{op}:{fn}"
    if adopt and not adopt.partition(":")[0].startswith(f"model.kimi_k3.specialized.{op}"):
        raise ScaffoldError(f"--adopt {adopt}: a kernel of op {op} lives in model.kimi_k3.specialized.{op}")
    paths = {"contract.yaml.j2": f"contracts/{op}.yaml", "package_init.py.j2": f"{SPECIALIZED}{op}/__init__.py",
             "kernel.py.j2": f"{SPECIALIZED}{op}/kernel.py", "test.py.j2": f"tests/specialized/test_{op}.py"}
    for path in paths.values():
        if why := task.scope_problem(path):
            raise ScaffoldError(f"{path}: {why}: agent_tasks/{task.name}.yaml must allow what `task new` writes")
    shapes = task.shapes.get(op, {})
    bounds = task.success.numerics.model_dump(exclude_none=True)
    context = dict(
        task=task, op=op, backend=backend, fn=fn, owner=owner, implementation=implementation,
        reference=entry_point(registered.reference), standard=registered.standard_entry_point,
        params=", ".join(inspect.signature(registered.reference).parameters),
        reference_doc=inspect.getdoc(registered.reference) or "",
        devices={arch: _devices(arch) for arch in task.envelope.archs},
        state_dtypes={k: v for k, v in STATE_DTYPES.items() if k in registered.dtypes},
        weights=WEIGHT_DTYPES.get(op, "bf16"),
        shapes=shapes, points=_bench_points(task, shapes), tolerance={**DEFAULT_TOLERANCE, **bounds},
        required_speedup=min((s.min for s in task.success.speedup), default=1.0),
    )
    files = {path: render(template, **context) for template, path in paths.items()}
    contract_path = paths["contract.yaml.j2"]
    try:
        contract = parse_contract(yaml.safe_load(files[contract_path]), contract_path)
    except ContractError as e:
        raise ScaffoldError(f"the draft contract does not validate (agent_tasks/{task.name}.yaml or the "
                            f"template is wrong):\n{e}") from None
    problems = registry_problems(contract, contract_path, imports=False)
    if problems:
        raise ScaffoldError("the draft contract disagrees with the op registry:\n" + "\n".join(problems))
    return files


def write(root: Path, files: dict[str, str], keep_existing: bool = False) -> tuple[list[Path], list[Path]]:
    """Write the files under `root` -> (written, kept). A scaffold never overwrites: without `keep_existing`
    nothing is written if any file exists; with it (an adopted kernel) the existing ones are kept and listed."""
    targets = {Path(root) / path: text for path, text in files.items()}
    existing = [p for p in targets if p.exists()]
    if existing and not keep_existing:
        raise ScaffoldError(f"already there (a scaffold never overwrites): {', '.join(map(str, existing))}; a "
                            "kernel written before its contract: --adopt module:function")
    for path, text in targets.items():
        if path not in existing:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return [p for p in targets if p not in existing], existing
