"""Fixtures of the model tests: a private copy of the tiny checkpoint to edit."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture()
def ckpt(tiny_ckpt, tmp_path):
    """A private copy of the tiny (nested, MXFP4) checkpoint to edit or break (tests.model.edits.rewrite)."""
    return shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
