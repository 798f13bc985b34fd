"""Editing a checkpoint's tensors in place, for tests that break or convert them."""

from __future__ import annotations

from safetensors.torch import load_file, save_file


def rewrite(path, edit):
    """Apply `edit` to the tensors {name: tensor} of `path`/model.safetensors and save them back."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
