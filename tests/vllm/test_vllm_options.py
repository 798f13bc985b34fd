"""The vLLM plugin's options (no vLLM needed: these run in the main environment too)."""

from __future__ import annotations

import pytest

from model.kimi_k3.dispatch import DECODE_BACKENDS
from model.kimi_k3.vllm import options
from model.kimi_k3.vllm.options import OptionError, PluginOptions


def test_backends_are_the_dispatchers():
    assert options.DECODE_BACKENDS == DECODE_BACKENDS


@pytest.mark.parametrize("raw, backend", [(None, "auto"), ({}, "auto"), ({"decode_backend": "auto"}, "auto"),
                                          ({"decode_backend": "latency_specialized"}, "latency_specialized")])
def test_valid(raw, backend):
    assert PluginOptions.parse(raw).decode_backend == backend


@pytest.mark.parametrize("raw, message", [
    ({"decode_backend": "fastest"},
     r"^additional_config\.decode_backend: 'fastest' is not one of auto, latency_specialized"),
    ({"decode_backend": 1}, r"^additional_config\.decode_backend: 1 is not one of"),
    ({"decode_backnd": "auto"},
     r"^additional_config\.decode_backnd: unknown k3forge option; the options are: contracts_dir, decode_backend"),
    ({"contracts_dir": "/no/such/dir"}, r"^additional_config\.contracts_dir: '/no/such/dir' is not a directory"),
    ({"contracts_dir": 3}, r"^additional_config\.contracts_dir: 3 is not a directory"),
    ("latency_specialized", r"^additional_config: expected a JSON object"),
])
def test_invalid_names_the_option(raw, message):
    with pytest.raises(OptionError, match=message):
        PluginOptions.parse(raw)


def test_a_contracts_directory(tmp_path):
    assert PluginOptions.parse({"contracts_dir": str(tmp_path)}).contracts_dir == tmp_path
    assert PluginOptions.parse({}).contracts_dir is None  # the checkout's contracts/
