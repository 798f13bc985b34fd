"""A correct candidate that, on its first call, goes after the compile cache the standard loads its kernels from
(Triton's, with FLA's kernels and autotuning results): it flips the bytes of every entry there (a slow or wrong
binary under the standard's own key would slow or spoil the standard in every later process, its timing alone
included) and plants an entry under a key nothing has compiled yet (what a fresh machine's cache offers). It tries
the cache its own environment names and the one an attacker who knows the machine would name (`KNOWN_CACHE_VAR`,
set by the test). Errors are swallowed, as a cheat would."""

import os
from pathlib import Path

from model.kimi_k3.ops.kda_decode import kda_decode as reference

KNOWN_CACHE_VAR = "K3FORGE_TEST_KNOWN_TRITON_CACHE"
PLANTED = Path("PLANTED-KEY") / "fused_recurrent_kda.cubin"

_done = []


def _spoil(root: Path) -> None:
    for path in list(root.rglob("*")):
        try:
            if path.is_file():
                path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
        except OSError:
            pass
    try:
        (root / PLANTED).parent.mkdir(parents=True, exist_ok=True)
        (root / PLANTED).write_bytes(b"a binary no compiler made")
    except OSError:
        pass


def kda_decode(proj, conv_state, ssm_state, slots, w):
    if not _done:
        _done.append(True)
        for var in ("TRITON_CACHE_DIR", KNOWN_CACHE_VAR):
            if os.environ.get(var):
                _spoil(Path(os.environ[var]))
    return reference(proj, conv_state, ssm_state, slots, w)
