"""`k3forge eval`: the model-level eval gates (sampling, structured output, long context), candidate decode path
against the reference path, on a checkpoint or a preset's random weights.

Exit code 1 when an eval FAILED_EVAL or hit an ERROR; NOT_RUN (e.g. a decode backend this tree lacks) is
reported with its reason and does not fail the command.
"""

from __future__ import annotations

import json
import shlex
import sys
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from gates.evals import EVALS, accuracy, run_eval
from gates.evals.paths import BACKENDS, backend_path
from gates.evals.result import EvalResult, Status
from gates.evals.subject import load_pair
from gates.evidence.report import EVAL_REPORT_HTML, render_eval_report
from model.kimi_k3.cache import KV_CACHE_DTYPES
from model.kimi_k3.cli import DTYPES, output_directory, torch_device
from model.kimi_k3.errors import EXIT_FAILED, EXIT_OK, UsageError

GATES = {**EVALS, accuracy.NAME: accuracy.GATE}
STYLE = {Status.PASSED: "green", Status.FAILED_EVAL: "bold red", Status.NOT_RUN: "yellow", Status.ERROR: "bold red"}


def register(sub) -> None:
    p = sub.add_parser("eval", help="run the model-level eval gates (candidate vs reference decode path)",
                       description="Run the model-level evals, the candidate decode path against the reference. "
                                   "On a GPU, or with --kv-cache-dtype fp8, the standard path runs beside as the "
                                   "yardstick (over the same cache as the candidate): each bound is the larger of "
                                   "the budget's and 1.5x the standard's own distance from the reference.",
                       epilog="evals: " + "; ".join(f"{g.name}: {g.summary}" for g in GATES.values()))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint directory (config.json, safetensors, tokenizer.json); default: the "
                     f"trained mini-K3 ({accuracy.TRAINED_CKPT.relative_to(accuracy.REPO_ROOT)}) where the tree has it")
    src.add_argument("--preset", help="random weights of a preset, drawn on the device: tiny (the default without "
                     "the trained checkpoint; CPU CI) or k3 (real layer shapes, GPU only): shape coverage")
    p.add_argument("--layers", type=int, help="cut a preset to its first N layers (k3 default 4)")
    p.add_argument("--only", action="append", choices=sorted(GATES), help="run only this eval (repeatable); "
                   f"{accuracy.NAME} runs by default on a trained checkpoint")
    p.add_argument("--candidate", default="latency_specialized", choices=[b for b in BACKENDS if b != "reference"],
                   help="decode backend compared with the reference path (default latency_specialized)")
    p.add_argument("--ops", metavar="OP[,OP...]",
                   help="with latency_specialized: these ops' kernels only, every other op standard (as the gate "
                        "runs one contract's kernel)")
    p.add_argument("--perturb-logits", type=float, metavar="SCALE",
                   help="scale the candidate's logits (a known-bad path, e.g. 1.05: the evals must fail it)")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                   help="the candidate's and the standard's MLA cache: auto (default) or fp8 (e4m3, mla_decode_fp8); "
                        "the reference keeps the exact cache")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="activation dtype (default fp32 on CPU, bf16 on GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of every eval's draws, prompts and haystacks")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--json", action="store_true", help="print one JSON object: the subject and every EvalResult")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="also write DIR/eval_report.html and eval_report.md: checks, tables and plots per eval")
    p.set_defaults(func=run)


def run(args) -> int:
    device = torch_device(args.device)
    if args.report:
        output_directory(args.report, "--report")
    if args.perturb_logits is not None and args.perturb_logits <= 0:
        raise UsageError("--perturb-logits: must be > 0")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    ckpt = args.ckpt or (None if args.preset else accuracy.default_ckpt())
    candidate = args.candidate
    if args.ops:
        if args.candidate != "latency_specialized":
            raise UsageError("--ops: choosing kernels needs --candidate latency_specialized")
        only = [op.strip() for op in args.ops.split(",") if op.strip()]
        candidate = partial(_backend_only, backend=args.candidate, only=only, kv_cache_dtype=args.kv_cache_dtype)
    preset = args.preset or "tiny"
    names = list(dict.fromkeys(args.only or [*EVALS, *([accuracy.NAME] if accuracy.trained(ckpt) else [])]))
    err = Console(stderr=True, highlight=False)

    with err.status(escape(f"loading {ckpt or preset}")):
        paths = load_pair(candidate, ckpt=ckpt, preset_name=preset, layers=args.layers,
                          seed=args.weights_seed, device=device, dtype=dtype, perturb=args.perturb_logits,
                          yardstick=device.type == "cuda" or args.kv_cache_dtype != "auto",
                          kv_cache_dtype=args.kv_cache_dtype)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err)
    with progress:
        results = [run_eval(name, paths, progress, _config(name, ckpt, device, args.seed), GATES[name])
                   for name in names]
    subject = {"candidate": paths.candidate.name, "reference": paths.reference.name, "device": str(device),
               "dtype": str(dtype).removeprefix("torch."), "config": paths.cfg.to_hf_dict(nested=False)}
    subject["source"] = str(ckpt) if ckpt else f"preset {preset}"
    subject["notes"] = list(paths.notes)

    dumped = [json.loads(r.model_dump_json()) for r in results]
    if args.report:
        command = "k3forge " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["eval"] else "k3forge eval"
        args.report.mkdir(parents=True, exist_ok=True)
        for name, text in render_eval_report(subject, dumped, command).items():
            (args.report / name).write_text(text)
        err.print(f"report: {args.report / EVAL_REPORT_HTML}", soft_wrap=True, markup=False)
    if args.json:
        print(json.dumps({"subject": subject, "results": dumped}))
    else:
        out = Console(highlight=False)
        for result in results:
            _render(result, out)
    failed = any(r.status in (Status.FAILED_EVAL, Status.ERROR) for r in results)
    return EXIT_FAILED if failed else EXIT_OK


def _backend_only(model, backend: str, only: list[str], kv_cache_dtype: str = "auto"):
    try:
        return backend_path(model, backend, only, kv_cache_dtype)
    except ValueError as e:
        raise UsageError(f"--ops: {e}") from None


def _config(name: str, ckpt, device: torch.device, seed: int):
    return accuracy.config_for(ckpt, device, seed) if name == accuracy.NAME else EVALS[name].config(seed=seed)


def _render(result: EvalResult, out: Console) -> None:
    out.rule(f"[{STYLE[result.status]}]{result.name}: {result.status.value}[/] ({result.seconds:.1f} s)")
    if result.reason:
        out.print(f"reason: {result.reason}", markup=False)
    if result.checks:
        checks = RichTable(title="checks", title_justify="left")
        for col in ("check", "value", "bound", "verdict", "detail"):
            checks.add_column(col)
        for c in result.checks:
            verdict = "pending" if c.passed is None else "pass" if c.passed else "[bold red]FAIL[/]"
            checks.add_row(escape(c.name), _fmt(c.value), _fmt(c.bound), verdict, escape(c.detail))
        out.print(checks)
    for table in result.tables:
        rich_table = RichTable(title=table.title, title_justify="left")
        for col in table.columns:
            rich_table.add_column(col)
        for row in table.rows:
            rich_table.add_row(*(_fmt(v) for v in row))
        out.print(rich_table)
    for note in result.notes:
        out.print(f"note: {note}", markup=False)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value) if not isinstance(value, str) else value.encode("unicode_escape").decode()[:80])
