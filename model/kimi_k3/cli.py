"""The model area of the `k3forge` command: `config show`, `ckpt make` and `generate` (`gates/cli.py` adds the
gating area's commands beside them), and the command line's shared vocabulary.

The vocabulary (UsageError and the exit codes, `model/kimi_k3/errors.py`) is defined in the lower layer, because
`gates` imports `model` and never the reverse; the checks of options every command validates before it starts work
(output paths, devices) are defined here for the same reason: the gating area's commands use the same names, and
`gates/cli.py` turns every UsageError into one line and exit code 2 for both areas.

    config show   the config (Hugging Face field names), MLA layer ids and every rank-local weight
    ckpt make     a random, well-scaled checkpoint in the Hugging Face layout, with its tokenizer
    generate      prefill then decode from a checkpoint directory, optionally tensor-parallel (`--tp N`: N local
                  processes, gloo on CPU, NCCL on GPUs) and speculative (`--spec-tokens K`); on a GPU the decode
                  steps replay a CUDA graph (the collectives captured in it) unless `--eager`
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernels.contract import ContractError
from model.kimi_k3.cache import KV_CACHE_DTYPES
from model.kimi_k3.checkpoint import checkpoint_tensors, write_checkpoint
from model.kimi_k3.config import KimiK3Config, preset
from model.kimi_k3.dispatch import DECODE_BACKENDS, detect
from model.kimi_k3.distributed import run_tp, tp_backend
from model.kimi_k3.drafters import Drafter, NgramDrafter, SyntheticDrafter
from model.kimi_k3.engine import Engine, Generation, SamplingParams, check_fits, positions_needed
from model.kimi_k3.errors import UsageError
from model.kimi_k3.loader import load_config, load_model
from model.kimi_k3.model import KimiK3Model
from model.kimi_k3.ops.registry import CONTRACTS_DIR, load_specialized
from model.kimi_k3.parallel import TP


def output_directory(path: Path, option: str) -> Path:
    """`path` if a command can write files into it: a writable directory, or one it can create (its nearest
    existing ancestor a writable directory); else a UsageError naming the option."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a directory")
    ancestor = next(p for p in (path, *path.parents) if p.exists())
    if not ancestor.is_dir():
        raise UsageError(f"{option} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: {ancestor} is not writable")
    return path


def output_file(path: Path, option: str) -> Path:
    """`path` if a command can write it: not a directory, writable where it exists, in a directory it can write."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: is not writable")
    output_directory(path.parent, option)
    return path


def torch_device(text: str, option: str = "--device") -> torch.device:
    """The device `text` names if this machine has it: cpu, or cuda (cuda:N) with a GPU N."""
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise UsageError(f"{option} {text}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"{option} {text}: cpu or cuda")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise UsageError(f"{option} {text}: this machine has {gpus} CUDA GPU(s)")
    return device


def register(sub) -> None:
    """Add this area's commands to the `k3forge` subparsers; each parser's `func` is its handler -> exit code."""
    _register_config(sub)
    _register_ckpt(sub)
    _register_generate(sub)


# ------------------------------------------------------------------------------------------------ config show


def _register_config(sub) -> None:
    p = sub.add_parser("config", help="inspect a K3 config")
    verbs = p.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="print a config and the rank-local shape of every weight")
    src = show.add_mutually_exclusive_group()
    src.add_argument("--preset", default="k3", help="k3 (the real config) or tiny (CPU tests); default k3")
    src.add_argument("--config", help="a config.json or checkpoint directory instead of a preset")
    show.add_argument("--tp", type=int, default=1, help="tensor-parallel size for the rank-local shapes")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=run_config_show)


def describe(cfg: KimiK3Config, tp: int) -> dict:
    """Config, MLA layer ids and {parameter: {shape, dtype}} of rank 0 at TP size tp."""
    cfg.check_tp(tp)
    with torch.device("meta"):
        model = KimiK3Model(cfg, TP(0, tp))
    weights = {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
               for name, p in model.named_parameters()}
    return {"config": cfg.to_hf_dict(nested=False), "tp": tp, "mla_layer_ids": cfg.mla_layer_ids,
            "kda_layer_ids": [i for i in range(cfg.num_hidden_layers) if not cfg.is_mla_layer(i)],
            "weights": weights}


def run_config_show(args) -> int:
    cfg = KimiK3Config.from_file(args.config) if args.config else preset(args.preset)
    info = describe(cfg, args.tp)
    if args.json:
        print(json.dumps(info))
        return 0
    out = Console()
    fields = Table(title="config (text_config)", show_header=False)
    for key, value in info["config"].items():
        if key != "quantization_config":
            fields.add_row(key, escape(json.dumps(value)))
    fields.add_row("quantization", "MXFP4 routed experts" if cfg.experts_quantized else "none (dense experts)")
    out.print(fields)
    out.print(f"mla_layer_ids (0-indexed): {info['mla_layer_ids']}")
    weights = Table(title=f"rank-local weights at TP{args.tp}")
    for col in ("parameter", "shape", "dtype"):
        weights.add_column(col)
    for name, w in info["weights"].items():
        weights.add_row(name, str(w["shape"]), w["dtype"])
    out.print(weights)
    return 0


# ------------------------------------------------------------------------------------------------ ckpt make


def _register_ckpt(sub) -> None:
    p = sub.add_parser("ckpt", help="make checkpoints")
    verbs = p.add_subparsers(dest="verb", required=True)
    make = verbs.add_parser("make", help="write a random checkpoint (safetensors, config.json, tokenizer.json)")
    make.add_argument("--preset", default="tiny", help="config preset (default tiny)")
    make.add_argument("--out", required=True, type=Path, help="output directory (new or empty, unless --force)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dense-experts", action="store_true",
                      help="store routed experts as bf16 instead of compressed-tensors MXFP4")
    make.add_argument("--flat", action="store_true",
                      help="a flat kimi_linear config and unprefixed names instead of kimi_k3 with text_config")
    make.add_argument("--max-gb", type=float, default=4.0, help="refuse to write more than this (default 4)")
    make.add_argument("--force", action="store_true",
                      help="write into a directory that is not empty (files of a checkpoint's names are replaced)")
    make.set_defaults(func=run_ckpt_make)


def run_ckpt_make(args) -> int:
    output_directory(args.out, "--out")
    if args.out.is_dir() and any(args.out.iterdir()) and not args.force:
        raise UsageError(f"--out {args.out}: not empty; --force writes the checkpoint into it anyway")
    cfg = preset(args.preset)
    if args.dense_experts:
        cfg = cfg.model_copy(update={"quantization_config": None})
    size = sum(t.dtype.itemsize * _numel(t.shape) for t in checkpoint_tensors(cfg).values()) / 1e9
    if size > args.max_gb:
        raise UsageError(f"--preset {args.preset}: the checkpoint would be {size:,.0f} GB "
                         f"(limit --max-gb {args.max_gb})")
    with Console(stderr=True).status(escape(f"writing {args.preset} checkpoint to {args.out}")):
        out = write_checkpoint(cfg, args.out, seed=args.seed, nested=not args.flat)
    print(out)
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------------------------ generate


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _register_generate(sub) -> None:
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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one local process each (default 1); "
                                                     "on cuda one GPU per rank, NCCL between them")
    p.add_argument("--eager", action="store_true",
                   help="on cuda, run the decode steps eagerly instead of replaying a CUDA graph of the step")
    p.add_argument("--spec-tokens", type=int, default=0, help="draft tokens verified per step (0 = no speculation)")
    p.add_argument("--drafter", help="with --spec-tokens: ngram (prompt lookup, the default) or synthetic:A "
                                     "(replays the greedy trajectory so that exactly A drafts are accepted per step)")
    p.add_argument("--decode-backend", choices=DECODE_BACKENDS, default="auto",
                   help="auto: the standard path (default); "
                        "latency_specialized: contracted kernels inside their envelopes")
    p.add_argument("--contracts", type=Path, default=CONTRACTS_DIR,
                   help="with latency_specialized: the contracts directory (default: this checkout's contracts/)")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                   help="the MLA cache: auto (the activation dtype, default) or fp8 (e4m3 entries, scale 1, as "
                        "vLLM's kv_cache_dtype=fp8: half the bytes)")
    p.add_argument("--json", action="store_true",
                   help="end with one JSON line: tokens, logprobs, dispatch counts, cuda_graphs (captured sizes "
                        "and replays, null when eager) and, with --spec-tokens, accepted_per_step")
    p.set_defaults(func=run_generate)


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
    cuda_graphs: bool = False  # decode steps replay a CUDA graph captured at batch 1
    kv_cache_dtype: str = "auto"
    contracts_dir: str = str(CONTRACTS_DIR)  # latency_specialized's contracts


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


def generate_on_rank(tp: TP, device: torch.device, req: Request) -> tuple[Generation, dict, dict | None]:
    """This rank's generation, its dispatcher's report (per-op specialized/standard counts, reasons) and, with
    CUDA graphs, the captured batch sizes and how many decode steps replayed them."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("model.kimi_k3").setLevel(logging.INFO)  # dispatch fallback reasons, each once
    model = load_model(req.ckpt, tp=tp, act_dtype=DTYPES[req.dtype], device=device)
    engine = Engine(model, max_len=len(req.prompt) + req.params.max_new_tokens + req.spec_tokens,
                    decode_backend=req.decode_backend, graph_sizes=(1,) if req.cuda_graphs else (),
                    kv_cache_dtype=req.kv_cache_dtype, contracts_dir=req.contracts_dir)
    drafter: Drafter | None = None
    if req.spec_tokens:
        accept = synthetic_accept(req.drafter)
        drafter = NgramDrafter() if accept is None else SyntheticDrafter.from_greedy(
            engine, [req.prompt], req.params.max_new_tokens, accept, req.spec_tokens)
    gen = engine.generate([req.prompt], req.params, req.spec_tokens, drafter)[0]
    graphs = None if engine.graphs is None else {"sizes": engine.graphs.sizes, "replays": engine.graphs.replays}
    return gen, model.ops.report(), graphs


def rank_weight_bytes(cfg: KimiK3Config, tp: int, dtype: str) -> int:
    """The bytes of one TP rank's parameters and buffers, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = KimiK3Model(cfg, TP(0, tp), DTYPES[dtype])
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def check_contracts(directory: Path, backend: str, device: torch.device) -> None:
    """A UsageError naming --contracts for a directory latency_specialized could not load (every rank would raise)."""
    if backend != "latency_specialized":
        if directory != CONTRACTS_DIR:
            raise UsageError("--contracts: only used with --decode-backend latency_specialized")
        return
    if not directory.is_dir():
        raise UsageError(f"--contracts {directory}: no such contracts directory")
    try:
        load_specialized(directory, arch=detect(device)[0])
    except ContractError as e:
        raise UsageError(f"--contracts {directory}: {e}") from None


def run_generate(args) -> int:
    prompt = parse_ids(args.prompt_ids)
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens: must be >= 1")
    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be a finite number >= 0 and --top-p in (0, 1]")
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
    device = torch_device(args.device)
    if args.eager and device.type != "cuda":
        raise UsageError(f"--eager: CUDA graphs run only on cuda; on {device} every step is eager")
    check_contracts(args.contracts, args.decode_backend, device)
    try:
        tp_backend(device, args.tp)
    except ValueError as e:
        raise UsageError(f"--tp {args.tp} --device {args.device}: {e}") from None
    cfg = load_config(args.ckpt)[0]  # what follows is checked before any rank starts or allocates
    cfg.check_tp(args.tp)
    ranks_here = args.tp if device.type == "cpu" else 1  # CPU ranks share the host's memory; GPU ranks do not
    try:
        positions_needed(cfg, len(prompt), args.max_new_tokens, args.spec_tokens)
        check_fits(f"the weights of {ranks_here} TP{args.tp} rank(s)",
                   ranks_here * rank_weight_bytes(cfg, args.tp, args.dtype), device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    req = Request(args.ckpt, args.dtype, prompt, params, args.spec_tokens, drafter, args.decode_backend,
                  cuda_graphs=device.type == "cuda" and not args.eager, kv_cache_dtype=args.kv_cache_dtype,
                  contracts_dir=str(args.contracts))
    status = Console(stderr=True)
    try:
        with status.status(escape(f"generating from {args.ckpt} (TP{args.tp})")):
            gen, dispatch, graphs = run_tp(generate_on_rank, args.tp, req, device=str(device))
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = {"tokens": gen.tokens, "logprobs": gen.logprobs, "dispatch": dispatch, "cuda_graphs": graphs}
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
