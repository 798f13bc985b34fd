"""Shared fixtures: a tiny random checkpoint on disk and models loaded from it."""

from __future__ import annotations

import pytest
import torch

from model.kimi_k3.checkpoint import write_checkpoint
from model.kimi_k3.config import preset
from model.kimi_k3.loader import load_model


@pytest.fixture(scope="session", autouse=True)
def compile_cache_of_this_run(tmp_path_factory):
    """Kernels the tests compile persist in a directory of this run, not in the user's cache: every run compiles
    what it tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("K3FORGE_COMPILE_CACHE", str(tmp_path_factory.mktemp("compile_cache")))
    yield
    mp.undo()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; runs on the GPU machine (H200)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg):
    """A tiny MXFP4 checkpoint in the K3 (nested text_config) layout."""
    return write_checkpoint(tiny_cfg, tmp_path_factory.mktemp("tiny_ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    """The tiny model in fp32, where rounding cannot flip a comparison."""
    return load_model(tiny_ckpt, act_dtype=torch.float32)
