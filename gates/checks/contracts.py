"""Contract gate: the contract parses against the schema, agrees with the op registry, its entry points import
and its other validated archs have sound evidence (gates.core.contracts)."""

from __future__ import annotations

from gates.checks.benchmarks import never_timed
from gates.core.registry import Gate, GateContext
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
    if mine:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason="; ".join(mine), flags=flags,
                          summary=f"{len(mine)} contract problem(s)", details={"problems": mine, "envelope": envelope})
    return GateResult(gate=NAME, title=TITLE, status=Status.PASSED, flags=flags,
                      summary="schema, registry and evidence sound; implementation, reference and standard import",
                      details={"problems": [], "envelope": envelope})


GATE = Gate(NAME, TITLE, "the contract matches the schema and the registry, its entry points import, and its other "
            "validated archs have intact, fresh evidence", run)
