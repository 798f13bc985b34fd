"""`python -m model.kimi_k3.bench layer|step ...`: the same commands as `k3forge bench layer|step`."""

import argparse
import sys

from .cli import add_commands
from .run import BenchError

parser = argparse.ArgumentParser(prog="python -m model.kimi_k3.bench")
add_commands(parser.add_subparsers(dest="what", required=True))
args = parser.parse_args()
try:
    sys.exit(args.func(args))
except BenchError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
