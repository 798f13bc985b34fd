"""One way to report a pydantic validation error about a file: `file: field: problem` lines."""

from __future__ import annotations

import re

from pydantic import ValidationError


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
