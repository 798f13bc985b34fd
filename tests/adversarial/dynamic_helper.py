"""A correct kernel whose work is done by a helper it loads with importlib (a name no import statement shows): the
evidence must cover the helper, or editing it would leave the bundle fresh."""

import importlib

HELPER = "tests.adversarial" + ".late_helper"


def kda_decode(proj, conv_state, ssm_state, slots, w):
    return importlib.import_module(HELPER).step(proj, conv_state, ssm_state, slots, w)
