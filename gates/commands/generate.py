"""`k3forge generate`: prefill then decode from a checkpoint directory, optionally tensor-parallel
(`--tp N`: N local processes, gloo on CPU, NCCL on GPUs) and speculative (`--spec-tokens K`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
from rich.console import Console

from gates.cli import UsageError
from model.kimi_k3.dispatch import DECODE_BACKENDS
from model.kimi_k3.distributed import run_tp
from model.kimi_k3.drafters import Drafter, NgramDrafter, SyntheticDrafter
from model.kimi_k3.engine import Engine, Generation, SamplingParams
from model.kimi_k3.loader import load_config, load_model
from model.kimi_k3.parallel import TP

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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda; with --tp N > 1 on cuda, rank r runs on cuda:r")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one local process each (default 1)")
    p.add_argument("--spec-tokens", type=int, default=0, help="draft tokens verified per step (0 = no speculation)")
    p.add_argument("--drafter", help="with --spec-tokens: ngram (prompt lookup, the default) or synthetic:A "
                                     "(replays the greedy trajectory so that exactly A drafts are accepted per step)")
    p.add_argument("--decode-backend", choices=DECODE_BACKENDS, default="auto",
                   help="auto: the standard path (default); latency_specialized: contracted kernels inside their envelopes")
    p.add_argument("--json", action="store_true",
                   help="end with one JSON line: tokens, logprobs, dispatch counts (and accepted_per_step)")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Request:
    """Everything a rank needs to generate (it travels to the TP ranks' processes)."""

    ckpt: str
    dtype: str
    prompt: list[int]
    params: SamplingParams
    spec_tokens: int
    drafter: str
    decode_backend: str


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids: {text!r} is not a comma-separated list of integers") from None
    if not ids:
        raise UsageError("--prompt-ids: empty prompt")
    return ids


def synthetic_accept(drafter: str) -> int | None:
    """A of `synthetic:A`, None for `ngram`; a UsageError for anything else."""
    if drafter == "ngram":
        return None
    name, _, value = drafter.partition(":")
    if name != "synthetic" or not value.isdigit():
        raise UsageError(f"--drafter: {drafter!r}; expected ngram or synthetic:A (A accepted drafts per step)")
    return int(value)


def generate_on_rank(tp: TP, device: torch.device, req: Request) -> tuple[Generation, dict]:
    """This rank's generation and its dispatcher's report (per-op specialized/standard counts, reasons)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("model.kimi_k3").setLevel(logging.INFO)  # dispatch fallback reasons, each once
    model = load_model(req.ckpt, tp=tp, act_dtype=DTYPES[req.dtype], device=device)
    engine = Engine(model, max_len=len(req.prompt) + req.params.max_new_tokens + req.spec_tokens,
                    decode_backend=req.decode_backend)
    drafter: Drafter | None = None
    if req.spec_tokens:
        accept = synthetic_accept(req.drafter)
        drafter = NgramDrafter() if accept is None else SyntheticDrafter.from_greedy(
            engine, [req.prompt], req.params.max_new_tokens, accept, req.spec_tokens)
    gen = engine.generate([req.prompt], req.params, req.spec_tokens, drafter)[0]
    return gen, model.ops.report()


def run(args) -> int:
    prompt = parse_ids(args.prompt_ids)
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens: must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.tp < 1:
        raise UsageError("--tp: must be >= 1")
    if args.spec_tokens < 0:
        raise UsageError("--spec-tokens: must be >= 0")
    if args.drafter and not args.spec_tokens:
        raise UsageError("--drafter: only used with --spec-tokens K > 0")
    drafter = args.drafter or "ngram"
    accept = synthetic_accept(drafter)
    if accept is not None and not (accept <= args.spec_tokens and args.temperature == 0):
        raise UsageError(f"--drafter synthetic:{accept}: needs A <= --spec-tokens ({args.spec_tokens}) and "
                         "--temperature 0 (it replays the greedy trajectory)")
    load_config(args.ckpt)[0].check_tp(args.tp)  # before any rank starts
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    req = Request(args.ckpt, args.dtype, prompt, params, args.spec_tokens, drafter, args.decode_backend)
    status = Console(stderr=True)
    try:
        with status.status(f"generating from {args.ckpt} (TP{args.tp})"):
            gen, dispatch = run_tp(generate_on_rank, args.tp, req, device=args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = {"tokens": gen.tokens, "logprobs": gen.logprobs, "dispatch": dispatch}
    if args.spec_tokens:
        out["accepted_per_step"] = gen.accepted
    if args.json:
        print(json.dumps(out))
    else:
        print(" ".join(map(str, gen.tokens)))
        if args.spec_tokens:
            mean = sum(gen.accepted) / max(1, len(gen.accepted))
            status.print(f"{len(gen.accepted)} verification steps, {mean:.2f} drafts accepted per step")
    return 0
