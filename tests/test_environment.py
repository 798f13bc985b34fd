"""The installed environment against the checkout's top-level packages.

Run from the checkout, `model/`, `kernels/` and `gates/` come first on sys.path: an installed distribution that
provides a module of the same name is shadowed, and whatever imports it gets ours. transformers >= 5.25 depends on
Hugging Face's `kernels` and then fails deep inside an unrelated import (`cannot import name 'CUDAProperties' from
'kernels'`). The pins in `.ci/constraints*.txt` keep such a distribution out; an upgrade that brings one in fails
here, naming it.
"""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest

from kernels.sources import REPO_ROOT

# The top-level packages pyproject.toml ships ("model*" -> "model").
OURS = tuple(pattern.rstrip("*") for pattern in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
             ["tool"]["setuptools"]["packages"]["find"]["include"])


@pytest.mark.parametrize("name", OURS)
def test_no_installed_distribution_shares_a_top_level_name_with_ours(name):
    others = sorted({d for d in importlib.metadata.packages_distributions().get(name, []) if d != "k3forge"})
    assert not others, (f"installed {', '.join(others)} also provide(s) the top-level module {name!r}, which this "
                        f"checkout's {name}/ shadows; pin a version without it in .ci/constraints.txt")
