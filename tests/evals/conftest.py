"""Eval fixtures: the reference and standard paths over the shared tiny fp32 model, with its checkpoint's tokenizer."""

from __future__ import annotations

import pytest
import torch
from rich.progress import Progress

from gates.evals import single_threaded_on_cpu
from gates.evals.paths import DecodePath, PathPair, backend_path
from model.kimi_k3.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_ckpt, tiny_cfg):
    return load_tokenizer(tiny_ckpt, tiny_cfg)


@pytest.fixture(scope="session")
def make_pair(tiny_model, tiny_tokenizer):
    """PathPair(reference, candidate) on the tiny model; the candidate defaults to the standard path."""

    def make(candidate: DecodePath | None = None) -> PathPair:
        return PathPair(backend_path(tiny_model, "reference"), candidate or backend_path(tiny_model, "auto"),
                        tiny_model, tiny_tokenizer)

    return make


@pytest.fixture()
def progress():
    return Progress(disable=True)


@pytest.fixture(autouse=True)
def single_threaded():
    """As run_eval runs them (see single_threaded_on_cpu)."""
    with single_threaded_on_cpu(torch.device("cpu")):
        yield
