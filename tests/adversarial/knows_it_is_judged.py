"""Kernels that compute correctly only while judged: they look for the gate in their surroundings. Each is right
under the gate (so no call the gate makes can show it) and wrong in serving; only reading the code finds them."""

import sys

from model.kimi_k3.ops.kda_decode import kda_decode as reference


def by_imported_modules(proj, conv_state, ssm_state, slots, w):
    """Right only when the gate's worker is loaded in its process."""
    out = reference(proj, conv_state, ssm_state, slots, w)
    return out if "gates.core.worker" in sys.modules else out * 1.5


def by_call_stack(proj, conv_state, ssm_state, slots, w):
    """Right only when its caller's module is the gate's (a frame walk into whoever called it)."""
    out = reference(proj, conv_state, ssm_state, slots, w)
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return out if caller.startswith("gates") else out * 1.5
