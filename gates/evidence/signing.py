"""Signed bundles: an HMAC-SHA256 of manifest.json under a key that only the machines running the gate hold.

The manifest holds the sha256 of every other file of the bundle, so its MAC covers the whole bundle; it is
written beside it as signature.json. The key comes from the environment: K3FORGE_EVIDENCE_KEY (the key itself)
or K3FORGE_EVIDENCE_KEY_FILE (a file holding it), never both. What a signature does and does not protect
against is in README.md ("Signed evidence").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

KEY_VAR, KEY_FILE_VAR = "K3FORGE_EVIDENCE_KEY", "K3FORGE_EVIDENCE_KEY_FILE"
SIGNATURE_FILE = "signature.json"
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32  # a guessable key signs nothing: `openssl rand -hex 32` makes one


class SigningKeyError(Exception):
    """The signing key is configured but unusable; says which variable and what to fix."""


def signing_key() -> bytes | None:
    """The key the environment configures, or None when neither variable is set."""
    text, file = os.environ.get(KEY_VAR), os.environ.get(KEY_FILE_VAR)
    if text is not None and file is not None:
        raise SigningKeyError(f"both {KEY_VAR} and {KEY_FILE_VAR} are set; set one")
    if file is not None:
        try:
            key, source = Path(file).read_bytes().strip(), f"{KEY_FILE_VAR} ({file})"
        except OSError as e:
            raise SigningKeyError(f"{KEY_FILE_VAR}: cannot read {file} ({e.strerror})") from None
    elif text is not None:
        key, source = text.strip().encode(), KEY_VAR
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(f"{source}: the key is {len(key)} bytes; it needs at least {MIN_KEY_BYTES} "
                              "(e.g. `openssl rand -hex 32`)")
    return key


def mac(manifest: bytes, key: bytes) -> str:
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


def signature_text(manifest: bytes, key: bytes) -> str:
    """The contents of signature.json for this manifest."""
    return json.dumps({"algorithm": ALGORITHM, "mac": mac(manifest, key)}, indent=2) + "\n"


def signature_problems(manifest: bytes, signature: Path, key: bytes) -> list[str]:
    """Why `signature` (an existing regular file) is not this key's MAC of `manifest`."""
    try:
        recorded = json.loads(signature.read_text())
        valid = recorded["algorithm"] == ALGORITHM and isinstance(recorded["mac"], str)
    except (OSError, ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        return [f"{signature}: not a signature (expected JSON with algorithm {ALGORITHM!r} and a mac)"]
    if not hmac.compare_digest(recorded["mac"], mac(manifest, key)):
        return [f"{signature}: does not match the manifest under this key (the bundle changed after it was signed, "
                "or another key signed it)"]
    return []
