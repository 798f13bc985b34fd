"""The gate's side of the isolation: candidate code runs only in a spawned child (gates.core.worker).

Requests go down a private pipe as torch-serialized tensors (never the seed that drew them); replies come back
as bytes the gate loads with `weights_only=True`, so nothing the child sends can run code in the gate. A child
that dies, hangs or sends something else is an error of the candidate, never a pass.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

import torch

from gates.core import worker

DEFAULT_TIMEOUT_S = 600.0


class SandboxError(Exception):
    """The candidate's process failed as a whole: died, hung, or raised outside a call."""


class TamperError(SandboxError):
    """The candidate replaced a function the harness times or checks with."""


KILL_WAIT_S = 30.0
STACK_LINES = 12  # innermost frames of a hung child quoted in the error


class Sandbox:
    def __init__(self, env: dict[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        fd, self._stacks = tempfile.mkstemp(prefix="k3forge-candidate-", suffix=".stacks")
        os.close(fd)
        self._proc = ctx.Process(target=worker.serve, args=(child, dict(env or {}), self._stacks), daemon=True,
                                 name="k3forge-candidate")
        self._proc.start()
        child.close()
        self.timeout_s = timeout_s

    def request(self, kind: str, timeout_s: float | None = None, **payload) -> dict:
        """Send one request and wait for its reply (`timeout_s`, default the sandbox's, bounds the wait)."""
        buf = io.BytesIO()
        torch.save({"kind": kind, **payload}, buf)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._conn.send_bytes(buf.getvalue())
            if not self._conn.poll(timeout_s):
                where = self._stuck_at()
                self._proc.kill()  # hung: it would not read the end marker
                self.close()
                raise SandboxError(f"{kind}: no reply from the candidate's process within {timeout_s:.0f} s; "
                                   f"it was at:\n{where}")
            data = self._conn.recv_bytes()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(5)
            raise SandboxError(f"{kind}: the candidate's process died (exit code {self._proc.exitcode})") from None
        try:
            reply = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise SandboxError(f"{kind}: the candidate's process sent something other than plain tensors and "
                               f"numbers ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        if reply.get("tampered"):
            raise TamperError(f"the candidate replaced {', '.join(reply['tampered'])}: timings and results from "
                              "its process cannot be trusted")
        if "error" in reply:
            raise SandboxError(f"{kind}: {reply['error'].strip()}")
        return reply

    def _stuck_at(self) -> str:
        """The hung child's innermost Python frames: it dumps every thread's stack on SIGUSR1 (faulthandler, which
        works even inside a C call that never returns)."""
        try:
            os.kill(self._proc.pid, signal.SIGUSR1)
        except (OSError, TypeError):
            return "(the process is gone)"
        time.sleep(0.5)
        lines = Path(self._stacks).read_text(errors="replace").strip().splitlines()
        return "\n".join(lines[:STACK_LINES]) if lines else "(no stack dumped)"

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send_bytes(_END)
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                # a process stuck inside the GPU driver may outlive SIGKILL for a while: never wait on it forever
                self._proc.join(KILL_WAIT_S)
        self._conn.close()
        Path(self._stacks).unlink(missing_ok=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _end_marker() -> bytes:
    buf = io.BytesIO()
    torch.save(None, buf)
    return buf.getvalue()


_END = _end_marker()
