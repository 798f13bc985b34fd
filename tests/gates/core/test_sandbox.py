"""The sandbox's side of a misbehaving candidate: a hang is an error that says where the candidate was stuck; the
tree kept as it was; the gate's secrets out of the child's reach."""

import ctypes
import os
import sys
import time

import pytest

from gates.core.caches import CacheGuard
from gates.core.sandbox import Sandbox, SandboxError, TreeGuard
from gates.evidence.signing import KEY_VAR

PR_GET_DUMPABLE = 3  # linux/prctl.h


def test_a_hung_candidate_is_reported_with_its_stack():
    with Sandbox() as box:
        assert box.request("probe", entries=["model.kimi_k3.ops.kda:kda_decode"])  # started: torch imported
        with pytest.raises(SandboxError) as err:
            box.request("probe", entries=["tests.adversarial.hangs:anything"], timeout_s=5)
    message = str(err.value)
    assert message.startswith("probe: no reply from the candidate's process within 5 s; it was at:")
    assert "hangs.py" in message and "_wait_forever" in message


def test_the_tree_guard_undoes_every_write(tmp_path):
    """A changed file gets its bytes and modification time back, an added one goes, a removed one returns; prose
    outside evidence/ is not guarded (people edit it while a gate runs)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "judge.py").write_text("STRICT = True\n")
    (tmp_path / "pkg" / "problem.py").write_text("TOLERANCE = 1e-3\n")
    guard = TreeGuard(tmp_path)
    (tmp_path / "pkg" / "judge.py").write_text("STRICT = False  # longer\n")
    (tmp_path / "pkg" / "problem.py").unlink()
    (tmp_path / "pkg" / "planted.py").write_text("x = 1\n")
    (tmp_path / "NOTES.md").write_text("prose\n")
    assert sorted(guard.writes()) == ["pkg/judge.py (changed)", "pkg/planted.py (added)", "pkg/problem.py (removed)"]
    guard.restore()
    assert guard.writes() == []
    assert (tmp_path / "pkg" / "judge.py").read_text() == "STRICT = True\n"
    assert (tmp_path / "pkg" / "problem.py").read_text() == "TOLERANCE = 1e-3\n"
    assert not (tmp_path / "pkg" / "planted.py").exists() and (tmp_path / "NOTES.md").exists()


def test_requests_travel_as_files_that_do_not_outlive_their_reply(tmp_path):
    """A request is written to the sandbox's own folder and mapped by the child; its file is gone once the reply is
    in, the folder once the sandbox closes. Where the file cannot be written, the pipe carries the request."""
    with Sandbox() as box:
        inbox = box._inbox
        assert box.request("probe", entries=["model.kimi_k3.ops.kda:kda_decode"])
        assert inbox.is_dir() and list(inbox.iterdir()) == []
        box._inbox = tmp_path / "gone"  # torch.save cannot write there: the request goes down the pipe
        assert box.request("probe", entries=["model.kimi_k3.ops.kda:kda_decode"])
        box._inbox = inbox
    assert not inbox.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_gates_process_is_undumpable_once_a_sandbox_starts(monkeypatch):
    """Its memory holds the seed (and, to sign, the key): no other process of the user may read it. The key stays
    in the gate's environment for the signing while the child starts without it."""
    monkeypatch.setenv(KEY_VAR, "k")
    with Sandbox() as box:
        assert box.request("probe", entries=["model.kimi_k3.ops.kda:kda_decode"])
        assert ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
    assert os.environ[KEY_VAR] == "k"


def test_the_cache_guard_reports_only_entries_whose_bytes_changed(tmp_path):
    """Compiling adds entries, two processes compiling one kernel replace one with the same bytes, and a removed
    entry is compiled again: none of these is a rewrite. Changed bytes are, in place or by a replacing file."""
    (tmp_path / "a").mkdir()
    kept, same, gone, in_place, replaced = (tmp_path / "a" / name for name in ("kept", "same", "gone", "in_place",
                                                                                "replaced"))
    for path in (kept, same, gone, in_place, replaced):
        path.write_bytes(path.name.encode())
    guard = CacheGuard(roots=[tmp_path])
    (tmp_path / "a" / "new").write_bytes(b"a kernel compiled now")
    (tmp_path / "staged").write_bytes(same.read_bytes())
    os.replace(tmp_path / "staged", same)
    gone.unlink()
    with open(in_place, "r+b") as f:
        f.write(b"X")
    (tmp_path / "staged").write_bytes(b"a slower kernel")
    os.replace(tmp_path / "staged", replaced)
    assert sorted(guard.rewritten()) == [in_place, replaced]
    guard.undo(guard.rewritten())
    assert not in_place.exists() and not replaced.exists() and kept.exists() and same.exists()


def test_a_rewrite_of_the_same_size_with_its_time_set_back_is_found(tmp_path):
    """A candidate that edits a judge's file in place (1e-3 -> 1e-1) and restores its modification time."""
    judge = tmp_path / "problem.py"
    judge.write_text("TOLERANCE = 1e-3\n")
    mtime = judge.stat().st_mtime_ns
    guard = TreeGuard(tmp_path)
    time.sleep(0.01)
    judge.write_text("TOLERANCE = 1e-1\n")
    os.utime(judge, ns=(mtime, mtime))
    assert guard.writes() == ["problem.py (changed)"]
    guard.restore()
    assert guard.writes() == [] and judge.read_text() == "TOLERANCE = 1e-3\n"
