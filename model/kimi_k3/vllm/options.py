"""The plugin's options, read from vLLM's `additional_config` (e.g. `LLM(..., additional_config={...})` or
`--additional-config '{"decode_backend": "latency_specialized"}'`).

Checked when the model is built, in every worker, before any weight is read: an unknown option or a malformed
value stops vLLM's start-up with an `OptionError` that names the option.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DECODE_BACKENDS = ("auto", "latency_specialized")  # model.kimi_k3.dispatch.DECODE_BACKENDS (checked in tests)
PREFIX = "additional_config"


class OptionError(ValueError):
    """A plugin option that is unknown or malformed; the message starts with the option's name."""


@dataclass(frozen=True)
class PluginOptions:
    decode_backend: str = "auto"
    contracts_dir: Path | None = None  # latency_specialized's contracts; None: the checkout's contracts/

    @classmethod
    def parse(cls, raw: Any) -> "PluginOptions":
        """Options from vLLM's additional_config (None, a dict, or an object with a dict of attributes)."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raw = getattr(raw, "__dict__", None)
            if not isinstance(raw, Mapping):
                raise OptionError(f"{PREFIX}: expected a JSON object of k3forge options, got {type(raw).__name__}")
        known = {"decode_backend": cls._decode_backend, "contracts_dir": cls._contracts_dir}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise OptionError(f"{PREFIX}.{unknown[0]}: unknown k3forge option; the options are: "
                              f"{', '.join(sorted(known))}")
        return cls(**{key: check(raw[key]) for key, check in known.items() if key in raw})

    @staticmethod
    def _decode_backend(value: Any) -> str:
        if not isinstance(value, str) or value not in DECODE_BACKENDS:
            raise OptionError(f"{PREFIX}.decode_backend: {value!r} is not one of {', '.join(DECODE_BACKENDS)} "
                              "(auto: every op's standard implementation; latency_specialized: the contracted "
                              "kernels inside their envelopes)")
        return value

    @staticmethod
    def _contracts_dir(value: Any) -> Path:
        if not isinstance(value, str) or not Path(value).is_dir():
            raise OptionError(f"{PREFIX}.contracts_dir: {value!r} is not a directory (the contracts that "
                              "latency_specialized loads)")
        return Path(value)
