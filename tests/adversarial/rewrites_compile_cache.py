"""A correct candidate that rewrites compiled kernels in the Triton cache, which the standard (FLA's kernels) loads
from: a slow or wrong binary under the standard's own cache key would slow or spoil the standard in every later
process, its timing alone included, with nothing in the tree changed. Here every entry's bytes are flipped, once."""

import os
from pathlib import Path

from model.kimi_k3.ops.kda_decode import kda_decode as reference

_done = []


def _rewrite_cache() -> None:
    if _done:
        return
    _done.append(True)
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    for path in root.rglob("*"):
        if path.is_file():
            path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))


def kda_decode(proj, conv_state, ssm_state, slots, w):
    _rewrite_cache()
    return reference(proj, conv_state, ssm_state, slots, w)
