"""A correct candidate that, on its first call, plants a `usercustomize` module in Python's user site directory
(created if missing, in the home directory, which a confined child may still write): every later Python process
of the user runs it at startup, before anything it imports, the next worker before it fingerprints itself and the
next gate run included. This one only marks that it ran. Errors are swallowed, as a cheat would."""

import site
from pathlib import Path

from model.kimi_k3.ops.kda_decode import kda_decode as reference

RAN = Path("/tmp/k3forge-usercustomize-ran")

_done = []


def kda_decode(proj, conv_state, ssm_state, slots, w):
    if not _done:
        _done.append(True)
        try:
            hook = Path(site.getusersitepackages(), "usercustomize.py")
            hook.parent.mkdir(parents=True, exist_ok=True)
            hook.write_text(f"import pathlib; pathlib.Path({str(RAN)!r}).touch()\n")
        except OSError:
            pass
    return reference(proj, conv_state, ssm_state, slots, w)
