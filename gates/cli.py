"""`k3forge`: one console command assembled from two areas, each adding its subcommands with `register(sub)`:
the model area (`model.kimi_k3.cli`: config, ckpt, generate) and the gating area (`gates.commands`: contract,
gate, bench, evidence, eval, task, op).

Exit codes: 0 success, 1 a gate or check failed, 2 a usage, config, contract, checkpoint or environment error.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

import gates.commands
import model.kimi_k3.cli
from model.kimi_k3.errors import EXIT_USAGE, UsageError

AREAS = (model.kimi_k3.cli, gates.commands)

err = Console(stderr=True, highlight=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3forge",
                                     description="Contracted, evidence-gated kernels for Kimi K3 decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in AREAS:
        area.register(sub)
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
    sys.exit(main())
