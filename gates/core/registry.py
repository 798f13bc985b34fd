"""The gate registry: which gates run, in order, for every contracted op, and what each is given.

A gate is a module under gates/checks/ defining `GATE = Gate(...)`; GATE_MODULES lists them in the order they
run. A model-level eval (temperature sampling, structured output, long context) plugs in the same way: a module
whose `run(ctx)` compares the model with this op specialized against the reference and returns FAILED_EVAL on a
regression; add it to GATE_MODULES and, for its numbers in the report, a template
`gates/evidence/templates/gates/<name>.html.j2` (without one the report shows its details as a table).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gates.core.machine import device_type
from gates.core.status import GateResult, Status, worst
from gates.problems import Problem, ProblemError, load_problem
from kernels.arch import ArchInfo, cute_arch_for
from kernels.contract import Contract

GATE_MODULES = ("gates.checks.contracts", "gates.checks.compile", "gates.checks.numerics",
                "gates.checks.benchmarks", "gates.checks.evals")


class GateOptions(BaseModel):
    """How hard the gates look; recorded in the bundle. The seed is drawn secretly unless given (to reproduce)."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(description="master seed of every checked input, drawn after the candidate is fixed")
    seed_given: bool = Field(default=False, description="True when --seed fixed it (a reproduction, not a gate)")
    trials: int = Field(default=2, ge=1, description="seeded inputs per envelope point and distribution")
    runs: int = Field(default=4, ge=2, description="candidate runs per input, all bitwise identical")
    steps: int = Field(default=32, ge=4, description="consecutive decode steps of a stateful op")
    bench_pairs: int = Field(default=50, ge=5, description="interleaved (candidate, standard) replay pairs per block")
    min_blocks: int = Field(default=3, ge=2, description="timed blocks per benchmark point at least")
    max_blocks: int = Field(default=12, ge=2, description="timed blocks per benchmark point at most")
    precision: float = Field(default=0.02, gt=0, lt=1,
                             description="stop once each bounded statistic's 95 % interval is this narrow (relative)")
    host_iters: int = Field(default=30, ge=5, description="replays timed by host wall clock")
    input_sets: int = Field(default=8, ge=2, description="distinct input sets: rotated between one-call replays, "
                                                          "all in one graph for the in-pipeline time")
    drawn_points: int = Field(default=2, ge=0, description="points the contract admits besides its benchmark points, "
                                                           "drawn from the seed and timed too")

    @model_validator(mode="after")
    def _blocks_ordered(self) -> "GateOptions":
        if self.max_blocks < self.min_blocks:
            raise ValueError(f"max_blocks {self.max_blocks} is below min_blocks {self.min_blocks}")
        return self


@dataclass
class GateContext:
    """Everything a gate may use. Earlier gates' results are in `results` (by gate name)."""

    contract: Contract
    contract_path: Path
    machine: ArchInfo
    options: GateOptions
    contract_problems: list[str] = field(default_factory=list)
    results: dict[str, GateResult] = field(default_factory=dict)
    progress: Callable[[str], None] = lambda message: None

    @property
    def device(self) -> str:
        """The torch device type the candidate runs on: cuda or cpu."""
        return device_type(self.machine)

    def problem(self) -> Problem:
        """The op's problem; raises ProblemError (the gate reports ERROR) when there is none."""
        return load_problem(self.contract.op)

    def cannot_run_here(self) -> str | None:
        """Why the candidate cannot run on this machine, or None when it can."""
        c, m = self.contract, self.machine
        if not m.is_gpu:
            return (None if c.backend == "torch"
                    else f"backend {c.backend} runs only on a CUDA GPU; this machine has none")
        targets = [h.arch for h in c.hardware.validated] + [h.arch for h in c.hardware.declared]
        if m.cute_arch not in {cute_arch_for(t) for t in targets}:
            return f"this machine is {m.arch}; the contract targets {', '.join(targets)}"
        return None


def arg_names(fn: Callable) -> list[str]:
    """The reference's positional parameter names: how the report names each input."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def always_applies(contract: Contract, arch: str) -> str | None:
    return None


def nothing_to_audit(result: GateResult) -> list[str]:
    return []


@dataclass(frozen=True)
class Gate:
    name: str
    title: str
    checks: str  # one sentence the report prints: what passing this gate means
    run: Callable[[GateContext], GateResult]
    needs: tuple[str, ...] = ()  # gates that must not have failed for this one to run
    # A gate among `needs` this one may run beside, started with it (each in its own sandbox; neither may time
    # anything) and counted only if that gate passes: the gate takes the longer of the two, not their sum
    beside: str | None = None
    # Why the gate has nothing to judge for this contract on a machine of this arch, or None. There it reports
    # NOT_RUN with this reason and the arch is validated without it; every other NOT_RUN validates nothing.
    inapplicable: Callable[[Contract, str], str | None] = always_applies
    # What in a recorded result (read back from a bundle) its own numbers contradict: a malformed detail, a
    # statistic that cannot come from the recorded samples, a status they do not support. [] when consistent.
    audit: Callable[[GateResult], list[str]] = nothing_to_audit


def registered() -> list[Gate]:
    return [importlib.import_module(name).GATE for name in GATE_MODULES]


def preload(ops: list[str]) -> None:
    """Import every judge module (the gates, and through them the evals and the sandbox's parent side; the problems
    of `ops`, and through them the references) before any candidate code runs: a candidate's process can write
    to the tree, and what the gate has already imported it cannot change."""
    registered()
    for op in ops:
        try:
            load_problem(op)
        except ProblemError:
            pass  # the gates that need it report the missing problem


def unjudged(contract: Contract, arch: str, results: list[GateResult]) -> list[str]:
    """`the X gate STATUS: why` for each gate that applies to `contract` on `arch` and did not PASS in `results`
    (or is missing from them). A bundle is PASSED, and validates its arch, only when there is none."""
    by_name = {r.gate: r for r in results}
    problems = []
    for gate in registered():
        if gate.inapplicable(contract, arch):
            continue
        result = by_name.get(gate.name)
        if result is None:
            problems.append(f"the {gate.name} gate is not in the bundle")
        elif result.status is not Status.PASSED:
            problems.append(f"the {gate.name} gate {result.status.value}: {result.reason or result.summary}")
    return problems


def verdict_of(contract: Contract, arch: str, results: list[GateResult]) -> Status:
    """A bundle's verdict: the worst status of the gates that apply on `arch` (a missing one counts as NOT_RUN) and
    of any gate that failed. PASSED means judged: every gate the contract requires there ran and passed; a gate
    that does not apply on the arch (benchmarks on a CPU, compile for a torch backend) neither blocks nor makes it."""
    applies = {g.name for g in registered() if not g.inapplicable(contract, arch)}
    by_name = {r.gate: r.status for r in results}
    return worst([by_name.get(name, Status.NOT_RUN) for name in applies]
                 + [r.status for r in results if r.status.failed])
