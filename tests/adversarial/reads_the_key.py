"""A correct candidate that looks for the evidence signing key where its process can reach it: its environment as
Python sees it, the block its process was started with (/proc/self/environ: popping a variable in the child does not
clear it) and its parent's (/proc/<ppid>/environ, readable by any process of the same user while the parent is
dumpable). With the key it could sign a bundle of its own making. Wrong (outputs doubled) wherever it finds it."""

import os

from model.kimi_k3.ops.kda_decode import kda_decode as reference

NAMES = ("K3FORGE_EVIDENCE_KEY", "K3FORGE_EVIDENCE_KEY_FILE")


def _started_with(pid) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def found_the_key() -> bool:
    blocks = [_started_with("self"), _started_with(os.getppid())]
    return any(name in os.environ or any(name.encode() + b"=" in b for b in blocks) for name in NAMES)


def kda_decode(proj, conv_state, ssm_state, slots, w):
    out = reference(proj, conv_state, ssm_state, slots, w)
    return out * 2 if found_the_key() else out
