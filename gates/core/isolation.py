"""The candidate's process walled in by the OS, where Linux lets it be: the tree and the Python installation
read-only, the signing key's file hidden, and no capability left to undo either.

Candidate code runs as the gate's user. Without this, a candidate's process can write anything that user can:
patch a library the standard imports (FLA's kernels in site-packages) or plant a startup hook (a `.pth` file,
`sitecustomize`), so that every later process (the standard timed alone, the production replay, the next
sandbox's worker before it fingerprints itself) runs its code; as root, read the key file or another process's
memory. The sandbox's watch finds writes to the tree and the compile caches after the fact; this stops writes to
the tree and the installation before they happen, and the rest of what only the OS can stop.

This file is a launcher as well as a module, and imports nothing but the standard library: the gate starts every
process that runs candidate code as `python isolation.py <the process's own command line>` with the plan
(`plan`) in the environment. The launcher, a fresh single-threaded process (a mount namespace is a thread's, so
no thread may exist yet that keeps the old view), confines itself (`confine`) and then executes the real
command line, which keeps the confinement: mount namespaces and the capability bounding set survive exec, and
`no_new_privs` makes a setuid program gain nothing. The real process reads what was done (or why not) from
`OUTCOME_VAR`.

Confining takes a mount namespace of its own, which needs CAP_SYS_ADMIN (root), or an unprivileged user
namespace where the kernel allows them. Where neither is possible the process runs unconfined, says why, and
the sandbox's watch is the only wall.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

PLAN_VAR = "K3FORGE_CONFINE"  # the plan, JSON; the launcher takes it out of the environment
OUTCOME_VAR = "K3FORGE_CONFINED"  # what the launcher did, or why it did not, for the process to report
LAUNCHER = Path(__file__).resolve()

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000  # linux/sched.h
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8  # linux/mount.h
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
# a bind mount's flags that a remount must repeat (statvfs's ST_* bit -> MS_* bit): in a user namespace the
# kernel refuses a remount that would clear one of them
KEPT_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4  # linux/prctl.h
CAPABILITY_VERSION_3 = 0x20080522  # linux/capability.h


def _outermost(places: set[Path], writable: list[Path]) -> list[Path]:
    """The directories among `places` that hold none of `writable` (nor the temporary folders) and lie inside no
    other of them."""
    must_write = [Path(p).resolve() for p in (tempfile.gettempdir(), "/dev/shm", *writable)]
    places = {p for p in places if p.is_dir() and p != Path("/")
              and not any(w == p or w.is_relative_to(p) for w in must_write)}
    return sorted(p for p in places if not any(q != p and p.is_relative_to(q) for q in places))


def import_paths() -> set[Path]:
    return {Path(p).resolve() for p in sys.path if p}


def installation() -> set[Path]:
    """The Python installation: its prefixes (the interpreter too) and every import path."""
    return {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)} | import_paths()


def plan(repo_root: Path, writable: list[Path], hidden: list[Path], gate_places: list[Path] = ()) -> dict:
    """What to confine: the tree and the Python installation read-only, except any place that holds a directory
    the process must write (`writable`: the home directory, its own copies of the compile caches; the temporary
    folders always); the gate's own folders (`gate_places`: its request folders, its compile caches) read-only
    too; and the files in `hidden` covered by an empty one."""
    places = _outermost({repo_root.resolve(), *installation()}, writable)
    gates = [g for g in _outermost({Path(g).resolve() for g in gate_places}, writable)
             if not any(g.is_relative_to(p) for p in places)]
    return {"read_only": [str(p) for p in places], "gate_places": [str(g) for g in gates],
            "hidden": [str(p) for p in hidden if p.is_file()]}


def unguarded_installation(repo_root: Path, writable: list[Path]) -> list[Path]:
    """The installation's places a watch must guard where the child is not confined: its import paths (what
    every later process imports and runs at startup; a whole prefix such as /usr is too many files to walk),
    less the tree's own (its guard's), but with an environment hidden inside the tree (the tree's guard leaves
    hidden folders out)."""
    repo_root = repo_root.resolve()
    places = {p for p in import_paths() if not (p == repo_root or repo_root.is_relative_to(p))}
    return _outermost(places, writable)


def command(argv: list[str], confinement: dict) -> tuple[list[str], dict[str, str]]:
    """`argv` (a Python command line, `argv[0]` the interpreter) run under the launcher, and the environment
    entry that carries the plan."""
    return [argv[0], str(LAUNCHER), *argv], {PLAN_VAR: json.dumps(confinement)}


def available(confinement: dict | None = None) -> str:
    """What confining does on this machine: the account a trial process under the launcher gives, confined as
    `confinement` says (default: nothing read-only, nothing hidden)."""
    import subprocess

    argv, env = command([sys.executable, "-c", f"import os; print(os.environ[{OUTCOME_VAR!r}])"],
                        confinement or {"read_only": [], "hidden": []})
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or f"not confined: the trial process failed ({done.stderr.strip()[-200:]})"


class _NotConfined(Exception):
    pass


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _call(what: str, result: int) -> None:
    if result != 0:
        raise _NotConfined(f"{what}: {os.strerror(ctypes.get_errno())}")


def _own_mount_namespace(libc) -> str:
    """Enter a mount namespace of this process's own: directly with CAP_SYS_ADMIN, else inside a new user
    namespace (the same uid and gid mapped, so files keep their owners)."""
    if libc.unshare(CLONE_NEWNS) == 0:
        return "a mount namespace"
    uid, gid = os.getuid(), os.getgid()
    _call("unshare (no CAP_SYS_ADMIN, and no unprivileged user namespace)", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    return "a user and mount namespace"


def _read_only(libc, path: str) -> None:
    _call(f"bind {path}", libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None))
    kept = sum(ms for st, ms in KEPT_FLAGS.items() if os.statvfs(path).f_flag & st)
    _call(f"remount {path} read-only",
          libc.mount(None, path.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None))


def _drop_capabilities(libc) -> None:
    """No capability now or after any exec: the mounts cannot be undone, other processes' memory not read."""
    _call("no_new_privs", libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        _call(f"drop capability {cap} from the bounding set", libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0))
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # fails only where there are no ambient sets
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable for capabilities 0-31 and 32-63: none
    _call("capset", libc.capset(header, data))


def confine(confinement: dict) -> str:
    """Confine this (single-threaded) process as `confinement` says; one line saying what was done, or why not."""
    if not sys.platform.startswith("linux"):
        return "not confined: no Linux namespaces on this platform"
    if (threads := len(os.listdir("/proc/self/task"))) != 1:
        return f"not confined: {threads} threads already run (a mount namespace is a thread's)"
    try:
        libc = _libc()
        how = _own_mount_namespace(libc)
        _call("make mounts private", libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None))
        for path in confinement["read_only"] + confinement.get("gate_places", []):
            _read_only(libc, path)
        for path in confinement["hidden"]:
            _call(f"hide {path}", libc.mount(b"/dev/null", path.encode(), None, MS_BIND, None))
        _drop_capabilities(libc)
    except (_NotConfined, OSError, AttributeError) as e:
        return f"not confined: {e}"
    shown = ", ".join(confinement["read_only"]) or "nothing"
    gates = (f"; {len(confinement['gate_places'])} of the gate's own folders read-only"
             if confinement.get("gate_places") else "")
    hidden = f"; {len(confinement['hidden'])} key file(s) hidden" if confinement["hidden"] else ""
    return f"confined in {how}: read-only {shown}{gates}{hidden}; no capabilities"


def main() -> None:
    """The launcher: confine by the plan in the environment, then become the command line that follows."""
    confinement = json.loads(os.environ.pop(PLAN_VAR, '{"read_only": [], "hidden": []}'))
    os.environ[OUTCOME_VAR] = confine(confinement)
    argv = sys.argv[1:]
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
