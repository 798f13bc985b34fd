"""Probe: the evals gate's sampling eval over several implementations of one op, against the plain yardstick.

When a kernel fails the sampling eval, the question is whether the kernel is wrong or whether any implementation
that rounds unlike the reference fails it. A probe answers it with variants that are correct by construction (the
reference in another summation order, the op in float64): if they fail too, the yardstick cannot tell a correct
kernel from a wrong one, and the op belongs in `gates/evals/exact.py`. It runs the gate's subject and budget in this
process (no sandbox), with the contract's sm_90 listed validated in a copy of contracts/, and replaces the contract's
implementation by each variant in turn. Each kernel's `eval_probe.py` names its variants.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
import yaml
from rich.progress import Progress

from gates.checks.evals import configs, eval_subject
from gates.evals import run_eval
from gates.evals.paths import backend_path
from gates.evals.subject import load_pair
from kernels.contract import load_contract


def validated_copy(op: str) -> Path:
    """contracts/ copied to a temporary directory with `op`'s sm_90 listed validated (where the gate runs it)."""
    contracts = Path(tempfile.mkdtemp()) / "contracts"
    shutil.copytree("contracts", contracts)
    path = contracts / f"{op}.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["hardware"]["validated"] = [{"arch": "sm_90", "devices": ["NVIDIA H200"]}]
    doc["hardware"]["declared"] = [d for d in doc["hardware"].get("declared", []) if d["arch"] != "sm_90"]
    path.write_text(yaml.safe_dump(doc))
    return contracts


def probe(op: str, variants: dict[str, Callable], out: Path, names: list[str] | None = None) -> dict:
    """Run the sampling eval with each named variant as `op`'s kernel; every result goes to `out` as it comes (JSON:
    the eval's result and the dispatcher's call counts per variant). Off a GPU: a smoke run on the tiny preset."""
    contracts = validated_copy(op)
    contract = load_contract(contracts / f"{op}.yaml")
    module_name, _, attr = contract.implementation.partition(":")
    module = importlib.import_module(module_name)
    gpu = torch.cuda.is_available()
    subject, _ = eval_subject(contract, gpu=gpu)
    pair = load_pair("auto", yardstick=True, **subject)  # the plain yardstick: the standard path
    config = configs("cuda" if gpu else "cpu")["sampling"]
    results, kernel = {}, getattr(module, attr)
    try:
        for name in names or list(variants):
            setattr(module, attr, variants[name])
            cand = backend_path(pair.model, "latency_specialized", only=[op], contracts_dir=contracts)
            with Progress(disable=True) as progress:
                r = run_eval("sampling", dataclasses.replace(pair, candidate=cand), progress, config)
            results[name] = r.model_dump(mode="json")
            results[name]["calls"] = cand.dispatch_counts().get(op, {})
            print(name, r.status, [(c.name, c.value, c.bound, c.passed) for c in r.checks][:4], flush=True)
            out.write_text(json.dumps(results, indent=1, default=str))
    finally:
        setattr(module, attr, kernel)
    return results
