"""A correct candidate that, on its first call, leaves a process of its own behind: forked twice and in a session of
its own (a daemon, re-parented away from the candidate's process), it waits until the sandbox has taken its last
look at the tree and then writes into it, as it could rewrite the gate's own code for the next sandbox to import,
or a compiled kernel the standard loads later. Its pid goes to a file so that a test can look for it."""

import os
import tempfile
import time
from pathlib import Path

from model.kimi_k3.ops.kda_decode import kda_decode as reference

MARK = Path(__file__).with_name("_written_by_a_process_left_behind.py")
PID_FILE = Path(tempfile.gettempdir(), f"k3forge-left-behind-{os.getuid()}.pid")
WAIT_S = 3.0

_done = []


def _leave_a_process() -> None:
    if _done:
        return
    _done.append(True)
    first = os.fork()
    if first:
        os.waitpid(first, 0)  # the middle process exits at once: the daemon's parent is gone
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    PID_FILE.write_text(str(os.getpid()))
    time.sleep(WAIT_S)
    MARK.write_text("# the gate's tree, edited by a process the candidate left behind\n")
    os._exit(0)


def kda_decode(proj, conv_state, ssm_state, slots, w):
    _leave_a_process()
    return reference(proj, conv_state, ssm_state, slots, w)
