"""Session 30 (CPU, no GPU lent): how far the known-bad and the right-by-construction KDA decode steps move the
committed mini-K3's scores from the reference path's when the model runs in bf16, as on the GPU, over several
item sets (the CPU budget's items). Writes one JSON: {item_set: {path: {metric: value}}}.

    python model/kimi_k3/train/results/session30/bf16_shifts.py --item-sets 3 --json out.json
"""

import argparse
import json

import torch
from rich.progress import Progress

from gates.evals import accuracy
from gates.evals.paths import backend_path
from gates.evals.subject import load_subject
from model.kimi_k3.train.data import Tasks
from tests.adversarial.broken_decode import BROKEN
from tests.adversarial.correct_decode import CORRECT

p = argparse.ArgumentParser()
p.add_argument("--item-sets", type=int, default=3)
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--json", required=True)
args = p.parse_args()
model, tokenizer, _ = load_subject(ckpt=accuracy.TRAINED_CKPT, device="cpu", dtype=getattr(torch, args.dtype))
config = accuracy.config_for(accuracy.TRAINED_CKPT, torch.device("cpu"), 0)
budget, tasks = config.budget(torch.device("cpu")), Tasks(tokenizer, model.cfg)
paths = {"reference": backend_path(model, "reference")}
paths.update({name: accuracy.kernel_path(model, op, impl, name) for name, (op, impl) in {**CORRECT, **BROKEN}.items()})
out: dict = {}
with Progress() as progress:
    for seed in range(args.item_sets):
        items = accuracy.Items.draw(tasks, budget, seed, config.data_version)
        out[seed] = {name: accuracy.measure(path, tasks, items, budget, progress) for name, path in paths.items()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
