"""The eval gates as the evals gate runs them on the H200: real K3 layer shapes (the gate's first layers, random
bf16 weights drawn on the GPU), the gate's GPU budgets, and the standard path beside as the yardstick. The
latency_specialized path (the KDA decode kernel) passes every eval; the logits-times-1.05 path fails sampling on
the mean statistics, which a systematic error shifts at every position while rounding noise does not."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rich.progress import Progress

from gates.checks.evals import GPU_LAYERS, configs
from gates.evals import EVALS, run_eval
from gates.evals.paths import perturbed
from gates.evals.result import Status
from gates.evals.subject import load_pair

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def k3_pair():
    pair = load_pair("latency_specialized", preset_name="k3", layers=GPU_LAYERS, device="cuda",
                     dtype=torch.bfloat16, yardstick=True)
    assert pair.cfg.num_hidden_layers == GPU_LAYERS and pair.cfg.hidden_size == 7168
    return pair


@pytest.mark.parametrize("name", sorted(EVALS))
def test_kernel_path_passes_at_k3_shapes(k3_pair, name):
    result = run_eval(name, k3_pair, Progress(disable=True), configs("cuda")[name])
    assert result.status == Status.PASSED, (result.reason, result.failed_checks)


def test_scaled_logits_fail_sampling_at_k3_shapes(k3_pair):
    bad = replace(k3_pair, candidate=perturbed(k3_pair.candidate))
    result = run_eval("sampling", bad, Progress(disable=True), configs("cuda")["sampling"])
    assert result.status == Status.FAILED_EVAL
    assert {c.name for c in result.failed_checks} >= {"mean exact TV", "mean KL at T=1"}, result.checks
