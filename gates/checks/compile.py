"""Compile gate: every kernel compiles for every arch the contract validates or declares, CPU machines included,
across the envelope's distinct compile keys, within the contract's resource bounds.

The protocol the module defining the implementation's function follows (backends cutedsl and triton; the module
that defines it, not one that re-exports it, so what compiles is the code under test):
    compile_keys(contract) -> list[key]   the distinct compilations the envelope needs (dtypes, head counts,
                                          tile configs: whatever changes the generated code)
    compile(key, target) -> CompileReport compile for a target ('sm_90a', 'sm_100a'; kernels.arch.cute_arch_for)
                                          and report each kernel's resources: kernels.cute.compile_for_arch
Each arch compiles in spawned processes with CUTE_DSL_ARCH set to the target before cutlass is imported, so no
GPU is needed; the keys are split over up to one process per core (compiling is single-threaded), and the
results keep the order of compile_keys(). The repository files the compiling processes loaded are recorded
(`loaded`): the bundle covers them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from gates.core.registry import Gate, GateContext
from gates.core.sandbox import Sandbox, SandboxError, TamperError
from gates.core.status import GateResult, Status
from kernels.arch import cute_arch_for
from kernels.contract import Contract, Resources

NAME, TITLE = "compile", "Compile"
BOUNDS = (("registers", "max_registers"), ("spill_bytes", "max_spill_bytes"), ("shared_bytes", "max_shared_bytes"))
MAX_PROCESSES = 8  # each imports torch and the compiler (~1 GB); beyond this, start-up outweighs the split


def resource_violations(compiles: list[dict], bounds: Resources) -> list[str]:
    """`key on arch: kernel: registers 168 > max_registers 128` for every kernel over a contract bound."""
    out = []
    for c in compiles:
        for k in c.get("kernels", []):
            for used, limit in BOUNDS:
                bound = getattr(bounds, limit)
                if bound is not None and k[used] > bound:
                    out.append(f"{c['key']} on {c['arch']}: {k['kernel']}: {used} {k[used]} > {limit} {bound}")
    return out


def inapplicable(contract: Contract, arch: str) -> str | None:
    """A torch backend has no kernel of its own: its archs are validated without this gate."""
    return "torch backend: nothing to compile" if contract.backend == "torch" else None


def run(ctx: GateContext) -> GateResult:
    c = ctx.contract
    if reason := inapplicable(c, ctx.machine.arch):
        return GateResult.not_run(NAME, TITLE, reason)
    archs = [h.arch for h in c.hardware.validated] + [h.arch for h in c.hardware.declared]
    compiles: list[dict] = []
    details = {"archs": archs, "compiles": compiles, "bounds": c.resources.model_dump(), "violations": []}
    shards = max(1, min(MAX_PROCESSES, os.cpu_count() or 1))
    ctx.progress(f"compile for {', '.join(archs)} in {shards} process(es) per arch")

    def compile_shard(arch: str, index: int) -> dict:
        env = {"CUTE_DSL_ARCH": cute_arch_for(arch)} if c.backend == "cutedsl" else {}
        try:
            with Sandbox(env) as box:
                reply = box.request("compile", entry=c.implementation, contract=c.model_dump(mode="json"),
                                    archs=[arch], shard=[index, shards])
                return {**reply, "loaded": sorted(box.loaded)}
        except TamperError:
            raise
        except SandboxError as e:
            return {"died": str(e)}

    with ThreadPoolExecutor(max_workers=shards) as pool:
        futures = {(arch, i): pool.submit(compile_shard, arch, i) for arch in archs for i in range(shards)}
        replies = {job: future.result() for job, future in futures.items()}
    for (arch, _), reply in replies.items():
        if "died" in reply:
            return GateResult(gate=NAME, title=TITLE, status=Status.FAILED_COMPILE, reason=reply["died"],
                              summary=f"compile for {arch} failed before any kernel was built", details=details)
        if "protocol" in reply:
            return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=reply["protocol"],
                              summary="the implementation does not follow the compile protocol")
    details["loaded"] = sorted({path for reply in replies.values() for path in reply.get("loaded", [])})
    for arch in archs:  # shard i holds keys i, i + shards, ...: interleave them back into compile_keys() order
        parts = [replies[arch, i]["compiles"] for i in range(shards)]
        compiles.extend(part[j] for j in range(max(map(len, parts))) for part in parts if j < len(part))
    if not compiles:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason="compile_keys() returned no keys",
                          summary="nothing was compiled", details=details)
    errors = [f"{r['key']} on {r['arch']}: {r['error']}" for r in compiles if "error" in r]
    violations = details["violations"] = resource_violations(compiles, c.resources)
    if errors or violations:
        return GateResult(gate=NAME, title=TITLE, status=Status.FAILED_COMPILE, reason="; ".join(errors + violations),
                          summary=f"{len(errors)} compile error(s), {len(violations)} resource bound(s) exceeded",
                          details=details)
    keys = len({r["key"] for r in compiles})
    return GateResult(gate=NAME, title=TITLE, status=Status.PASSED, details=details,
                      summary=f"{keys} key(s) × {len(archs)} arch(s) compiled ({', '.join(archs)}), within bounds")


GATE = Gate(NAME, TITLE, "every compile key builds for every validated and declared arch, within the resource bounds",
            run, needs=("contracts",), inapplicable=inapplicable)
