"""Processes a candidate leaves behind: re-parented to the gate's process, told from the gate's own children by
their session, stopped with everything below them."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gates.core import strays
from gates.core.sandbox import Watch

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists() or not strays.adopt_orphans(),
                                reason="needs Linux's /proc and child subreaper")

# Forks twice; the grandchild starts a session of its own (or not) and a child of its own, then sleeps. The middle
# process prints the grandchild's pid and exits, so the grandchild is an orphan.
LEAVE = """
import os, sys, time
if os.fork():
    os.wait()
    sys.exit(0)
if sys.argv[1] == "detached":
    os.setsid()
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the test reads the middle process's output to its end
if not os.fork():
    time.sleep(60)
time.sleep(60)
"""


def until(condition, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def leave_a_process(how: str) -> tuple[int, int]:
    """Run LEAVE in a session of its own (as the gate runs candidate code), registered while it lives; the pids of
    the process it leaves behind and of that one's child."""
    proc = subprocess.Popen([sys.executable, "-c", LEAVE, how], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    strays.register(proc.pid)
    out, _ = proc.communicate(timeout=30)
    strays.forget(proc.pid)
    pid = int(out)
    until(lambda: (p := strays.table().get(pid)) and p.ppid == os.getpid(), f"{pid} re-parented to the test")
    child = until(lambda: next((p.pid for p in strays.table().values() if p.ppid == pid), None), f"{pid}'s child")
    return pid, child


def alive(pid: int) -> bool:
    p = strays.table().get(pid)
    return p is not None and p.state != "Z"


@pytest.mark.parametrize("how", ["detached", "in_its_session"])
def test_a_process_left_behind_is_stopped_with_everything_below_it(how):
    pid, child = leave_a_process(how)
    assert [p.pid for p in strays.strays()] == [pid]
    assert {p.pid for p in strays.stop()} == {pid, child}
    assert not alive(pid) and not alive(child)
    assert strays.strays() == []


def test_the_gates_own_children_are_not_strays():
    """A child in the gate's session, and a registered one in a session of its own (a sandbox's worker)."""
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    strays.register(own.pid)
    try:
        assert {p.pid for p in strays.strays()}.isdisjoint({plain.pid, own.pid})
        assert strays.stop() == [] and plain.poll() is None and own.poll() is None
    finally:
        for proc in (plain, own):
            proc.kill()
            proc.wait()
        strays.forget(own.pid)


def test_a_child_being_started_in_a_session_of_its_own_is_no_stray_to_a_scan_from_another_thread():
    """Outside the gate's session from its fork, before its pid is known and registered: a scan from another thread
    (the evals beside the numerics: CI, session 28, stopped the production replay so) waits until it is."""
    import threading

    scans: list[list] = []
    with strays.starting():
        own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        until(lambda: strays._read(own.pid) is not None and strays._read(own.pid).session == own.pid, "its setsid")
        scan = threading.Thread(target=lambda: scans.append(strays.stop()))
        scan.start()
        time.sleep(0.2)
        assert scans == []  # the scan waits for the registration
        strays.register(own.pid)
    scan.join(10)
    try:
        assert scans == [[]] and own.poll() is None
    finally:
        own.kill()
        own.wait()
        strays.forget(own.pid)


def test_a_watch_over_the_standard_answers_only_for_its_own_session():
    """A standard-only process's watch leaves a stray of another session to the candidate's watch, which stops it
    and says so."""
    pid, child = leave_a_process("detached")
    assert Watch(runs_candidate=False).broken(session=os.getpid(), ended=True) == []
    assert alive(pid)
    (problem,) = Watch().broken()
    assert problem.startswith(f"left processes running outside it: {pid} (") and problem.endswith("(stopped)")
    assert not alive(pid) and not alive(child)


def test_strays_that_have_already_ended_are_reaped_quietly():
    pid, child = leave_a_process("detached")
    os.kill(child, 9)
    os.kill(pid, 9)  # its child, if still alive, is re-parented here: both end as zombies of this process
    until(lambda: all((p := strays.table().get(q)) and p.state == "Z" and p.ppid == os.getpid() for q in (pid, child)),
          "both zombies of the test's process")
    assert strays.stop() == []
    assert pid not in strays.table() and child not in strays.table()
