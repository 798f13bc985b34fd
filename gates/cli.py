"""`k3forge`: one console command assembled from two areas, each adding its subcommands with `register(sub)`:
the model area (`model.kimi_k3.cli`: config, ckpt, generate) and the gating area (`gates.commands`: contract,
gate, bench, evidence, eval, task, op).

Exit codes: 0 success, 1 a gate or check failed, 2 a usage, config, contract, checkpoint or environment error,
130 interrupted (Ctrl-C). Every error a user can cause ends the same way: one message on stderr, printed as
plain text (a path may hold anything, rich markup included), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import PurePath

import yaml
from pydantic import ValidationError

import gates.commands
import model.kimi_k3.cli
from gates.core.contracts import text_problem
from gates.evidence.signing import SigningKeyError
from gates.tasks.schema import TaskError
from kernels.contract import ContractError
from kernels.validation import problem_lines
from model.kimi_k3.config import ConfigError
from model.kimi_k3.errors import EXIT_USAGE, UsageError
from model.kimi_k3.weights import CheckpointError

AREAS = (model.kimi_k3.cli, gates.commands)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
# Errors in what the user asked for or in the files they named; anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, ConfigError, CheckpointError, ContractError, TaskError, SigningKeyError, OSError,
               json.JSONDecodeError, ValidationError, yaml.YAMLError, UnicodeDecodeError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3forge",
                                     description="Contracted, evidence-gated kernels for Kimi K3 decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in AREAS:
        area.register(sub)
    return parser


def undecodable_file(e: UnicodeDecodeError) -> str | None:
    """The file a UnicodeDecodeError came from, when a Path.read_text on the way raised it (how every reader here
    opens the files a user names): the error itself carries only the bytes."""
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "read_text" and isinstance(frame.f_locals.get("self"), PurePath):
            return str(frame.f_locals["self"])
        tb = tb.tb_next
    return None


def error_message(e: BaseException) -> str:
    """What went wrong, in the words of the file or option concerned: an OSError as `path: reason`, a pydantic
    error as its `model: field: problem`s on one line, a file that is not text as `path: not UTF-8 text`."""
    if isinstance(e, UnicodeDecodeError):
        where = undecodable_file(e)
        return f"{where or 'a file read'}: {text_problem(e)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    if isinstance(e, ValidationError):
        return "; ".join(problem_lines(e.title, e))
    return str(e)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        print(f"error: {error_message(e)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
