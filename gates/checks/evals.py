"""Evals gate: the model with this op's kernel (decode_backend latency_specialized, this contract alone) against the
reference path, through every model-level eval (gates.evals: temperature sampling, structured output, long context).

CPU: the tiny preset in fp32 with each eval's CPU budget and absolute bounds. GPU: real `k3` layer shapes in bf16, cut
to `GPU_LAYERS` layers (through the first MLA layer for an op of the MLA cache: `eval_subject`), with smaller budgets
than `k3forge eval` runs (GPU_BUDGETS) so the gate fits one GPU command, and the standard path run beside as the
yardstick: in bf16 on random weights the candidate is held to the standard's own distance from the reference
(gates.evals.paths.PathPair); for an op whose standard rounds as its reference does, the standard path with the op
computed exactly (gates/evals/exact.py: the exact answer failed the plain yardstick). An fp8 cache's op runs over an fp8
cache, beside a standard over the same cache (the yardstick then on the CPU too). Evals left when TIME_LIMIT_S is spent
are NOT_RUN, never silently dropped. An eval model that never entered the kernel's envelope makes the gate NOT_RUN: it
would compare the standard path with itself.

Then the accuracy eval (gates.evals.accuracy) on the trained mini-K3, where the kernel's envelope covers that checkpoint
(the KDA decode kernel at its 6 local heads of K3's head shape; K3's projections and MoE never): the candidate's scores
on tasks with checkable answers beside the reference's and the standard's, held to the reference's minus a margin. A
kernel whose envelope leaves the checkpoint out gets an accuracy row that says so, and no verdict from it.

The candidate path runs in the sandbox's child (gates.evals.remote), over the same seeded weights (or the same
checkpoint) as the reference and standard paths here; only logits and states come back, and every statistic is
computed here.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

import torch
from rich.progress import Progress

from gates.core.registry import Gate, GateContext
from gates.core.sandbox import Sandbox, SandboxError
from gates.core.status import GateResult, Status, worst
from gates.evals import EVALS, accuracy, run_eval
from gates.evals.exact import EXACT, exact_path
from gates.evals.long_context import LongContextConfig
from gates.evals.paths import DecodePath
from gates.evals.remote import RemoteCandidate
from gates.evals.result import EvalResult
from gates.evals.sampling import SamplingConfig
from gates.evals.structured import StructuredConfig
from gates.evals.subject import load_pair
from kernels.contract import Contract
from model.kimi_k3.config import preset
from model.kimi_k3.model import KimiK3Model

NAME, TITLE = "evals", "Model-level evals"
GPU_LAYERS = 2  # k3 layers 0 (KDA, dense MLP) and 1 (KDA, latent MoE): the KDA decode kernel runs in both
# An eval not started by then is NOT_RUN. The KDA gate of run 13 spent 142 s (sampling 46, structured 56, long
# context 19); the structured eval now decodes on the standard path too (the yardstick), about +28 s; mla_decode's
# gate 5 spent 215 s, its long context starting at 174 s. The evals run beside the numerics gate, sharing the GPU
# and the host with it: room for them to run slower.
TIME_LIMIT_S = {"cpu": 600.0, "cuda": 360.0}
GPU_BUDGETS = {
    "sampling": SamplingConfig().gpu.model_copy(update={"positions": 32, "samples": 4096}),
    "structured": StructuredConfig().gpu.model_copy(update={"schemas": ("enum", "nested", "patterns"),
                                                            "spec_tokens": (0, 3), "max_tokens": 96}),
    "long_context": LongContextConfig().gpu.model_copy(update={"lengths": (2048, 8192), "decode_steps": 8}),
}


def configs(device: str) -> dict:
    if device == "cpu":
        return {name: gate.config() for name, gate in EVALS.items()}
    return {name: gate.config().model_copy(update={"gpu": GPU_BUDGETS[name]}) for name, gate in EVALS.items()}


def accuracy_config(device: str, ckpt) -> accuracy.AccuracyConfig:
    """The checkpoint's accuracy config (its calibration for this device kind), on the GPU at the gate's budget."""
    return accuracy.gate_config(ckpt, torch.device(device))


def in_budget(ctx: GateContext, start: float, name: str, evaluate: Callable[[], EvalResult]) -> dict:
    """An eval's result, or NOT_RUN once the gate's eval time (counted from `start`) is spent."""
    if time.perf_counter() - start > TIME_LIMIT_S[ctx.device]:
        return {"name": name, "status": "NOT_RUN",
                "reason": f"the gate's {TIME_LIMIT_S[ctx.device]:.0f} s eval budget was spent"}
    ctx.progress(f"eval {name}")
    return evaluate().model_dump(mode="json")


def trained_accuracy(box: Sandbox, ctx: GateContext, progress: Progress, start: float) -> dict:
    """The accuracy eval on the trained mini-K3 with the candidate in `box`'s child (its K3-shape model replaced),
    the reference and the standard (the table's yardstick) here; NOT_RUN, and `applies` False, where the tree has no
    trained checkpoint or the kernel's envelope never takes it (checked before the eval time left is)."""
    ckpt = accuracy.default_ckpt()
    if ckpt is None:
        return {"name": accuracy.NAME, "status": "NOT_RUN", "applies": False,
                "reason": f"no trained checkpoint at {accuracy.TRAINED_CKPT.relative_to(accuracy.REPO_ROOT)}"}
    gpu = ctx.device == "cuda"
    subject = {"ckpt": str(ckpt), "device": ctx.device, "dtype": torch.bfloat16 if gpu else torch.float32}
    candidate = RemoteCandidate(box, ctx.contract, str(ctx.contract_path), subject)
    if not candidate.chooses_kernel():
        return {"name": accuracy.NAME, "status": "NOT_RUN", "applies": False,
                "reason": "the trained checkpoint's shapes lie outside this kernel's envelope"}
    pair = load_pair(candidate.over, yardstick=True, **subject)
    result = in_budget(ctx, start, accuracy.NAME, partial(run_eval, accuracy.NAME, pair, progress,
                                                           accuracy_config(ctx.device, ckpt), gate=accuracy.GATE))
    model = f"model: the trained mini-K3 ({ckpt.relative_to(accuracy.REPO_ROOT)}), {subject['dtype']}"
    return {**result, "notes": [model, *result.get("notes", [])], "applies": True,
            "kernel_calls": candidate.report()["ops"].get(ctx.contract.op, {})}


# The TP whose rank shapes the GPU evals run at: K3's serving TP. At TP1 the KDA gate's eval model (a whole 896-expert
# MoE layer) held ~37-40 GiB in the gate's process and again in the candidate's, and humming's repack asked 9 GiB more,
# which an 80 GB H100 cannot hold (session 34); the kernel's other TP shapes are the numerics' and benchmarks' to cover.
SERVING_TP = 8


def eval_tp(tp_sizes: list[int]) -> int:
    """The smallest TP size the contract admits from SERVING_TP up, else its largest."""
    served = [tp for tp in tp_sizes if tp >= SERVING_TP]
    return min(served) if served else max(tp_sizes)


def eval_subject(contract: Contract, gpu: bool) -> tuple[dict, str]:
    """The eval model (load_subject's arguments) and the MLA cache's dtype for this contract's kernel.

    On the GPU, K3's first layers at one rank's shapes of the TP eval_tp picks from the contract's, so a kernel
    contracted for rank-local shapes (TP8's projections) is chosen: GPU_LAYERS, or through the first MLA layer for
    an op that reads the MLA cache (its contract constrains `kv_cache`), whose cache is then of that dtype
    (fp8_e4m3: kv_cache_dtype "fp8"). The CPU's tiny model never has K3's shapes, whatever its TP; its MLA layers
    come early."""
    mla = contract.dtypes.kv_cache is not None
    kv_cache_dtype = "fp8" if contract.dtypes.kv_cache == "fp8_e4m3" else "auto"
    layers = (preset("k3").mla_layer_ids[0] + 1 if mla else GPU_LAYERS) if gpu else None
    subject = {"preset_name": "k3" if gpu else "tiny", "layers": layers, "device": "cuda" if gpu else "cpu",
               "dtype": torch.bfloat16 if gpu else torch.float32, "tp": eval_tp(contract.tp_sizes) if gpu else 1}
    return subject, kv_cache_dtype


def yardstick(contract: Contract, gpu: bool, kv_cache_dtype: str) -> bool | Callable[[KimiK3Model], DecodePath]:
    """load_pair's yardstick: none on the CPU (absolute bounds) unless the cache is quantized; else the standard
    path, with the op computed exactly where its standard rounds as the reference does (gates/evals/exact.py)."""
    if not (gpu or kv_cache_dtype != "auto"):
        return False
    if contract.op in EXACT:
        return partial(exact_path, contract=contract, kv_cache_dtype=kv_cache_dtype)
    return True


def run(ctx: GateContext) -> GateResult:
    reason = ctx.cannot_run_here()
    if reason is not None:
        return GateResult.not_run(NAME, TITLE, reason)
    gpu = ctx.device == "cuda"
    subject, kv_cache_dtype = eval_subject(ctx.contract, gpu)
    start, results = time.perf_counter(), {}
    try:
        with Sandbox() as box, Progress(disable=True) as progress:
            candidate = RemoteCandidate(box, ctx.contract, str(ctx.contract_path), subject, kv_cache_dtype)
            pair = load_pair(lambda model: candidate.path, yardstick=yardstick(ctx.contract, gpu, kv_cache_dtype),
                             kv_cache_dtype=kv_cache_dtype, **subject)
            for name, config in configs(ctx.device).items():
                results[name] = in_budget(ctx, start, name, partial(run_eval, name, pair, progress, config))
            ops = candidate.report()["ops"].get(ctx.contract.op, {})  # before the checkpoint replaces the model
            results[accuracy.NAME] = trained_accuracy(box, ctx, progress, start)
    except SandboxError as e:
        return GateResult(gate=NAME, title=TITLE, status=Status.ERROR, reason=str(e),
                          summary="the candidate's process failed during the evals",
                          details={"evals": results})
    paths = pair.label + (f"; yardstick: {pair.standard.name}" if pair.standard else "")
    details = {"model": list(pair.notes), "paths": paths, "kernel_calls": ops, "evals": results}
    if not ops.get("specialized"):
        return GateResult(gate=NAME, title=TITLE, status=Status.NOT_RUN, details=details,
                          reason="the eval model never entered this kernel's envelope",
                          summary="not run: the kernel was never chosen on the eval model")
    judged = {n: r for n, r in results.items() if r.get("applies", True)}  # accuracy only where it applies
    status = worst(Status(r["status"]) for r in judged.values())
    failed = [n for n, r in judged.items() if r["status"] not in ("PASSED", "NOT_RUN")]
    summary = (f"{sum(r['status'] == 'PASSED' for r in judged.values())}/{len(judged)} evals passed; "
               f"kernel chosen {ops['specialized']} times")
    return GateResult(gate=NAME, title=TITLE, status=status, details=details, summary=summary,
                      reason="; ".join(f"{n}: {results[n]['status']} {results[n].get('reason', '')}".strip()
                                       for n in failed))


GATE = Gate(NAME, TITLE, "the model with this kernel matches the reference path in temperature sampling, "
            "structured output and long context", run, needs=("contracts", "compile", "numerics"), beside="numerics")
