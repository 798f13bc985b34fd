"""Probe: the gate's sampling eval over attn_res implementations, two of them correct by construction.

The CuTe kernel's first gate failed sampling's KL (0.237 against 1.5 x the standard path's 0.122). Is that the
kernel, or does any implementation that rounds unlike the reference fail? The gate's subject (k3, 2 layers, TP8 rank
shapes, bf16, seed 0) and budget, in this process (no sandbox), the contract's sm_90 listed validated in a copy of
contracts/; candidates: `kernel` (the CuTe kernel), `reversed` (the reference over the sources in reverse order: the
same fp32 math, another rounding of the mix) and `float64` (the mix computed in float64, rounded once: the evals
gate's `gates/evals/exact.py`). NOTES.md has what it found (results/gate1/).

    python -m model.kimi_k3.specialized.attn_res.eval_probe OUT.json [float64 kernel reversed]   # repo root, a GPU
"""
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from rich.progress import Progress

import model.kimi_k3.specialized.attn_res as impl
from gates.checks.evals import configs, eval_subject
from gates.evals import run_eval
from gates.evals.exact import attn_res_exact
from gates.evals.paths import backend_path
from gates.evals.subject import load_pair
from kernels.contract import load_contract
from model.kimi_k3.ops.attn_res import attn_res

kernel = impl.attn_res_cute


def reversed_order(sources, norm_w, proj_w, eps, **_):
    return attn_res(list(reversed(sources)), norm_w, proj_w, eps)


VARIANTS = {"kernel": kernel, "reversed": reversed_order, "float64": attn_res_exact}


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    names = argv[1:] or list(VARIANTS)
    contracts = Path(tempfile.mkdtemp()) / "contracts"
    shutil.copytree("contracts", contracts)
    doc = yaml.safe_load((contracts / "attn_res.yaml").read_text())
    doc["hardware"]["validated"] = [{"arch": "sm_90", "devices": ["NVIDIA H200"]}]
    doc["hardware"]["declared"] = [d for d in doc["hardware"].get("declared", []) if d["arch"] != "sm_90"]
    (contracts / "attn_res.yaml").write_text(yaml.safe_dump(doc))
    contract = load_contract(contracts / "attn_res.yaml")
    gpu = torch.cuda.is_available()  # off a GPU: a smoke run of the plumbing on the tiny preset
    subject, _ = eval_subject(contract, gpu=gpu)
    pair = load_pair("auto", yardstick=True, **subject)
    config = configs("cuda" if gpu else "cpu")["sampling"]
    results = {}
    for name in names:
        impl.attn_res_cute = VARIANTS[name]
        cand = backend_path(pair.model, "latency_specialized", only=["attn_res"], contracts_dir=contracts)
        with Progress(disable=True) as progress:
            r = run_eval("sampling", dataclasses.replace(pair, candidate=cand), progress, config)
        results[name] = r.model_dump(mode="json")
        results[name]["calls"] = cand.dispatch_counts().get("attn_res", {})
        print(name, r.status, [(c.name, c.value, c.bound, c.passed) for c in r.checks][:4], flush=True)
        out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
