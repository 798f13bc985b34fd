"""explore.py's inputs, on the CPU: kernel source variants load as their own modules, and a wrong file or tuning
is refused with a message naming it (timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from model.kimi_k3.specialized.kda_decode import _cache, explore, kernel


def test_this_trees_kernel_is_the_package_module():
    assert explore.load_source(explore.THIS_KERNEL, 0) is kernel


def test_a_variant_file_loads_as_its_own_module(tmp_path):
    variant = tmp_path / "variant.py"
    variant.write_text(explore.THIS_KERNEL.read_text())
    module = explore.load_source(variant, 3)
    assert module is not kernel and module.__name__ == "kda_decode_variant_3"
    assert module.KDADecodeConfig(heads=12) == module.KDADecodeConfig(heads=12)
    assert _cache(module) is not _cache(kernel)  # its compiled kernels are its own
    assert _cache(module).path(("any",)) is None  # and never on disk: the cache could not hash its imports


@pytest.mark.parametrize("text,why", [("x = 1\n", "has no KDADecodeConfig"), (None, "no such file")])
def test_a_wrong_source_is_refused_by_name(tmp_path, text, why):
    path = tmp_path / "not_a_kernel.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit, match=f"{path.name}.*{why}"):
        explore.load_source(path, 1)


def test_tunings_parse():
    assert explore.parse_tuning("default") is None
    assert explore.parse_tuning("v_split=4,chunk_rows=2") == {"v_split": 4, "chunk_rows": 2}
    with pytest.raises(SystemExit, match="v_split=four"):
        explore.parse_tuning("v_split=four")
