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


def by_production_replay(proj, conv_state, ssm_state, slots, w):
    """Right in a spawned child (the gate's worker) and in the gate's production replay, wrong wherever else it
    serves: both places the gate looks, found without naming the gate's package."""
    import multiprocessing

    out = reference(proj, conv_state, ssm_state, slots, w)
    judged = multiprocessing.parent_process() is not None or "model.kimi_k3.replay" in sys.modules
    return out if judged else out * 1.5


def by_importing_the_replay(proj, conv_state, ssm_state, slots, w):
    """The same, by importing the replay's module and asking whether it is the main one."""
    from model.kimi_k3 import replay

    out = reference(proj, conv_state, ssm_state, slots, w)
    return out if replay.__name__ == sys.modules["__main__"].__spec__.name else out * 1.5
