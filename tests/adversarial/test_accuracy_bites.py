"""The accuracy eval bites (issue 25): on the trained mini-K3 the contracted kernels pass and every known-bad
kernel of broken_decode.py fails on accuracy, the reference's own score minus the calibrated margin.

CPU, the checkpoint's short CPU budget in fp32: latency_specialized passes, and so do two KDA decode steps right by
construction that round unlike the reference (correct_decode.py: the step in float64, the step reassociated), which
is what the budget's NLL floor of 1e-5 is set from (they move no mean NLL by more than 1e-7). Every broken kernel
fails: the off-by-one expert, the KDA state update skipped every 64 steps (recency and JSON accuracy), the decay
scaled by 1.01 (+3.3e-4 nats of window-count NLL) and the fp16 state (+5.0e-5). On the GPU (bf16, floors of 0.02
until the checkpoint is calibrated there) the decay and the fp16 state are still expected to pass unseen: bf16
kernels legitimately move NLL by more than they do. Those are expected failures, strict, so the day a
better-trained checkpoint makes them fail there, the expectation has to be updated.
`model/kimi_k3/train/gpu_run.sh` makes the checkpoint and `kernels/gpu_session.sh accuracy` runs the same judgement
on the GPU (`python -m gates.evals.accuracy`); these tests skip while the tree has none.
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
from tests.adversarial.correct_decode import CORRECT
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
    reference = accuracy.measure(backend_path(model, "reference"), tasks, items, budget, Progress(disable=True))
    return model, tasks, items, budget, reference, accuracy.margins(budget, config.calibration, reference)


def judged(device: str, path_of) -> list[str]:
    """The metrics on which the path falls below the reference's score minus its margin."""
    model, tasks, items, budget, reference, margin = subject(device)
    scores = accuracy.measure(path_of(model), tasks, items, budget, Progress(disable=True))
    checks, _ = accuracy.judge(reference, scores, margin)
    return [c.name for c in checks if not c.passed]


def kernel(name: str, variants: dict = BROKEN):
    op, implementation = variants[name]
    return lambda model: accuracy.kernel_path(model, op, implementation, name)


def test_contracted_kernels_pass():
    assert judged("cpu", lambda model: backend_path(model, "latency_specialized",
                                                    contracts_dir=CPU_EXAMPLE_CONTRACTS)) == []


def test_an_expert_id_off_fails_on_cpu():
    assert judged("cpu", kernel("expert_id_off"))


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_kda_steps_right_by_construction_pass_on_cpu(name):
    """What the NLL floor is set from: a correct step that rounds otherwise moves no score past it."""
    assert judged("cpu", kernel(name, CORRECT)) == []


# the broken kernels the checkpoint's GPU budget cannot see (see the module doc)
UNSEEN_ON_GPU = pytest.mark.xfail(strict=True, reason="in bf16 a 1 % decay error or fp16 state rounding moves no "
                                                      "score further than a right kernel's rounding does "
                                                      "(train/NOTES.md, session 30)")


@pytest.mark.parametrize("name", sorted(n for n, (op, _) in BROKEN.items() if op == "kda_decode"))
def test_the_kda_variants_fail_on_cpu(name):
    assert judged("cpu", kernel(name))


def expected(names) -> list:
    """The broken kernels as parameters, the two the GPU budget cannot see marked UNSEEN_ON_GPU."""
    return [pytest.param(n, marks=UNSEEN_ON_GPU if n in ("decay_x1.01", "fp16_state") else ()) for n in names]


@pytest.mark.gpu
@pytest.mark.parametrize("name", expected(sorted(BROKEN)))
def test_every_broken_kernel_fails_on_gpu(name):
    assert judged("cuda", kernel(name))


@pytest.mark.gpu
def test_contracted_kernels_pass_on_gpu():
    assert judged("cuda", lambda model: backend_path(model, "latency_specialized")) == []
