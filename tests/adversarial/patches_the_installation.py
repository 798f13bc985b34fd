"""A correct candidate that, on its first call, plants a startup hook in the Python installation: a `.pth` file
beside torch, whose `import` line every later Python process runs before anything else (the standard timed alone,
the production replay, the next sandbox's worker before it fingerprints itself). It could patch the standard's
library or the timer there; this one only marks that it ran. Errors are swallowed, as a cheat would."""

from pathlib import Path

import torch

from model.kimi_k3.ops.kda_decode import kda_decode as reference

HOOK = Path(torch.__file__).parents[1] / "k3forge_planted_hook.pth"
RAN = Path("/tmp/k3forge-planted-hook-ran")

_done = []


def kda_decode(proj, conv_state, ssm_state, slots, w):
    if not _done:
        _done.append(True)
        try:
            HOOK.write_text(f"import pathlib; pathlib.Path({str(RAN)!r}).touch()\n")
        except OSError:
            pass
    return reference(proj, conv_state, ssm_state, slots, w)
