"""The gating area's `k3forge` commands, one module each: op, contract, gate, bench, evidence, eval, task.

Each module defines `register(sub)`, which adds its parser with `func` set to a handler -> exit code. The model
commands (config, ckpt, generate) live in `model/kimi_k3/cli.py`; judging lives in `gates.core` and
`gates.checks`, never here.
"""

from __future__ import annotations

import importlib

COMMANDS = ("op", "contract", "gate", "bench", "evidence", "eval", "task")


def register(sub) -> None:
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
