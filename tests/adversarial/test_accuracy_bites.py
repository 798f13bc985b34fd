"""The accuracy eval bites (issue 25): on the trained mini-K3 the contracted kernels pass and every known-bad
kernel of broken_decode.py fails on accuracy, the reference's own score minus the calibrated margin.

CPU, the checkpoint's short CPU budget in fp32: latency_specialized passes; the off-by-one expert fails, and so
does the KDA state update skipped every 64 steps (recency and JSON accuracy; the committed checkpoint is trained on
data version 2, whose recency task needs the state's overwrites). The decay scaled by 1.01 and the fp16 state still
move no score past its margin (largest drops 3e-4 and 7e-5 nats of window-count NLL against a 0.01 floor:
model/kimi_k3/train/NOTES.md, run 2): the windowed count, the task meant to need an exact decay, is learned to
only 35 % accuracy. They are expected failures, strict, so the day a better-trained checkpoint (or the H200's
longer budget) makes them fail, the expectation has to be updated. `model/kimi_k3/train/gpu_run.sh` makes the
checkpoint and runs the same judgement as one command (`python -m gates.evals.accuracy`); these tests skip while
the tree has none.
"""

from __future__ import annotations

import functools

import pytest
import torch
from rich.progress import Progress

from gates.evals import accuracy
from gates.evals.paths import backend_path
from gates.evals.subject import load_subject
from model.kimi_k3.train.data import Tasks
from tests.adversarial.broken_decode import BROKEN
from tests.gates.fixtures.helpers import CPU_EXAMPLE_CONTRACTS

pytestmark = pytest.mark.skipif(accuracy.default_ckpt() is None,
                                reason=f"no trained checkpoint at {accuracy.TRAINED_CKPT} (gpu_run.sh makes it)")


@functools.cache
def subject(device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer, _ = load_subject(ckpt=accuracy.TRAINED_CKPT, device=device, dtype=dtype)
    config = accuracy.config_for(accuracy.TRAINED_CKPT, torch.device(device), 0)
    budget = config.budget(torch.device(device))
    tasks = Tasks(tokenizer, model.cfg)
    items = accuracy.Items.draw(tasks, budget, 0, config.data_version)
    reference = accuracy.measure(backend_path(model, "reference"), model, tasks, items, budget, Progress(disable=True))
    return model, tasks, items, budget, reference, accuracy.margins(budget, config.calibration, reference)


def judged(device: str, path_of) -> list[str]:
    """The metrics on which the path falls below the reference's score minus its margin."""
    model, tasks, items, budget, reference, margin = subject(device)
    scores = accuracy.measure(path_of(model), model, tasks, items, budget, Progress(disable=True))
    checks, _ = accuracy.judge(reference, scores, margin)
    return [c.name for c in checks if not c.passed]


def broken(name: str):
    op, implementation = BROKEN[name]
    return lambda model: accuracy.kernel_path(model, op, implementation, name)


def test_contracted_kernels_pass():
    assert judged("cpu", lambda model: backend_path(model, "latency_specialized",
                                                    contracts_dir=CPU_EXAMPLE_CONTRACTS)) == []


def test_an_expert_id_off_fails_on_cpu():
    assert judged("cpu", broken("expert_id_off"))


# the broken kernels the committed checkpoint cannot see (see the module doc)
UNSEEN = pytest.mark.xfail(strict=True, reason="the checkpoint's windowed count is learned to 35 %: a 1 % decay "
                                               "error or fp16 state rounding moves no score past its margin "
                                               "(train/NOTES.md, run 2)")
KDA_VARIANTS = sorted(n for n, (op, _) in BROKEN.items() if op == "kda_decode")


def expected(names) -> list:
    """The broken kernels as parameters, the two the checkpoint cannot see marked UNSEEN."""
    return [pytest.param(n, marks=UNSEEN if n in ("decay_x1.01", "fp16_state") else ()) for n in names]


@pytest.mark.parametrize("name", expected(KDA_VARIANTS))
def test_the_kda_variants_on_cpu(name):
    assert judged("cpu", broken(name))


@pytest.mark.gpu
@pytest.mark.parametrize("name", expected(sorted(BROKEN)))
def test_every_broken_kernel_fails_on_gpu(name):
    assert judged("cuda", broken(name))


@pytest.mark.gpu
def test_contracted_kernels_pass_on_gpu():
    assert judged("cuda", lambda model: backend_path(model, "latency_specialized")) == []
