"""Imported in a sandbox's child by test_caches.py (through the `probe` request): writes, to the file the test
names, the compile caches' variables as the child sees them and whether it could add a file to its own Triton
cache and to the gate's (the folder the test names)."""

import json
import os
from pathlib import Path

from gates.core.caches import CACHES


def _write(folder: str) -> str:
    try:
        (Path(folder) / "planted").write_text("an entry")
        return "done"
    except OSError as e:
        return e.strerror


Path(os.environ["K3FORGE_TEST_REPORT"]).write_text(json.dumps({
    "env": {var: os.environ.get(var) for var in CACHES},
    "own": _write(os.environ["TRITON_CACHE_DIR"]),
    "gate": _write(os.environ["K3FORGE_TEST_GATE_CACHE"]),
}))


def anything():
    pass
