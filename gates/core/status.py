"""What a gate says: one status from a fixed set, the reason, and the numbers behind it."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Status(str, Enum):
    PASSED = "PASSED"
    FAILED_NUMERICS = "FAILED_NUMERICS"
    FAILED_COMPILE = "FAILED_COMPILE"
    FAILED_EVAL = "FAILED_EVAL"
    SLOWER = "SLOWER"
    NOT_RUN = "NOT_RUN"
    ERROR = "ERROR"

    @property
    def failed(self) -> bool:
        """A verdict against the change (NOT_RUN is no verdict)."""
        return self not in (Status.PASSED, Status.NOT_RUN)


# Worst first. NOT_RUN ranks above PASSED: what did not run was not judged, so a set of statuses is PASSED only
# when every one of them is (gates.core.registry.verdict_of leaves out the gates that do not apply on an arch).
SEVERITY = (Status.ERROR, Status.FAILED_COMPILE, Status.FAILED_NUMERICS, Status.FAILED_EVAL, Status.SLOWER,
            Status.NOT_RUN, Status.PASSED)


def worst(statuses) -> Status:
    """The most severe status: a failure if any, else NOT_RUN if anything did not run (or nothing did), else
    PASSED."""
    statuses = list(statuses)
    return min(statuses, key=SEVERITY.index) if statuses else Status.NOT_RUN


class GateResult(BaseModel):
    """One gate's outcome for one op on one machine. `details` holds the gate's own numbers (JSON)."""

    model_config = ConfigDict(extra="forbid")

    gate: str
    title: str
    status: Status
    reason: str = Field(default="", description="why it did not pass, or why it did not run")
    summary: str = Field(default="", description="one line a reviewer reads first")
    flags: list[str] = Field(default_factory=list, description="findings a reviewer must look at")
    seconds: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def not_run(cls, gate: str, title: str, reason: str) -> "GateResult":
        return cls(gate=gate, title=title, status=Status.NOT_RUN, reason=reason, summary=f"not run: {reason}")
