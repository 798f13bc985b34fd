"""Imported in a sandbox's child by the tests (through the `probe` request): writes, to the file the test names
(`K3FORGE_TEST_REPORT`), the compile caches' variables as the child sees them and, for its own Triton cache and
each folder the test names (`K3FORGE_TEST_TRY`, separated by os.pathsep), whether it could add a file there."""

import json
import os
from pathlib import Path

from gates.core.caches import CACHES


def _write(folder: str) -> str:
    try:
        (Path(folder) / "planted").write_text("written by a candidate's process")
        return "done"
    except OSError as e:
        return e.strerror


Path(os.environ["K3FORGE_TEST_REPORT"]).write_text(json.dumps({
    "env": {var: os.environ.get(var) for var in CACHES},
    "own": _write(os.environ["TRITON_CACHE_DIR"]),
    "tried": {folder: _write(folder) for folder in os.environ["K3FORGE_TEST_TRY"].split(os.pathsep)},
}))


def anything():
    pass
