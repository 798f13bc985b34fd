"""The on-disk compile caches, split by trust: the gate's own processes keep theirs, every process that runs
candidate code works in a private copy.

Libraries load compiled code from these caches by a key they compute from the source: Triton's kernels with their
autotuning results (FLA's, the standards of the KDA ops), humming's MXFP4 GEMMs and the Python modules it writes and
then imports, the CuTe DSL's and kernels.cute's compiled objects, the CUDA driver's PTX JIT cache. An entry is
trusted by its name. So whoever writes a file under the key of a kernel the standard has not compiled yet (a fresh
machine's cache) puts its own binary, or in humming's module folder its own Python, into every later process
that looks the key up: the standard timed alone, the numerics' standard, the evals' yardstick in the gate's own
process. A guard over the entries that exist (CacheGuard) cannot see such a plant, so the caches are split:

- the gate's processes (the gate itself, a sandbox that runs only the standard) use each cache where this machine
  keeps it (`gate_caches`); every one is created before a child starts, so that no candidate makes it first;
- a process that runs candidate code has each cache's variable pointed at a private copy (`candidate_env`), made
  from the gate's for each op gated (`copies_of_its_own`) and topped up with the gate's new entries whenever such a
  process starts. It compiles nothing twice, and what it writes reaches only processes that run the same candidate's
  code. The standard beside
  the candidate in its own process is at the candidate's mercy anyway: that is why it is also timed alone;
- a confined process (gates.core.isolation) sees the gate's caches read-only, and where none can be confined the
  guard below holds their existing entries to their bytes.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from gates.core.machine import folder_of_this_process
from kernels.cute import CACHE_ENV, compile_cache_dir


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _set_or(var: str, default: Callable[[], Path]) -> Callable[[], Path]:
    return lambda: Path(os.environ[var]) if os.environ.get(var) else default()


# Where each cache lies for a process started now: its variable, else the library's own default (read from its
# source: triton.knobs, humming.utils.jit, kernels.cute, cutlass.base_dsl.cache_helpers, the CUDA driver's
# documented default, torch._inductor.runtime.cache_dir_utils). kernels.cute's says None when it is off.
CACHES: dict[str, Callable[[], Path | None]] = {
    "TRITON_CACHE_DIR": _set_or("TRITON_CACHE_DIR",
                                lambda: Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"),
    "HUMMING_CACHE_DIR": _set_or("HUMMING_CACHE_DIR", lambda: Path.home() / ".humming" / "cache"),
    "HUMMING_TMP_DIR": _set_or("HUMMING_TMP_DIR", lambda: Path.home() / ".humming" / "tmp"),  # its generated modules
    CACHE_ENV: compile_cache_dir,
    "CUTE_DSL_CACHE_DIR": _set_or("CUTE_DSL_CACHE_DIR", lambda: Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
                                  / _user() / "cutlass_python_cache"),
    "CUDA_CACHE_PATH": _set_or("CUDA_CACHE_PATH", lambda: Path.home() / ".nv" / "ComputeCache"),
    "TORCHINDUCTOR_CACHE_DIR": _set_or("TORCHINDUCTOR_CACHE_DIR",
                                       lambda: Path(tempfile.gettempdir()) / f"torchinductor_{_user()}"),
}

_lock = threading.Lock()  # sandboxes start from several threads (the evals beside the numerics)


def gate_caches() -> dict[str, Path]:
    """Each cache's folder for the gate's own processes, created where it is missing; one that cannot be made (no
    right to write there) is left out: no process of this user can make it either."""
    out = {}
    for var, where in CACHES.items():
        if (path := where()) is None:
            continue
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        out[var] = path
    return out


def private_root() -> Path:
    """The folder holding this process's candidate copies (removed when it exits)."""
    return folder_of_this_process("k3forge-candidate-caches-")


@contextmanager
def copies_of_its_own():
    """While one op is gated, its candidate's processes start from fresh copies: the copies an earlier op's
    candidate worked in are removed before and after. Otherwise what one op's candidate wrote into its copy (an
    entry under the key of another op's kernel, computed from that op's source) would be what the next op's
    candidate loads in place of the binary its own source compiles to, and that op's evidence would be of a binary
    nothing it covers made. The processes of one op (numerics, benchmarks, evals, the production replay) share
    one set of copies: they run one candidate's code."""
    _empty(private_root())
    try:
        yield
    finally:
        _empty(private_root())


def _empty(root: Path) -> None:
    with _lock:
        for entry in list(root.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _top_up(source: Path, copy: Path) -> None:
    """Copy into `copy` each file and link of `source` it lacks; its own entries stay as they are. Triton's
    temporary folders are left out, and anything that is neither a regular file nor a link (a FIFO would block the
    copy). Entries are written whole and renamed into place by the libraries, so a copy is of one version."""
    for directory, dirs, files in os.walk(source):
        target = copy / Path(directory).relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        links = [d for d in dirs if Path(directory, d).is_symlink()]
        dirs[:] = [d for d in dirs if not d.startswith("tmp.") and d not in links]
        for name in files + links:
            src, dst = Path(directory, name), target / name
            if dst.exists() or dst.is_symlink():
                continue
            try:
                if src.is_symlink():
                    dst.symlink_to(os.readlink(src))
                elif src.is_file():
                    shutil.copy2(src, dst)
            except OSError:  # gone meanwhile, or unreadable: the candidate's process compiles it
                continue


def candidate_env() -> dict[str, str]:
    """For a process that runs candidate code: each cache's variable pointed at its private copy of the gate's
    folder, topped up now."""
    env = {}
    root = private_root()
    for var, path in gate_caches().items():
        copy = root / f"{var.lower()}-{hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:12]}"
        with _lock:
            if root.resolve().is_relative_to(path.resolve()):  # a cache set to the temporary folder itself: a copy
                copy.mkdir(exist_ok=True)  # would hold itself, so the candidate's starts empty
            else:
                _top_up(path, copy)
        env[var] = str(copy)
    return env


def _sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


class CacheGuard:
    """The gate's compile caches' entries as they were when a child that runs candidate code started, held to their
    bytes: the wall where the child cannot be confined (confined, it sees them read-only). A rewritten entry under
    the standard's own key would slow or spoil the standard in every later process, its timing alone included.
    New entries are what the gate's own processes compile meanwhile, and a removed one is compiled again; an entry
    replaced by the same bytes is two processes compiling one kernel at once. An entry whose bytes changed is
    reported (`rewritten`) and removed (`undo`: its next use compiles it afresh). Each file is hashed once a process
    (`_digests`, keyed by its path and identity: a replaced entry is hashed once, not after every reply); Triton's
    temporary folders (`tmp.*`) are left out."""

    _digests: dict[tuple, str | None] = {}

    def __init__(self, roots: list[Path] | None = None):
        self.roots = list(gate_caches().values()) if roots is None else roots
        self.state = self._scan()
        self.digests = {path: self._digest(path, key) for path, key in self.state.items()}

    def _scan(self) -> dict[Path, tuple]:
        state = {}
        for root in self.roots:
            for directory, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if not d.startswith("tmp.")]
                for name in files:
                    path = Path(directory, name)
                    try:
                        st = path.lstat()
                    except OSError:
                        continue
                    state[path] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # see sandbox.tree_state
        return state

    def _digest(self, path: Path, key: tuple) -> str | None:
        if (path, key) not in self._digests:
            self._digests[(path, key)] = _sha256(path)
        return self._digests[(path, key)]

    def rewritten(self) -> list[Path]:
        now = self._scan()
        return [path for path, was in self.state.items()
                if (key := now.get(path)) is not None and key != was and self._digest(path, key) != self.digests[path]]

    def undo(self, paths: list[Path]) -> None:
        for path in paths:
            path.unlink(missing_ok=True)
