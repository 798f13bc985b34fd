"""The training loop: AdamW on the model's own layers (dense experts), bf16 autocast on a GPU (fp32 on CPU),
warmup then cosine decay, gradient clipping, aux-loss-free expert balancing through the router's correction bias
(DeepSeek-V3's rule: each step a bias moves by `bias_rate` toward the experts chosen less than average); then
MXFP4 quantization of the experts, the checkpoint, and held-out scores of the quantized model.

The step count fixes the learning-rate schedule. Without `steps` the run first warms up (a forward and backward
pass at every training length, which changes no state), then times its first steps and plans as many as fit in
`minutes`; the record gives the count, and `--steps N` repeats the run (GPU kernels with atomics, such as
index_add_'s backward, make repeated runs close rather than bitwise equal).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..checkpoint import RandomSource, checkpoint_tensors
from ..loader import load_model, load_weights
from ..model import KimiK3Model
from ..tokenizer import build_tokenizer
from . import export
from .config import Recipe, dense_experts, mini_config
from .data import MAX_PAIRS, MAX_RECENCY_KEYS, Tasks
from .forward import TrainOps, logits, trainable

TIMED_STEPS = (3, 10)  # steps timed to plan the run when no step count is given (the first ones warm up)
CURVE_POINTS = 40  # the loss curve's summary: mean loss over this many equal stretches of the run
HELDOUT_SEED_OFFSET = 1_000_003  # held-out samples draw from another stream than training's
WARM_UP_SEED_OFFSET = 2_000_003  # and the warm-up's batches from a third


@dataclass
class Run:
    out: Path
    seed: int
    device: torch.device
    minutes: float
    steps: int | None = None
    recipe: Recipe = field(default_factory=Recipe)
    command: str = ""
    heldout_rows: int = 16  # held-out samples per recall length, 4x as many per short task

    @property
    def autocast(self) -> torch.dtype | None:
        return torch.bfloat16 if self.device.type == "cuda" else None


def lr_at(step: int, total: int, r: Recipe) -> float:
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    frac = min(1.0, (step - r.warmup_steps) / max(1, total - r.warmup_steps))
    return r.lr * (r.min_lr_fraction + (1 - r.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * frac)))


def _forward(model: KimiK3Model, ids: torch.Tensor, ops: TrainOps, run: Run) -> torch.Tensor:
    with torch.autocast(run.device.type, dtype=run.autocast or torch.float32, enabled=run.autocast is not None):
        return logits(model, ids, ops, run.recipe.kda_chunk)


def _draw(tasks: Tasks, rng: random.Random, length: int, step: int, run: Run):
    """A step's batch (ids, next ids, answer weights): rows of `length` tokens filling the recipe's tokens per step,
    in the mix of tasks the recipe sets for `step`."""
    r = run.recipe
    recall_fraction, fractions = r.mix(step)
    return tasks.batch(rng, max(1, r.tokens_per_step // length), length, recall_fraction, run.device, **fractions)


def _loss(model: KimiK3Model, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ops: TrainOps,
          run: Run) -> torch.Tensor:
    """The step's loss: cross-entropy on the answers, each token weighted as the batch says."""
    ids, nxt, weight = batch
    out = _forward(model, ids, ops, run)
    return (F.cross_entropy(out.flatten(0, 1), nxt.flatten(), reduction="none") * weight.flatten()).sum()


def _warm_up(model: KimiK3Model, tasks: Tasks, ops: TrainOps, run: Run) -> None:
    """A forward and backward pass at each training length, so that the steps timed to plan the run are steady ones:
    the first pass at a length compiles and autotunes FLA's kernels for it (minutes on a fresh machine), and a plan
    timed over compiling steps comes out far too short (session 20's run 3 planned 168 steps into 10.5 minutes).
    Its batches come from a generator of their own; gradients and expert loads are dropped, so the training stream,
    the parameters, the optimizer and the router's biases are what they would be without it."""
    rng = random.Random(run.seed + WARM_UP_SEED_OFFSET)
    for length in sorted(set(run.recipe.lengths)):
        _loss(model, _draw(tasks, rng, length, 0, run), ops, run).backward()
    model.zero_grad(set_to_none=True)
    ops.take_loads()


def train(run: Run) -> dict:
    """Train, write the checkpoint into run.out, and return its record."""
    torch.manual_seed(run.seed)
    if run.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg, r = mini_config(), run.recipe
    with torch.device(run.device):
        model = KimiK3Model(dense_experts(cfg), act_dtype=torch.float32)
    load_weights(model, RandomSource(checkpoint_tensors(model.cfg), run.seed, run.device), origin=f"init {run.seed}")
    groups = trainable(model)
    opt = torch.optim.AdamW([{"params": groups["decay"], "weight_decay": r.weight_decay},
                             {"params": groups["no_decay"], "weight_decay": 0.0}], lr=r.lr, betas=r.betas,
                            fused=run.device.type == "cuda")
    tasks, rng, ops = Tasks(build_tokenizer(cfg), cfg), random.Random(run.seed), TrainOps()
    losses: list[float] = []
    start, timed_from, plan = time.perf_counter(), 0.0, run.steps
    if plan is None:
        _warm_up(model, tasks, ops, run)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("loss {task.fields[loss]:.3f}"), transient=False)
    with progress:
        bar = progress.add_task("training mini-K3", total=plan, loss=float("nan"))
        step = 0
        while plan is None or step < plan:
            if time.perf_counter() - start > run.minutes * 60:
                break
            batch = _draw(tasks, rng, rng.choice(r.lengths), step, run)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, plan or r.warmup_steps, r)
            loss = _loss(model, batch, ops, run)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in groups.values() for p in g], r.grad_clip)
            opt.step()
            with torch.no_grad():
                for bias, counts in ops.take_loads():
                    bias += r.bias_rate * torch.sign(counts.float().mean() - counts.float())
            losses.append(loss.item())
            step += 1
            if plan is None and step == TIMED_STEPS[0]:
                timed_from = time.perf_counter()
            elif plan is None and step == TIMED_STEPS[1]:
                per_step = (time.perf_counter() - timed_from) / (TIMED_STEPS[1] - TIMED_STEPS[0])
                plan = step + int((run.minutes * 60 - (time.perf_counter() - start)) / per_step)
                progress.update(bar, total=plan)
            progress.update(bar, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]))
    seconds = time.perf_counter() - start
    record = {
        "command": run.command, "seed": run.seed, "data_version": r.data_version, "recipe": r.as_dict(),
        "device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
        "autocast": str(run.autocast).removeprefix("torch.") if run.autocast else "fp32",
        "steps": len(losses), "planned_steps": plan, "seconds": round(seconds, 1),
        "tokens": len(losses) * r.tokens_per_step, "tokens_per_s": round(len(losses) * r.tokens_per_step / seconds),
        "loss_curve": _curve(losses),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    export.write(model, cfg, run.out, record)
    quantized = load_model(run.out, act_dtype=torch.float32, device=run.device)
    record["heldout"] = {"dense_experts": heldout(model, tasks, run), "mxfp4_experts": heldout(quantized, tasks, run)}
    record["checkpoint_bytes"] = sum(p.stat().st_size for p in run.out.iterdir())
    export.write_record(run.out, record)
    return record


def _curve(losses: list[float]) -> list[dict]:
    """Mean loss over CURVE_POINTS equal stretches (first step, last step, mean)."""
    n = max(1, math.ceil(len(losses) / CURVE_POINTS))
    return [{"steps": [i + 1, min(i + n, len(losses))], "loss": round(sum(losses[i:i + n]) / len(losses[i:i + n]), 4)}
            for i in range(0, len(losses), n)]


@torch.no_grad()
def heldout(model: KimiK3Model, tasks: Tasks, run: Run) -> dict:
    """Teacher-forced scores on samples from a held-out stream: recall accuracy at the shortest and longest training
    length and twice the longest; token accuracy of the
    json, copy and arithmetic answers; the pick answer's total-variation distance from its known distribution;
    with data version 2, recency and windowed-count accuracy at the longest training length (drawn after the
    others, so version 1's held-out samples are unchanged)."""
    rng, ops, lengths = random.Random(run.seed + HELDOUT_SEED_OFFSET), TrainOps(), run.recipe.lengths
    scores = {}
    for length in (min(lengths), max(lengths), 2 * max(lengths)):  # twice the longest: beyond training
        samples = [tasks.recall(rng, length, min(MAX_PAIRS, length // 16)) for _ in range(run.heldout_rows)]
        scores[f"recall@{length}"] = _teacher_forced(model, samples, ops, run)
    for name in ("json", "copy", "arithmetic"):
        samples = [getattr(tasks, name)(rng) for _ in range(4 * run.heldout_rows)]
        scores[name] = _teacher_forced(model, samples, ops, run)
    samples = [tasks.pick(rng) for _ in range(4 * run.heldout_rows)]
    tv = []
    for s in samples:
        # fp32: under bf16 autocast the logits are bf16, and the known distribution is compared in fp32
        logits = _forward(model, torch.tensor([s.tokens], device=run.device), ops, run)[0, s.targets[0]]
        probs = logits.float().softmax(-1)
        known = torch.zeros_like(probs)
        known[list(s.meta["distribution"])] = torch.tensor(list(s.meta["distribution"].values()), device=run.device)
        tv.append(0.5 * (probs - known).abs().sum().item())
    scores["pick_tv"] = round(sum(tv) / len(tv), 4)
    if run.recipe.data_version >= 2:
        length = max(lengths)
        samples = [tasks.recency(rng, length, min(MAX_RECENCY_KEYS, length // 32)) for _ in range(run.heldout_rows)]
        scores[f"recency@{length}"] = _teacher_forced(model, samples, ops, run)
        samples = [tasks.window(rng, length) for _ in range(run.heldout_rows)]
        scores[f"window@{length}"] = _teacher_forced(model, samples, ops, run)
    return scores


def _teacher_forced(model: KimiK3Model, samples, ops: TrainOps, run: Run) -> float:
    right = total = 0
    for s in samples:
        ids = torch.tensor([s.tokens], device=run.device)
        pred = _forward(model, ids, ops, run)[0].argmax(-1)
        for p in s.targets:
            right += int(pred[p] == s.tokens[p + 1])
            total += 1
    return round(right / total, 4)
