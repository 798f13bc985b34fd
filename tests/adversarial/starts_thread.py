"""A correct kernel that starts a thread beside each call. This one's thread does nothing, but a thread (or a
process) can keep the GPU busy while the gate times the standard, or do the kernel's work off the timed stream; the
screen cannot tell which from the code, so it lists every such call for the reviewer."""

import threading

from model.kimi_k3.ops.kda_decode import kda_decode as reference


def kda_decode(proj, conv_state, ssm_state, slots, w):
    threading.Thread(target=lambda: None, daemon=True).start()
    return reference(proj, conv_state, ssm_state, slots, w)
