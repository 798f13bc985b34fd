"""`k3forge ckpt make`: a random, well-scaled checkpoint in the Hugging Face layout, with its tokenizer."""

from __future__ import annotations

from rich.console import Console

from gates.cli import UsageError
from model.kimi_k3.checkpoint import checkpoint_tensors, write_checkpoint
from model.kimi_k3.config import preset


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="make checkpoints")
    verbs = p.add_subparsers(dest="verb", required=True)
    make = verbs.add_parser("make", help="write a random checkpoint (safetensors, config.json, tokenizer.json)")
    make.add_argument("--preset", default="tiny", help="config preset (default tiny)")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dense-experts", action="store_true",
                      help="store routed experts as bf16 instead of compressed-tensors MXFP4")
    make.add_argument("--flat", action="store_true",
                      help="a flat kimi_linear config and unprefixed names instead of kimi_k3 with text_config")
    make.add_argument("--max-gb", type=float, default=4.0, help="refuse to write more than this (default 4)")
    make.set_defaults(func=run_make)


def run_make(args) -> int:
    cfg = preset(args.preset)
    if args.dense_experts:
        cfg = cfg.model_copy(update={"quantization_config": None})
    size = sum(t.dtype.itemsize * _numel(t.shape) for t in checkpoint_tensors(cfg).values()) / 1e9
    if size > args.max_gb:
        raise UsageError(f"--preset {args.preset}: the checkpoint would be {size:,.0f} GB (limit --max-gb {args.max_gb})")
    with Console(stderr=True).status(f"writing {args.preset} checkpoint to {args.out}"):
        out = write_checkpoint(cfg, args.out, seed=args.seed, nested=not args.flat)
    print(out)
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
