"""The gate runner: every registered gate for every contract (or the ops asked for), one evidence bundle per
op and arch under `evidence/<op>/<arch>/`, then the index.

On a CPU machine an existing bundle is kept, byte for byte, when the new run reaches the same judgement on the
same code (same_judgement): a CPU bundle holds verdicts, not timings, and what changes between such runs (the
date, the secret seed, the errors its inputs drew, the seconds taken) tells a reviewer nothing new, so `make
gate` on a fresh clone leaves committed CPU evidence as it is. A GPU bundle always records its run: its
timings are the evidence.

Exit codes: 0 every gate that ran passed; 1 a gate failed (or errored on the candidate); 2 a contract problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gates.core import caches, sandbox
from gates.core.contracts import load_contracts, parsed_contract_problems
from gates.core.machine import Environment, environment, gpu_memory_bytes, one_thread, release_cached_memory
from gates.core.registry import Gate, GateContext, GateOptions, preload, registered, verdict_of
from gates.core.sources import harness_digest, relative
from gates.core.status import GateResult, Status
from gates.evidence.bundle import Bundle, GitState, covered_sources, git_state, load_bundle, now, write_bundle
from gates.evidence.index import write_index
from gates.evidence.report import render_reports
from gates.evidence.verify import verify_bundle
from gates.problems import ProblemError, load_problem
from kernels.arch import ArchInfo, detect
from kernels.contract import Contract
from kernels.cute import CACHE_ENV
from model.kimi_k3.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE


class Reporter:
    """What the runner tells a user interface; the CLI shows it with rich."""

    def gate_started(self, op: str, gate: Gate) -> None: ...
    def note(self, text: str) -> None: ...
    def gate_done(self, op: str, result: GateResult) -> None: ...


@dataclass
class Outcome:
    bundles: list[tuple[Path, Bundle]] = field(default_factory=list)
    contract_problems: list[str] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)  # bundle directories left as they were (same judgement)

    @property
    def exit_code(self) -> int:
        if self.contract_problems:
            return EXIT_USAGE
        return EXIT_FAILED if any(b.verdict.failed for _, b in self.bundles) else EXIT_OK


def new_options(seed: int | None = None, **overrides) -> GateOptions:
    """Options with a secret seed drawn now, after the candidate is fixed (or the one given, to reproduce)."""
    return GateOptions(seed=secrets.randbits(63) if seed is None else seed, seed_given=seed is not None, **overrides)


# A gate beside another keeps its sandbox's memory while the host keeps its own. The H200's 141 GB held the KDA
# gate's numerics and the evals' model together; an H100's 80 GB did not (session 34: the evals asked for 9.2 GiB
# with ~70 GiB in use, and the eval crashed), so on a smaller GPU each such gate runs in its own place in the order.
BESIDE_MIN_GPU_BYTES = 100 * 2**30


def room_beside(machine: ArchInfo, gpu_bytes: int | None) -> bool:
    """Whether gates may run beside each other here: always on a CPU, on a GPU of BESIDE_MIN_GPU_BYTES or more."""
    return not machine.is_gpu or (gpu_bytes or 0) >= BESIDE_MIN_GPU_BYTES


def run_gates(contract: Contract, contract_path: Path, machine: ArchInfo, options: GateOptions,
              contract_problems: list[str] = (), reporter: Reporter = Reporter(),
              gates: list[Gate] | None = None) -> list[GateResult]:
    """Every gate in order; a gate whose prerequisite failed is NOT_RUN, a gate that crashes is an ERROR. A gate
    that may run beside another (Gate.beside) starts with it and is waited for before the next one starts (the
    benchmarks need the GPU to themselves); it is reported in its own place in the order, NOT_RUN after all if a
    gate it needs failed."""
    ctx = GateContext(contract=contract, contract_path=contract_path, machine=machine, options=options,
                      contract_problems=list(contract_problems), progress=reporter.note)
    order = gates if gates is not None else registered()
    ran_beside: dict[str, GateResult] = {}
    together = room_beside(machine, gpu_memory_bytes())
    if not together and any(g.beside for g in order):
        reporter.note(f"one gate at a time: this GPU has under {BESIDE_MIN_GPU_BYTES >> 30} GiB of memory")
    with one_thread(), ThreadPoolExecutor(max_workers=1) as pool:
        for gate in order:
            reporter.gate_started(contract.op, gate)
            result = ran_beside.pop(gate.name, None)
            if result is not None and _blocked(gate, ctx):
                result = None  # it ran beside a gate that then failed: what it found does not count
            if result is None:
                release_cached_memory()
                companions = {g.name: pool.submit(_run_gate, g, _beside_context(ctx, g, gate, reporter))
                              for g in order if together and g.beside == gate.name and not _blocked(g, ctx)}
                result = _run_gate(gate, ctx)
                ran_beside.update((name, future.result()) for name, future in companions.items())
            ctx.results[gate.name] = result
            reporter.gate_done(contract.op, result)
    return list(ctx.results.values())


def _blocked(gate: Gate, ctx: GateContext) -> str | None:
    """The first gate `gate` needs that has failed, or None."""
    return next((n for n in gate.needs if n in ctx.results and ctx.results[n].status.failed), None)


def _beside_context(ctx: GateContext, gate: Gate, host: Gate, reporter: Reporter) -> GateContext:
    """`gate`'s context while it runs beside `host`: the same results, its notes labelled as its own."""
    label = f"{gate.title.lower()} (beside {host.title.lower()})"
    return dataclasses.replace(ctx, progress=lambda text: reporter.note(f"{label}: {text}"))


def _run_gate(gate: Gate, ctx: GateContext) -> GateResult:
    t0 = time.perf_counter()
    if (blocked := _blocked(gate, ctx)) is not None:
        result = GateResult.not_run(gate.name, gate.title, f"the {blocked} gate {ctx.results[blocked].status.value}")
    else:
        try:
            result = gate.run(ctx)
        except Exception as e:
            result = GateResult(gate=gate.name, title=gate.title, status=Status.ERROR,
                                reason="".join(traceback.format_exception_only(e)).strip(),
                                summary="the gate raised", details={"traceback": traceback.format_exc(limit=-6)})
    result.seconds = time.perf_counter() - t0
    return result


def make_bundle(contract: Contract, contract_path: Path, machine: ArchInfo, env: Environment, git: GitState,
                harness: str, options: GateOptions, results: list[GateResult], command: str) -> Bundle:
    try:
        problem_file = load_problem(contract.op).source
    except ProblemError:
        problem_file = None
    return Bundle(op=contract.op, arch=machine.arch, created=now(), command=command, git=git,
                  contract_path=relative(contract_path), contract=contract.model_dump(mode="json"),
                  owners=contract.owners,
                  sources=covered_sources(contract, contract_path, problem_file,
                                          loaded=[path for r in results for path in r.details.get("loaded", [])]),
                  environment=env, options=options, harness=harness, gates=results,
                  verdict=verdict_of(contract, machine.arch, results))


def judgement(bundle: Bundle) -> tuple:
    """What a bundle judged and what it found, without what varies from run to run of the same check: the date,
    command, commit, environment, secret seed, seconds, summaries and the numbers the drawn inputs gave."""
    return (bundle.schema_version, bundle.op, bundle.arch, bundle.contract_path, bundle.contract, bundle.owners,
            bundle.sources, bundle.harness, bundle.options.model_dump(exclude={"seed"}),
            [(g.gate, g.status, g.flags) for g in bundle.gates])


def keeps_existing(directory: Path, new: Bundle, key: bytes | None) -> bool:
    """Whether the bundle at `directory` may stand for `new`: it can be trusted (signed when a key is
    configured) and judged the same (judgement)."""
    if verify_bundle(directory, key=key, require_signature=key is not None):
        return False
    return judgement(load_bundle(directory)) == judgement(new)


@contextlib.contextmanager
def compile_cache_of_its_own():
    """Kernels compiled while one op is gated persist in an empty directory of that op's run (kernels.cute's
    on-disk compile cache): a sandboxed child loads what an earlier child compiled from the same sources, and
    nothing compiled outside the run (by other code, or planted in a user's cache) is loaded into it."""
    previous = os.environ.get(CACHE_ENV)
    with tempfile.TemporaryDirectory(prefix="k3forge-compile-") as directory:
        os.environ[CACHE_ENV] = directory
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = previous


def unknown_ops(ops: list[str], known: dict) -> str | None:
    """`--ops: no valid contract for X (valid: ...)` when some of `ops` name no contract in `known`."""
    unknown = sorted(set(ops) - set(known))
    if not unknown:
        return None
    return f"--ops: no valid contract for {', '.join(unknown)} (valid: {', '.join(sorted(known)) or 'none'})"


def gate_all(contracts_dir: Path, out_dir: Path, ops: list[str] | None = None, options: GateOptions | None = None,
             reporter: Reporter = Reporter(), command: str = "k3forge gate", key: bytes | None = None) -> Outcome:
    """Check the contracts, gate each op this run covers, write its bundle (signed with `key`, if given) and the
    index."""
    machine = detect()
    if not Path(contracts_dir).is_dir():
        return Outcome(contract_problems=[f"{contracts_dir}: <dir>: no such contracts directory"])
    # Parsed once, and every judge module imported, before the contract check imports the entry points (the first
    # candidate code to run): a candidate that rewrites its contract file or a judge's source at import changes
    # nothing this run judges by, and the write itself is a finding of the sandbox.
    contracts, parse_problems = load_contracts(contracts_dir)
    preload([c.op for c in contracts.values()])
    # other archs' evidence is where the contracts say (evidence/<op>/<arch> beside contracts/), wherever --out writes
    problems = parsed_contract_problems(contracts, parse_problems, Path(contracts_dir).resolve().parent / "evidence",
                                        producing_arch=machine.arch)
    by_op = {c.op: (path, c) for path, c in contracts.items()}
    if ops:
        if unknown := unknown_ops(ops, by_op):
            return Outcome(contract_problems=problems + [f"{contracts_dir}: {unknown}"])
    selected = [by_op[op] for op in (ops or sorted(by_op))]
    if problems:
        reporter.note(f"{len(problems)} contract problem(s)")
    env, git, harness = environment(machine), git_state(), harness_digest()
    env.candidate_isolation = sandbox.isolation_account() if sandbox.CONFINE else "not confined: confining is off"
    reporter.note(f"candidate code: {env.candidate_isolation}")
    options = options or new_options()
    outcome = Outcome(contract_problems=problems)
    for path, contract in selected:
        with compile_cache_of_its_own(), caches.copies_of_its_own():
            results = run_gates(contract, path, machine, options, problems, reporter)
        bundle = make_bundle(contract, path, machine, env, git, harness, options, results, command)
        directory = Path(out_dir) / contract.op / machine.arch
        if not machine.is_gpu and keeps_existing(directory, bundle, key):
            outcome.kept.append(directory)
        else:
            write_bundle(directory, bundle, render_reports(bundle), key)
        outcome.bundles.append((directory, bundle))
    if selected:
        write_index(Path(out_dir))
    return outcome
