"""The task template schema: `agent_tasks/<name>.yaml` (what an agent may touch, must show, must reach) and the
brief `agent_tasks/<name>.md` (what the agent reads).

A template names its globs; what they may be and what they mean is the scope policy (gates.scope.policy).

Errors read `file: field: problem`, one per line, like contract errors.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from gates.scope.policy import ALLOWED_ROOTS, CORE_FORBIDDEN, allowed_glob_problem, check_glob, expand, path_problem
from kernels.contract import Range
from kernels.strict_yaml import load_yaml, yaml_problem
from kernels.validation import validate

TASKS_DIR = "agent_tasks"
NAME_PATTERN = r"^[a-z][a-z0-9_]*$"


class TaskError(ValueError):
    """A malformed or missing task template; str() is `file: field: problem` lines."""


Glob = Annotated[str, AfterValidator(check_glob)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Envelope(_Strict):
    """The target the task's kernels aim at; a contract of one of its ops claims nothing outside it."""

    archs: list[str] = Field(min_length=1, description="sm_90, sm_100, ... (cpu for CPU-portable ops)")
    tp_sizes: list[int] = Field(min_length=1)
    batch: Range
    spec_tokens: Range = Field(description="draft tokens per sequence; 0 = plain decode")

    @field_validator("archs")
    @classmethod
    def _archs(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if not re.match(r"^(sm_\d+[a-z]?|cpu)$", a)]
        if bad:
            raise ValueError(f"{bad}: an arch is sm_<digits>[letter] or cpu")
        return v

    @field_validator("tp_sizes")
    @classmethod
    def _tp(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v) or len(set(v)) != len(v):
            raise ValueError(f"{v}: distinct TP sizes, each >= 1")
        return v


class Speedup(_Strict):
    batch: int = Field(ge=1)
    min: float = Field(gt=0, description="over the standard path, at every benchmark point of this batch")


class Numerics(_Strict):
    """Bounds on the contract's tolerances (the outputs' and the state's own, where it sets one): they may be
    stricter, never looser (the numerics gate enforces them)."""

    atol: float | None = Field(default=None, gt=0)
    rtol: float | None = Field(default=None, ge=0)
    max_rel_l2: float | None = Field(default=None, gt=0)
    min_close_fraction: float | None = Field(default=None, gt=0, le=1)
    max_units: float | None = Field(default=None, gt=0, description="largest error of any element, tolerance units")


class Success(_Strict):
    speedup: list[Speedup] = Field(default_factory=list)
    numerics: Numerics = Numerics()


class Task(_Strict):
    schema_version: Literal[1]
    name: str = Field(pattern=NAME_PATTERN)
    title: str = Field(min_length=1)
    goal: str = Field(min_length=1)
    ops: list[str] = Field(min_length=1, description="op names (the registry's, or ones this task adds)")
    allowed: list[Glob] = Field(min_length=1, description=f"globs inside {', '.join(ALLOWED_ROOTS)}")
    forbidden: list[Glob] = Field(default_factory=list, description="globs forbidden beyond CORE_FORBIDDEN")
    required_gates: list[str] = Field(min_length=1, description="gates that must pass in every bundle")
    envelope: Envelope
    shapes: dict[str, dict[str, list[int]]] = Field(
        default_factory=dict, description="per op, rank-local shape values at the envelope's TP sizes")
    success: Success
    checklist: list[str] = Field(min_length=1, description="what the reviewer confirms")

    @field_validator("ops")
    @classmethod
    def _ops(cls, v: list[str]) -> list[str]:
        bad = [op for op in v if not re.match(NAME_PATTERN, op)]
        if bad or len(set(v)) != len(v):
            raise ValueError(f"{v}: distinct op names matching {NAME_PATTERN}")
        return v

    @field_validator("required_gates")
    @classmethod
    def _gates(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v}: a gate is listed twice")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Task":
        for i, pattern in enumerate(self.allowed):
            for glob in expand(pattern, self.ops):
                if why := allowed_glob_problem(glob):
                    raise ValueError(f"allowed.{i}: {why}")
        for op in self.shapes:
            if op not in self.ops:
                raise ValueError(f"shapes.{op}: not one of the task's ops {self.ops}")
        batches = [s.batch for s in self.success.speedup]
        for i, batch in enumerate(batches):
            if batch not in self.envelope.batch:
                raise ValueError(f"success.speedup.{i}.batch: {batch} outside envelope.batch "
                                 f"{self.envelope.batch.min}..{self.envelope.batch.max}")
            if batches.index(batch) != i:
                raise ValueError(f"success.speedup.{i}.batch: batch {batch} listed twice")
        return self

    @property
    def allowed_globs(self) -> list[str]:
        return [g for p in self.allowed for g in expand(p, self.ops)]

    @property
    def forbidden_globs(self) -> list[str]:
        return [*CORE_FORBIDDEN, *(g for p in self.forbidden for g in expand(p, self.ops))]

    def scope_problem(self, path: str) -> str | None:
        """Why a changed path is outside this task (None when inside). Forbidden wins over allowed."""
        return path_problem(path, self.allowed_globs, self.forbidden_globs)


def parse_task(data: object, source: str) -> Task:
    return validate(Task, data, source, TaskError)


@cache
def gate_names() -> tuple[str, ...]:
    from gates.core.registry import registered

    return tuple(g.name for g in registered())


def brief_path(task_file: Path) -> Path:
    return task_file.with_suffix(".md")


def read_task(text: str, brief: str | None, source: str) -> Task:
    """A template from its text, with the checks that need more than its own fields: its name (the file's stem),
    its brief (the text of <name>.md, None when there is none), the gates it names."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise TaskError(f"{source}: <file>: not valid YAML ({yaml_problem(e)})") from None
    task = parse_task(data, source)
    problems = []
    stem = Path(source).stem
    if task.name != stem:
        problems.append(f"{source}: name: {task.name!r} does not match the file name {stem!r}")
    if not (brief or "").strip():
        problems.append(f"{source}: brief: {stem}.md is missing or empty (the brief the agent reads)")
    for i, gate in enumerate(task.required_gates):
        if gate not in gate_names():
            problems.append(f"{source}: required_gates.{i}: unknown gate {gate!r}; gates: {', '.join(gate_names())}")
    if problems:
        raise TaskError("\n".join(problems))
    return task


def load_task(path: str | Path) -> Task:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TaskError(f"{path}: <file>: cannot read ({e.strerror})") from None
    brief = brief_path(path)
    return read_task(text, brief.read_text() if brief.is_file() else None, str(path))


def task_files(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("*.yaml"))


def load_tasks(directory: str | Path) -> tuple[dict[str, Task], list[str]]:
    """Every template that loads, by name, and the problem lines of those that do not."""
    tasks, problems = {}, []
    for path in task_files(directory):
        try:
            tasks[path.stem] = load_task(path)
        except TaskError as e:
            problems.extend(str(e).splitlines())
    return tasks, problems


def find_task(root: Path, name: str) -> Task:
    path = Path(root) / TASKS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(p.stem for p in task_files(path.parent)) or "none"
        raise TaskError(f"{path}: <file>: no task {name!r}; tasks: {known}")
    return load_task(path)
