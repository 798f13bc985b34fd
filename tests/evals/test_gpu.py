"""The eval gates on real K3 layer shapes (the first 4 layers, random bf16 weights drawn on the GPU): the standard
path passes against the reference, the logits-times-1.05 path fails. H200 only: one MoE layer of MXFP4 experts is
~15 GB, the 4 layers ~57 GB. Sampling and structured output run their GPU budgets; long context stops at 16K
here (the gate's own run goes to its budget's 64K)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rich.progress import Progress

from gates.evals import EVALS, run_eval
from gates.evals.long_context import LongContextConfig
from gates.evals.paths import perturbed
from gates.evals.result import Status
from gates.evals.subject import K3_EVAL_LAYERS, load_pair

pytestmark = pytest.mark.gpu
SHORT = {"long_context": LongContextConfig(gpu=LongContextConfig().gpu.model_copy(update={"lengths": (4096, 16384)}))}


@pytest.fixture(scope="module")
def k3_pair():
    pair = load_pair("auto", preset_name="k3", device="cuda", dtype=torch.bfloat16)
    assert pair.cfg.num_hidden_layers == K3_EVAL_LAYERS and pair.cfg.hidden_size == 7168
    return pair


@pytest.mark.parametrize("name", sorted(EVALS))
def test_standard_path_passes_at_k3_shapes(k3_pair, name):
    result = run_eval(name, k3_pair, Progress(disable=True), SHORT.get(name))
    assert result.status == Status.PASSED, (result.reason, result.failed_checks)


def test_scaled_logits_fail_sampling_at_k3_shapes(k3_pair):
    bad = replace(k3_pair, candidate=perturbed(k3_pair.candidate))
    result = run_eval("sampling", bad, Progress(disable=True))
    assert result.status == Status.FAILED_EVAL
    assert {c.name for c in result.failed_checks} >= {"exact TV", "KL at T=1"}
