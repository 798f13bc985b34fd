"""Contract gate: the contract parses against the schema, agrees with the op registry, its entry points import
and its other validated archs have sound evidence (gates.core.contracts); and the static screen of the
implementation's code (gates.core.screen), whose findings the report lists and whose cheating ones fail the gate,
so that such a candidate is never called."""

from __future__ import annotations

from dataclasses import asdict

from gates.checks.benchmarks import never_timed
from gates.core.registry import Gate, GateContext
from gates.core.screen import screen, screened_files
from gates.core.sources import relative
from gates.core.status import GateResult, Status
from kernels.contract import evidence_dir

NAME, TITLE = "contracts", "Contract"


def run(ctx: GateContext) -> GateResult:
    c = ctx.contract
    mine = [p for p in ctx.contract_problems if p.startswith(f"{ctx.contract_path}:")]
    envelope = {
        "backend": c.backend,
        "implementation": c.implementation, "reference": c.reference, "standard": c.standard,
        "replaces": c.replaces,
        "validated": [f"{h.arch} ({', '.join(h.devices)}): {evidence_dir(c.op, h.arch)}" for h in c.hardware.validated],
        "declared": [f"{h.arch} ({', '.join(h.devices)})" for h in c.hardware.declared],
        "tp_sizes": c.tp_sizes,
        "batch": f"{c.batch.min}–{c.batch.max}",
        "spec_tokens": f"{c.spec_tokens.min}–{c.spec_tokens.max}",
        "dtypes": c.dtypes.model_dump(exclude_none=True),
        "shapes": c.shapes,
        "fallback": c.fallback,
    }
    flags = [note] if (note := never_timed(c)) else []
    findings = screen(c.implementation)
    details = {"problems": mine, "envelope": envelope, "screen": [asdict(f) for f in findings],
               "screened": [relative(p) for p in screened_files(c.implementation)]}
    cheats = [f.line() for f in findings if f.cheat]
    if mine or cheats:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason="; ".join(mine + cheats), flags=flags,
                          summary=(f"{len(mine)} contract problem(s), {len(cheats)} static finding(s) that can only be "
                                   "cheating"), details=details)
    reviewed = f"; static screen: {len(findings)} finding(s) to review" if findings else "; static screen clean"
    return GateResult(gate=NAME, title=TITLE, status=Status.PASSED, flags=flags, details=details,
                      summary="schema, registry and evidence sound; implementation, reference and standard import"
                              + reviewed)


def audit(result: GateResult) -> list[str]:
    """A PASSED contracts gate whose recorded static screen holds a finding that can only be cheating."""
    cheats = [f for f in result.details.get("screen", []) if isinstance(f, dict) and f.get("cheat")]
    if result.status is Status.PASSED and cheats:
        return [f"PASSED with {len(cheats)} static finding(s) that can only be cheating"]
    return []


GATE = Gate(NAME, TITLE, "the contract matches the schema and the registry, its entry points import, its other "
            "validated archs have intact, fresh evidence, and a static screen of the implementation finds nothing "
            "that can only be cheating", run, audit=audit)
