"""What an eval gate reports: a status, the checks behind it, its numbers and per-bucket tables.

A check compares one statistic with its bound; the eval's status follows from its checks, so a verdict can
always be traced to the number that decided it.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gates.core.status import Status

# An eval ends PASSED, FAILED_EVAL (a statistic exceeded its bound), NOT_RUN (the reason says why; not a
# pass) or ERROR (the eval itself crashed): the gate runner's statuses.
# A NaN or infinite statistic is evidence too: JSON carries it as the string "NaN" / "Infinity", not null.
JSON_FLOATS = ConfigDict(ser_json_inf_nan="strings")


class Check(BaseModel):
    """One statistic against its bound; passed is None when the check could not run (detail says why)."""

    model_config = ConfigDict(frozen=True, **JSON_FLOATS)

    name: str
    passed: bool | None
    value: float | None = None
    bound: float | None = None
    detail: str = ""

    @classmethod
    def at_most(cls, name: str, value: float, bound: float, detail: str = "") -> "Check":
        return cls(name=name, passed=bool(value <= bound), value=float(value), bound=float(bound), detail=detail)

    @classmethod
    def at_least(cls, name: str, value: float, bound: float, detail: str = "") -> "Check":
        return cls(name=name, passed=bool(value >= bound), value=float(value), bound=float(bound), detail=detail)

    @classmethod
    def no_worse(cls, name: str, value: float, absolute: float, standard: float | None, slack: float,
                 detail: str = "") -> "Check":
        """value <= the absolute bound or, when the standard path's own value of the statistic (its distance from
        the reference, measured in the same run) is known, <= slack x that if larger: a candidate is held to the
        precision the shipped path has, never to a tighter one the dtype cannot give."""
        bound = yardstick_bound(absolute, standard, slack)
        if standard is not None:
            detail = f"{detail}; yardstick {standard:.3g} (bound: the larger of {absolute:g} and {slack:g}x that)"
        return cls.at_most(name, value, bound, detail.lstrip("; "))

    @classmethod
    def pending(cls, name: str, reason: str) -> "Check":
        return cls(name=name, passed=None, detail=reason)


class Table(BaseModel):
    """Rows of one kind of measurement, e.g. one row per context-length bucket."""

    model_config = JSON_FLOATS

    title: str
    columns: list[str]
    rows: list[list[Any]] = Field(default_factory=list)

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"table {self.title!r}: {len(values)} values for {len(self.columns)} columns")
        self.rows.append([_plain(v) for v in values])


class Plot(BaseModel):
    """Numbers that compare, drawn as grouped bars in the HTML report: a group per category (e.g. a context
    length), a bar per series (the candidate, the standard path beside it), the bound as a dashed line."""

    model_config = JSON_FLOATS

    title: str
    x_label: str
    y_label: str
    categories: list[str]
    series: dict[str, list[float | None]]
    bound: float | None = None


class EvalResult(BaseModel):
    model_config = JSON_FLOATS

    name: str
    status: Status
    reason: str = ""  # why NOT_RUN or ERROR
    metrics: dict[str, float | int | str | bool] = Field(default_factory=dict)
    checks: list[Check] = Field(default_factory=list)
    tables: list[Table] = Field(default_factory=list)
    plots: list[Plot] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    budget: dict[str, Any] = Field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def from_checks(cls, name: str, checks: list[Check], **fields) -> "EvalResult":
        """FAILED_EVAL if any check failed; PASSED if the rest passed (pending checks are listed, not passed)."""
        ran = [c for c in checks if c.passed is not None]
        if not ran:
            return cls(name=name, status=Status.NOT_RUN, reason="no check could run", checks=checks, **fields)
        status = Status.PASSED if all(c.passed for c in ran) else Status.FAILED_EVAL
        return cls(name=name, status=status, checks=checks, **fields)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]


def _plain(value: Any) -> Any:
    """Table cells as JSON scalars (tensors and numpy numbers become Python numbers)."""
    if hasattr(value, "item"):
        return value.item()
    return value


def yardstick_bound(absolute: float, standard: float | None, slack: float) -> float:
    """The larger of an absolute bound and slack x the standard path's own value (a NaN standard gives no room)."""
    if standard is None or math.isnan(standard):
        return absolute
    return max(absolute, slack * standard)


def badness(value: float) -> float:
    """Sort key that ranks NaN worst, so taking the max of statistics never hides a NaN (NaN never passes)."""
    return math.inf if math.isnan(value) else value
