"""The gate's side of the isolation: candidate code runs only in a spawned child (gates.core.worker).

Requests are torch-serialized tensors (never the seed that drew them) in a file of the sandbox's own folder, whose
path goes down a private pipe: the child maps the file (a private, copy-on-write mapping: nothing it writes reaches
the file or the gate), so a request's gigabytes of long-context caches are written once and never pickled through
the pipe and copied out again. Replies come back as bytes the gate loads with `weights_only=True`, so nothing the
child sends can run code in the gate. A child
that dies, hangs or sends something else is an error of the candidate, never a pass.

Where Linux allows it the child is confined (gates.core.isolation): the tree, the Python installation and the gate's
own folders (every sandbox's requests; for a child that runs candidate code, the compile caches the gate's processes
load from, gates.core.caches) are read-only to it, the key file is hidden, and it holds no capability. Otherwise it
runs as the same user on the same tree, so it could write there: rewrite a contract, a problem, the gate's own code
or its bytecode for the next run. Either way the watch below stands. The gate has parsed and imported all it judges
by before any child starts (gates.core.runner), and the sandbox keeps the tree as it was (every file's size and
modification time and, bytecode aside, its bytes; prose outside evidence/ aside) when the child starts and compares
it after every reply: a file the child's lifetime added, changed or removed is a TamperError, a finding against the
candidate, and is undone at once (and again when the sandbox closes), so nothing the candidate writes survives into
the tree or the judge of a later run. New bytecode files, and rewrites of bytecode that was stale, are what imports
do and are not counted (the child itself compiles nothing into the tree).

Nor does a process of its own outlive it: the child runs in a session of its own, the gate's process adopts every
orphan below it, and what the child leaves running outside itself (a detached process that could rewrite the tree
after the sandbox's last look, or keep the GPU busy while the standard is timed) is stopped and is a TamperError
too, found after every reply and once more when the child has ended (gates.core.strays).

Secrets stay out of the child's reach. The evidence signing key is withheld from its environment when it is started
(a spawned process begins with the parent's environment, and popping a variable inside it leaves it in the block
/proc/<pid>/environ shows), and the gate's process and the child's are undumpable (gates.core.machine.undumpable):
no other process of the user reads the seed from the gate's memory or the key from the environment it began with.
"""

from __future__ import annotations

import functools
import io
import json
import multiprocessing
import multiprocessing.spawn as mp_spawn
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gates.core import caches, isolation, strays, worker
from gates.core.machine import folder_of_this_process, undumpable
from gates.core.sources import REPO_ROOT
from gates.evidence.signing import KEY_FILE_VAR, KEY_VAR

DEFAULT_TIMEOUT_S = 600.0
WITHHELD = (KEY_VAR, KEY_FILE_VAR)  # never in a child's environment
CONFINE = sys.platform.startswith("linux")  # start children under the isolation launcher (tests turn it off to
# see what the watch finds without it)
CONFINED_PYTHON = Path(__file__).with_name("confined.sh")  # the launcher, as the one executable spawn accepts
PYTHON_VAR = "K3FORGE_PYTHON"  # the interpreter confined.sh runs
_starting = threading.Lock()  # the gate starts sandboxes from several threads (the evals beside the numerics)


def _writable() -> list[Path]:
    """What a child running candidate code must still write besides its temporary files: its copies of the compile
    caches (gates.core.caches) and whatever else lives under the home directory."""
    return [Path.home(), caches.private_root()]


def confinement(runs_candidate: bool = True) -> dict:
    """What a child is confined to (gates.core.isolation.plan): the tree and the installation read-only, and the
    gate's own folders: the request folders always (the child only reads its requests), the compile caches for a
    child that runs candidate code (one that runs only the standard compiles into them); the signing key's file,
    if one is configured, hidden."""
    key_file = os.environ.get(KEY_FILE_VAR)
    gate_places = [*request_folders().values(), *(caches.gate_caches().values() if runs_candidate else [])]
    return isolation.plan(REPO_ROOT, writable=_writable(), hidden=[Path(key_file)] if key_file else [],
                          gate_places=gate_places)


def request_folders() -> dict[str, Path]:
    """This process's folders of its sandboxes' request folders, one in memory (/dev/shm, where it exists) and one
    in the temporary folder, each made once and removed at exit. Every child sees them read-only: a child loads
    its requests as the gate's (trusted, a pickle), so a request put in place of another by a candidate's process
    would run its code in that child, the standard's among them."""
    roots = [root for root in (INBOX_ROOT, tempfile.gettempdir()) if os.path.isdir(root)]
    return {root: folder_of_this_process("k3forge-requests-", root) for root in roots}


@functools.cache
def isolation_account() -> str:
    """How children running candidate code are walled in on this machine, or why they are not: what a trial child
    confined as they are says (asked once a process)."""
    return isolation.available(confinement())


def confined_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """A Python command line that runs candidate code (the production replay), under the isolation launcher where
    confining is on, and what its environment must add (its copies of the compile caches among it)."""
    argv, env = isolation.command(argv, confinement()) if CONFINE else (argv, {})
    return argv, caches.candidate_env() | env | _no_user_site()


@contextmanager
def _starting_child(runs_candidate: bool):
    """While a child is started (spawn copies the environment, and reads the interpreter to run, as they are
    then): the key variables out of os.environ, and, where confining is on, the child started under the isolation
    launcher with its plan (`confinement`) in its environment. Nothing else of os.environ changes meanwhile: the
    gate's other threads read it (a compile there must find the gate's own caches), so a child's own variables go
    down to it as `worker.serve`'s arguments."""
    with _starting:
        saved = {name: os.environ.pop(name) for name in WITHHELD if name in os.environ}
        executable = mp_spawn.get_executable()
        extra = {name: value for name, value in _no_user_site().items() if name not in os.environ}
        os.environ.update(extra)
        if CONFINE and os.access(CONFINED_PYTHON, os.X_OK):  # an install that lost the mode: the worker says so
            plan = json.dumps(confinement(runs_candidate))
            os.environ.update({isolation.PLAN_VAR: plan, PYTHON_VAR: os.fsdecode(executable)})
            mp_spawn.set_executable(str(CONFINED_PYTHON))
        try:
            yield
        finally:
            mp_spawn.set_executable(executable)
            os.environ.pop(isolation.PLAN_VAR, None)
            os.environ.pop(PYTHON_VAR, None)
            for name in extra:
                os.environ.pop(name, None)
            os.environ.update(saved)


class SandboxError(Exception):
    """The candidate's process failed as a whole: died, hung, or raised outside a call."""


class TamperError(SandboxError):
    """The candidate replaced a function the harness times or checks with."""


KILL_WAIT_S = 30.0
# Requests are written to memory (/dev/shm) where it has room for the largest (a 32K-token MLA point's cases are
# ~3 GB), to the temporary folder otherwise, and down the pipe itself if the file cannot be written
INBOX_ROOT, INBOX_MIN_FREE = "/dev/shm", 16 << 30
STACK_LINES = 12  # innermost frames of a hung child quoted in the error


PYC_HEADER = 16  # magic, flags, source mtime, source size (importlib's timestamp-based pyc)


def _fresh_pyc(path: Path) -> bool:
    """Whether a bytecode file's header names its source's current modification time and size (what an import
    accepts without recompiling)."""
    source = path.parent.parent / (path.name.split(".")[0] + ".py")
    try:
        header = path.read_bytes()[:PYC_HEADER]
        st = source.stat()
    except OSError:
        return False
    return (len(header) == PYC_HEADER and int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == st.st_size & 0xFFFFFFFF)


PROSE = (".md", ".txt", ".rst")  # documentation outside evidence/: nothing judges by it, and people edit it while
# a gate runs


def tree_state(root: Path = REPO_ROOT) -> dict[str, tuple]:
    """Every file of the tree (hidden directories, virtual environments and git's own store left out, and prose
    outside evidence/) with its size, modification and change times, and for a bytecode file whether it is
    fresh."""
    state = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        in_evidence = Path(directory).is_relative_to(root / "evidence")
        for name in files:
            if name.endswith(PROSE) and not in_evidence:
                continue
            path = Path(directory, name)
            try:
                st = path.lstat()
            except OSError:
                continue
            rel = path.relative_to(root).as_posix()
            # the change time too: a write of the same size with its modification time set back (os.utime) changes
            # the change time, which no process can set
            state[rel] = (st.st_size, st.st_mtime_ns, _fresh_pyc(path) if name.endswith(".pyc") else None,
                          st.st_ctime_ns)
    return state


def written(before: dict[str, tuple], after: dict[str, tuple]) -> list[tuple[str, str]]:
    """(path, added|changed|removed) for each difference that is not an import compiling bytecode."""
    out = []
    for rel in sorted(set(before) | set(after)):
        was, now = before.get(rel), after.get(rel)
        if was == now:
            continue
        if rel.endswith(".pyc") and (was is None or not was[2]):  # new, or replacing stale bytecode: an import
            continue
        out.append((rel, "added" if was is None else "removed" if now is None else "changed"))
    return out


class TreeGuard:
    """The tree as it was before candidate code ran: every file's state and, bytecode aside, its bytes, so that
    what a candidate's process wrote is found (`writes`) and undone (`restore`): nothing it writes survives into
    the tree or a later run's judge."""

    def __init__(self, root: Path = REPO_ROOT):
        self.root = root
        self.state = tree_state(root)
        self.contents = {rel: (root / rel).read_bytes() for rel, st in self.state.items() if st[2] is None}

    def writes(self) -> list[str]:
        """`path (added|changed|removed)` for each write since the guard was made."""
        return [f"{rel} ({kind})" for rel, kind in written(self.state, tree_state(self.root))]

    def restore(self) -> None:
        """Undo exactly what `writes` reports: put back every file it changed or removed (with its modification
        time) and remove the ones it added; fresh bytecode it rewrote is removed (the next import compiles it)."""
        for rel, _ in written(self.state, tree_state(self.root)):
            path = self.root / rel
            if rel in self.contents:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(self.contents[rel])
                os.utime(path, ns=(self.state[rel][1], self.state[rel][1]))
            else:
                path.unlink(missing_ok=True)
        self.state = tree_state(self.root)  # the restored files' bytes are the kept ones; their change times new


class InstallationGuard:
    """Where children cannot be confined, the Python installation (`isolation.unguarded_installation`) as it was
    before any candidate code ran in this process: a library the standard imports patched there, or a startup
    hook planted (a `.pth` file, `sitecustomize`), would run in every later process. Its state (each file's
    size, modification and change time, as the tree's) is taken once a process, on first use, and compared when a
    child that ran candidate code has ended (a walk of tens of thousands of files takes about a second, too long
    for every reply). What changed is reported, not undone: nothing kept the bytes. New bytecode, or bytecode
    replacing stale bytecode, is what imports do."""

    _baseline: dict[Path, dict[str, tuple]] | None = None
    _lock = threading.Lock()

    def __init__(self):
        with self._lock:
            if InstallationGuard._baseline is None:
                InstallationGuard._baseline = {root: tree_state(root)
                                               for root in isolation.unguarded_installation(REPO_ROOT, _writable())}

    def changed(self) -> list[str]:
        return [f"{root / rel} ({kind})" for root, before in self._baseline.items()
                for rel, kind in written(before, tree_state(root))]


def _first(items: list, shown: int) -> str:
    """The first `shown` of `items`, and how many more there are."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(str(item) for item in items[:shown]) + more


STRAY_GRACE_S = 2.0  # when a process running candidate code has ended: how long what it left gets to end by itself


def user_site() -> Path:
    """Python's user site directory as a process started now would compute it (PYTHONUSERBASE, else ~/.local):
    a `usercustomize` module or `.pth` file there runs at the start of every later Python process of the user,
    before anything it imports (a worker's fingerprints included), and in every later gate."""
    base = os.environ.get("PYTHONUSERBASE") or os.path.expanduser("~/.local")
    return Path(sysconfig.get_path("purelib", f"{os.name}_user", vars={"userbase": base}))


def _no_user_site() -> dict[str, str]:
    """A child's environment addition: where the user site directory does not exist (nothing installed there), a
    child never reads one, so one planted by another child's candidate code runs nowhere before it is undone;
    where it exists it is an import path, read-only to a confined child."""
    return {} if user_site().is_dir() else {"PYTHONNOUSERSITE": "1"}


class Watch:
    """What a process running candidate code must leave as it found it: the tree (TreeGuard), the compile caches
    the standard loads from (CacheGuard) and no process of its own running outside it (gates.core.strays). Made
    before the process starts; `broken` is asked after every reply and once the process has ended. A process
    that runs only the standard (`runs_candidate=False`) is held to the tree alone and answers only for strays
    of its own session: a candidate's process running beside it is found and blamed by its own watch."""

    def __init__(self, runs_candidate: bool = True):
        strays.adopt_orphans()
        self._tree = TreeGuard()
        self._caches = caches.CacheGuard() if runs_candidate else caches.CacheGuard(roots=[])
        # where it exists it is an import path (read-only to a confined child, walked by the installation's guard)
        # or one this interpreter never reads (a virtual environment's); where it does not, none may appear
        self._user_site = TreeGuard(user_site()) if runs_candidate and not user_site().is_dir() else None
        confined = CONFINE and isolation_account().startswith("confined")
        self._installation = InstallationGuard() if runs_candidate and not confined else None
        self.runs_candidate = runs_candidate

    def broken(self, session: int | None = None, ended: bool = False) -> list[str]:
        """What the watched process did that it must not, each undone: the strays stopped first (so that none
        writes after the tree is restored), then the tree restored and rewritten cache entries removed. `session`
        is the watched process's; `ended`: it has exited, so what it left gets a grace to end by itself."""
        sessions = None if self.runs_candidate else ({session} if session is not None and ended else set())
        problems = []
        if sessions != set() and (left := strays.stop(sessions, grace_s=STRAY_GRACE_S if ended else 0.0)):
            problems.append(f"left processes running outside it: {_first(left, 3)} (stopped)")
        if writes := self._tree.writes():
            self._tree.restore()
            problems.append(f"wrote to the repository: {_first(writes, 5)} (undone)")
        if self._user_site and (planted := self._user_site.writes()):
            self._user_site.restore()
            problems.append(f"planted in Python's user site directory ({self._user_site.root}), which every later "
                            f"Python process of the user runs: {_first(planted, 3)} (undone)")
        if rewritten := self._caches.rewritten():
            self._caches.undo(rewritten)
            problems.append(f"rewrote compiled kernels in a compile cache of the gate's own processes: "
                            f"{_first(rewritten, 3)} (removed)")
        if ended and self._installation and (changed := self._installation.changed()):
            problems.append(f"changed the Python installation, which every later process runs: {_first(changed, 3)} "
                            "(not undone: reinstall it)")
        return problems


class Sandbox:
    def __init__(self, env: dict[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 runs_candidate: bool = True):
        """`runs_candidate=False` for a child that runs only the standard: it works in the gate's own compile
        caches (writable to it) and does not guard them: a rewrite by a candidate's process running beside it is
        found and blamed by that process's sandbox."""
        self._watch = Watch(runs_candidate)
        self.loaded: set[str] = set()  # repository files the child loaded beyond the worker's own (every reply's)
        self.confined: str | None = None  # what the isolation launcher did for the child (its first reply says)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        fd, self._stacks = tempfile.mkstemp(prefix="k3forge-candidate-", suffix=".stacks")
        os.close(fd)
        folders = request_folders()
        roomy = INBOX_ROOT in folders and shutil.disk_usage(INBOX_ROOT).free >= INBOX_MIN_FREE
        parent = folders[INBOX_ROOT] if roomy else folders[tempfile.gettempdir()]
        self._inbox, self._sent = Path(tempfile.mkdtemp(dir=parent)), 0
        # a candidate's process works in its own copies of the compile caches (gates.core.caches)
        env = (caches.candidate_env() if runs_candidate else {}) | dict(env or {})
        self._proc = ctx.Process(target=worker.serve, args=(child, env, self._stacks), daemon=True,
                                 name="k3forge-candidate")
        undumpable()
        with _starting_child(runs_candidate), strays.starting():
            self._proc.start()
            strays.register(self._proc.pid)
        child.close()
        self.timeout_s = timeout_s

    def request(self, kind: str, timeout_s: float | None = None, **payload) -> dict:
        """Send one request and wait for its reply (`timeout_s`, default the sandbox's, bounds the wait)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        path = self._inbox / f"{self._sent}-{kind}.pt"
        self._sent += 1
        try:
            try:
                torch.save({"kind": kind, **payload}, path)
                message = worker.REQUEST_FILE + str(path).encode()
            except (OSError, RuntimeError):  # no room (torch reports a short write as a RuntimeError): the pipe
                path.unlink(missing_ok=True)
                buf = io.BytesIO()
                torch.save({"kind": kind, **payload}, buf)
                message = worker.REQUEST_BYTES + buf.getvalue()
            self._conn.send_bytes(message)
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
        finally:
            path.unlink(missing_ok=True)  # the child's mapping, if any, outlives the name
        try:
            reply = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise SandboxError(f"{kind}: the candidate's process sent something other than plain tensors and "
                               f"numbers ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        self.loaded.update(reply.get("loaded", []))
        self.confined = reply.get("confined")
        if reply.get("tampered"):
            raise TamperError(f"the candidate replaced {', '.join(reply['tampered'])}: timings and results from "
                              "its process cannot be trusted")
        if broken := self._watch.broken(self._proc.pid):
            raise TamperError(f"the candidate's process {'; '.join(broken)}")
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

    def close(self) -> list[str]:
        """End the child and undo what it did; what it did that it must not after its last reply (a process it
        left behind, a write by a thread it left running), as `Watch.broken` words it."""
        if self._proc.is_alive():
            try:
                self._conn.send_bytes(worker.REQUEST_END)
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                # a process stuck inside the GPU driver may outlive SIGKILL for a while: never wait on it forever
                self._proc.join(KILL_WAIT_S)
        if self._proc.exitcode is not None:  # reaped: its pid may be reused from now on
            strays.forget(self._proc.pid)
        self._conn.close()
        Path(self._stacks).unlink(missing_ok=True)
        shutil.rmtree(self._inbox, ignore_errors=True)
        return self._watch.broken(self._proc.pid, ended=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, exc_type, *_) -> None:
        broken = self.close()
        if broken and exc_type is None:  # an error already on its way out says more than what was undone
            raise TamperError(f"the candidate's process, by the time it ended, {'; '.join(broken)}")

