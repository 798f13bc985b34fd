"""`k3forge`: one console command; each subcommand lives in `gates/commands/<name>.py`.

Exit codes: 0 success, 1 a gate or check failed, 2 a usage, config, contract, checkpoint or environment error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console

# Each module defines `register(subparsers)`, which adds its parser with `func` set to a handler -> int.
COMMANDS = ("config", "ckpt", "generate", "op", "contract", "gate", "bench", "evidence", "eval", "task")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

err = Console(stderr=True, highlight=False)


class UsageError(Exception):
    """A problem with what the user asked for; printed without a traceback, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3forge", description="Contracted, evidence-gated kernels for Kimi K3 decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"gates.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kernels.contract import ContractError
    from model.kimi_k3.config import ConfigError
    from model.kimi_k3.weights import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ConfigError, CheckpointError, ContractError, FileNotFoundError) as e:
        err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
        return EXIT_USAGE


if __name__ == "__main__":
    # Commands import `gates.cli`; run that module's main so they share one UsageError class.
    from gates.cli import main as package_main

    sys.exit(package_main())
