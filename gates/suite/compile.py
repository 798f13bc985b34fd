"""Compile gate: every kernel compiles for every arch the contract validates or declares, CPU machines included,
across the envelope's distinct compile keys, within the contract's resource bounds.

The protocol a specialized module follows (backends cutedsl and triton):
    compile_keys(contract) -> list[key]   the distinct compilations the envelope needs (dtypes, head counts,
                                          tile configs: whatever changes the generated code)
    compile(key, target) -> CompileReport compile for a target ('sm_90a', 'sm_100a'; kernels.arch.cute_arch_for)
                                          and report each kernel's resources: kernels.cute.compile_for_arch
Each arch compiles in its own spawned process with CUTE_DSL_ARCH set to the target before cutlass is imported,
so no GPU is needed.
"""

from __future__ import annotations

from gates.registry import Gate, GateContext
from gates.sandbox import Sandbox, SandboxError, TamperError
from gates.status import GateResult, Status
from kernels.arch import cute_arch_for
from kernels.contract import Resources

NAME, TITLE = "compile", "Compile"
BOUNDS = (("registers", "max_registers"), ("spill_bytes", "max_spill_bytes"), ("shared_bytes", "max_shared_bytes"))


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


def run(ctx: GateContext) -> GateResult:
    c = ctx.contract
    if c.backend == "torch":
        return GateResult.not_run(NAME, TITLE, "torch backend: nothing to compile")
    archs = [h.arch for h in c.hardware.validated] + [h.arch for h in c.hardware.declared]
    module = c.implementation.partition(":")[0]
    compiles: list[dict] = []
    details = {"archs": archs, "compiles": compiles, "bounds": c.resources.model_dump(), "violations": []}
    for arch in archs:
        ctx.progress(f"compile for {arch}")
        env = {"CUTE_DSL_ARCH": cute_arch_for(arch)} if c.backend == "cutedsl" else {}
        try:
            with Sandbox(env) as box:
                reply = box.request("compile", module=module, contract=c.model_dump(mode="json"), archs=[arch])
        except TamperError:
            raise
        except SandboxError as e:
            return GateResult(gate=NAME, title=TITLE, status=Status.FAILED_COMPILE, reason=str(e),
                              summary=f"compile for {arch} failed before any kernel was built", details=details)
        if "protocol" in reply:
            return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=reply["protocol"],
                              summary="the implementation does not follow the compile protocol")
        compiles.extend(reply["compiles"])
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


GATE = Gate(NAME, TITLE, "every compile key builds for every validated and declared arch, within the resource bounds", run,
            needs=("contracts",))
