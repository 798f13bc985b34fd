"""One way to validate a file's data with pydantic and report what is wrong: `file: field: problem` lines."""

from __future__ import annotations

import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def problem_lines(source: str, e: ValidationError) -> list[str]:
    """One line per error. A whole-model check has no location; its message names its field first."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:
            loc, _, msg = msg.partition(": ") if re.match(r"^[\w.]+: ", msg) else ("<root>", "", msg)
        lines.append(f"{source}: {loc}: {msg}")
    return lines


def validate(model: type[Model], data: object, source: str, error: type[Exception], where: str = "<root>") -> Model:
    """`model` from a mapping read out of `source`, or `error` listing every problem (`where`: the mapping's
    place in the file, for the not-a-mapping case)."""
    if not isinstance(data, dict):
        raise error(f"{source}: {where}: expected a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error("\n".join(problem_lines(source, e))) from None
