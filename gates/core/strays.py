"""Processes a candidate leaves running outside the process the gate started for it, found and stopped.

A candidate's process can start a process of its own and detach it (fork twice, `setsid`): without more, the
detached process is re-parented to init and outlives the sandbox, free to rewrite the tree after the sandbox's last
look at it (so that the next sandbox takes the rewritten tree, the gate's own code included, for the tree as it
was), to rewrite a compiled kernel the standard loads later, or to keep the GPU busy while the standard is timed.

So the gate's process makes itself the reaper of its descendants' orphans (`adopt_orphans`, Linux's child
subreaper): every process a candidate's process leaves behind is re-parented to the gate instead of init, wherever
it hides in the tree below. Every process the gate starts for candidate code runs in a session of its own (the
sandbox's worker calls `setsid` before importing anything of the candidate's; the production replay is started
with a new session) and is registered here while it lives (`register`, `forget`). Invariant: the gate starts no
other process outside its own session. A child of the gate's process outside the gate's session that is not
registered is then a stray: what a candidate's process left behind, detached or not (no process can join the
gate's session again: `setsid` only ever makes a new one). `stop` freezes the strays and everything below them
until no new process appears, then kills and reaps them.

What this cannot stop: a process started by asking something outside the gate's tree to start it (a user service
manager, a cron daemon, a login over ssh). That needs the OS isolation PRACTICES.md lists as planned.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
FREEZE_ROUNDS = 64  # rounds of freezing what appeared below the frozen ones (a fork bomb stops growing when frozen)
REAP_WAIT_S = 5.0  # a killed process stuck in a driver call may take a while to die: never wait forever

_registered: set[int] = set()
_lock = threading.Lock()
# Held while the gate starts a process in a session of its own and registers it, and while a scan looks for
# strays: such a child is outside the gate's session from its fork on, before the call that starts it returns its
# pid, so a scan from another thread (the evals run beside the numerics) would otherwise take it for a stray.
_starting = threading.Lock()


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    session: int
    started: int  # clock ticks after boot: with the pid, names one process (pids are reused)
    state: str  # R, S, D, Z (zombie), T (stopped), ...
    name: str

    def __str__(self) -> str:
        return f"{self.pid} ({self.name})"


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux 3.4 and later, no privilege needed).
    False where the platform has no prctl."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextmanager
def starting():
    """Start a process in a session of its own and `register` it inside this block: no scan runs meanwhile."""
    with _starting:
        yield


def register(pid: int) -> None:
    """A process the gate started for candidate code, in a session of its own: not a stray while registered."""
    with _lock:
        _registered.add(pid)


def forget(pid: int) -> None:
    """Called once the process has been reaped (its pid can be reused only then)."""
    with _lock:
        _registered.discard(pid)


def _read(pid: int) -> Process | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:  # gone
        return None
    # `pid (name) state ppid pgrp session ... starttime (field 22)`; the name may hold spaces and parentheses
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    return Process(pid=pid, ppid=int(fields[1]), session=int(fields[3]), started=int(fields[19]), state=fields[0],
                   name=head.partition("(")[2])


def table() -> dict[int, Process]:
    """Every process this one can see (empty without /proc)."""
    try:
        pids = [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return {}
    return {p.pid: p for p in map(_read, pids) if p is not None}


def strays(procs: dict[int, Process] | None = None, sessions: set[int] | None = None) -> list[Process]:
    """This process's children outside its session and not registered; with `sessions`, only those in one of
    them (a sandbox that runs only the standard answers for its own worker's session, never for a candidate's)."""
    if procs is None:
        with _starting:
            return strays(table(), sessions)
    me, mine = os.getpid(), os.getsid(0)
    with _lock:
        registered = set(_registered)
    return [p for p in procs.values() if p.ppid == me and p.session != mine and p.pid not in registered
            and (sessions is None or p.session in sessions)]


def _below(procs: dict[int, Process], roots: list[Process]) -> list[Process]:
    """`roots` and every process below them."""
    children: dict[int, list[Process]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = [], list(roots)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p.pid, [])
    return out


def _signal(p: Process, sig: int) -> None:
    """Send `sig` to `p` if its pid still names it: through a pidfd, so that the check and the signal name the same
    process even if `p` dies and its pid is reused in between."""
    try:
        fd = os.pidfd_open(p.pid)
    except AttributeError:  # no pidfd (an older Python or kernel): the window between check and kill stays
        fd = None
    except OSError:
        return
    try:
        if (now := _read(p.pid)) is None or now.started != p.started:
            return
        signal.pidfd_send_signal(fd, sig) if fd is not None else os.kill(p.pid, sig)
    except (OSError, AttributeError):
        pass
    finally:
        if fd is not None:
            os.close(fd)


def _reap(pids: set[int]) -> None:
    """Wait for `pids` to be gone, reaping those that are (or have become) this process's children."""
    deadline = time.monotonic() + REAP_WAIT_S
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours (its parent lives, or it is gone): done once /proc forgets it
                done = pid if _read(pid) is None else 0
            if done:
                pids.discard(pid)
        if pids:
            time.sleep(0.01)


def stop(sessions: set[int] | None = None, grace_s: float = 0.0) -> list[Process]:
    """Stop every stray (see `strays`) and everything below it, and return the ones that were still alive. With
    `grace_s`, strays are first given that long to end by themselves (a helper whose parent just exited, like
    multiprocessing's resource tracker, ends on its own a moment later). Strays already dead (zombies) are
    reaped and not returned."""
    deadline = time.monotonic() + grace_s
    while (found := strays(sessions=sessions)) and any(p.state != "Z" for p in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    frozen: dict[int, Process] = {}
    for _ in range(FREEZE_ROUNDS):
        with _starting:
            procs = table()
            found = strays(procs, sessions)
        new = [p for p in _below(procs, found) if p.pid not in frozen]
        if not new:
            break
        for p in new:
            if p.state != "Z":
                _signal(p, signal.SIGSTOP)
            frozen[p.pid] = p
    for p in frozen.values():
        if p.state != "Z":
            _signal(p, signal.SIGKILL)
    _reap(set(frozen))
    return [p for p in frozen.values() if p.state != "Z"]
