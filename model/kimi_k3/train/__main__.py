"""`python -m model.kimi_k3.train --out DIR --seed S --minutes M --device cuda`: train the mini-K3 and write its
checkpoint (see model/kimi_k3/train/NOTES.md). Exit 0 on success, 2 on a usage error (one line on stderr)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from ..cli import output_directory, torch_device
from ..errors import EXIT_OK, EXIT_USAGE, UsageError
from .config import Recipe
from .loop import Run, train


def parse(argv: list[str]) -> Run:
    p = argparse.ArgumentParser(prog="python -m model.kimi_k3.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (new or empty)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data stream")
    p.add_argument("--minutes", type=float, default=4.0, help="training time limit (the checkpoint comes after)")
    p.add_argument("--steps", type=int, help="planned steps (the schedule); default: as many as fit in --minutes, "
                   "timed after a warm-up pass at each training length")
    p.add_argument("--device", default="cuda", help="cuda (bf16 autocast) or cpu (fp32)")
    p.add_argument("--tokens-per-step", type=int, help=f"default {Recipe.tokens_per_step}")
    p.add_argument("--lengths", help=f"training lengths, comma-separated (default {Recipe.lengths})")
    p.add_argument("--recency-fraction", type=float,
                   help=f"rows of data version 2's recency task (default {Recipe.recency_fraction}; with "
                        f"--window-fraction 0 too, version 1's data)")
    p.add_argument("--window-fraction", type=float,
                   help=f"rows of data version 2's windowed count (default {Recipe.window_fraction})")
    p.add_argument("--window-steps", type=int,
                   help="first steps of windowed-count rows only, before the mix (default 0: the mix from the start)")
    p.add_argument("--heldout-rows", type=int, default=16, help="held-out recall samples per length scored at the end")
    args = p.parse_args(argv)
    output_directory(args.out, "--out")
    if args.out.is_dir() and any(args.out.iterdir()):
        raise UsageError(f"--out {args.out}: not empty")
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1):
        raise UsageError("--minutes must be > 0 and --steps >= 1")
    recipe = Recipe()
    if args.tokens_per_step is not None:
        recipe = replace(recipe, tokens_per_step=args.tokens_per_step)
    if args.lengths:
        try:
            lengths = tuple(int(x) for x in args.lengths.split(","))
        except ValueError:
            raise UsageError(f"--lengths: {args.lengths!r} is not comma-separated integers") from None
        if min(lengths) < 64:
            raise UsageError("--lengths: each at least 64 (a recall sample needs room for its pairs)")
        recipe = replace(recipe, lengths=lengths)
    if args.window_steps is not None:
        if args.window_steps < 0:
            raise UsageError(f"--window-steps: {args.window_steps} is negative")
        recipe = replace(recipe, window_steps=args.window_steps)
    for name in ("recency_fraction", "window_fraction"):
        if getattr(args, name) is not None:
            recipe = replace(recipe, **{name: getattr(args, name)})
    if min(recipe.recency_fraction, recipe.window_fraction) < 0 or \
            recipe.recall_fraction + recipe.recency_fraction + recipe.window_fraction > 1 + 1e-9:
        raise UsageError("--recency-fraction and --window-fraction: each >= 0, with the recall rows' "
                         f"{recipe.recall_fraction} at most 1 in all")
    command = "python -m model.kimi_k3.train " + shlex.join(argv)
    return Run(args.out, args.seed, torch_device(args.device), args.minutes, args.steps, recipe, command,
               args.heldout_rows)


def main(argv: list[str] | None = None) -> int:
    try:
        run = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    record = train(run)
    print(json.dumps({k: record[k] for k in ("steps", "seconds", "tokens_per_s", "heldout", "checkpoint_bytes")}))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
