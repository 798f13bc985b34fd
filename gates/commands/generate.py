"""`k3forge generate`: prefill then decode from a checkpoint directory."""

from __future__ import annotations

import json
import logging

import torch
from rich.console import Console

from gates.cli import UsageError
from model.kimi_k3.dispatch import DECODE_BACKENDS
from model.kimi_k3.engine import Engine, SamplingParams
from model.kimi_k3.loader import load_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens from a checkpoint")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (default bf16)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--decode-backend", choices=DECODE_BACKENDS, default="auto",
                   help="auto: the standard path (default); latency_specialized: contracted kernels inside their envelopes")
    p.add_argument("--json", action="store_true", help="end with one JSON line: tokens, logprobs, dispatch counts")
    p.set_defaults(func=run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids: {text!r} is not a comma-separated list of integers") from None
    if not ids:
        raise UsageError("--prompt-ids: empty prompt")
    return ids


def run(args) -> int:
    prompt = parse_ids(args.prompt_ids)
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens: must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    status = Console(stderr=True)
    with status.status(f"loading {args.ckpt}"):
        model = load_model(args.ckpt, act_dtype=DTYPES[args.dtype], device=args.device)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("model.kimi_k3").setLevel(logging.INFO)  # dispatch fallback reasons, each once
    engine = Engine(model, max_len=len(prompt) + args.max_new_tokens, decode_backend=args.decode_backend)
    try:
        gen = engine.generate([prompt], params)[0]
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps({"tokens": gen.tokens, "logprobs": gen.logprobs, "dispatch": engine.model.ops.report()}))
    else:
        print(" ".join(map(str, gen.tokens)))
    return 0
