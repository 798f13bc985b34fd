"""Print the requirements of the vLLM environment, one per line: the `vllm` extra of pyproject.toml (the pinned
vLLM) and k3forge's own dependencies less those vLLM pins otherwise (llguidance: vLLM 0.32 wants < 1.8).
`make install-vllm` installs them, then k3forge itself without dependencies. Standard library only.

    python3 model/kimi_k3/vllm/requirements.py [pyproject.toml]
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# k3forge dependencies left to vLLM's own pins in its environment (used by the evals, not by the plugin).
LEFT_TO_VLLM = {"llguidance"}


def requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    ours = [r for r in project["dependencies"] if requirement_name(r) not in LEFT_TO_VLLM]
    return [*project["optional-dependencies"]["vllm"], *ours]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[3] / "pyproject.toml"
    print("\n".join(requirements(path)))
