"""The compile caches split by trust: the gate's processes keep the machine's, a process that runs candidate code
works in a private copy of them, and a confined one sees the gate's read-only."""

import json
import os
from pathlib import Path

import pytest

from gates.core import caches, isolation, sandbox
from gates.core.sandbox import Sandbox
from kernels.cute import CACHE_ENV

needs_confinement = pytest.mark.skipif(not isolation.available().startswith("confined"),
                                       reason="this machine allows no mount namespace: no OS wall to test")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """Every cache where its library puts it by default, under a home and a temporary folder of the test's."""
    for var in caches.CACHES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TRITON_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    (tmp_path / "tmp").mkdir()
    return tmp_path / "home"


def test_each_cache_lies_where_its_variable_says_or_where_its_library_puts_it(home, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(CACHE_ENV, "off")
    where = caches.gate_caches()
    user = caches._user()
    assert where == {
        "TRITON_CACHE_DIR": tmp_path / "triton",
        "HUMMING_CACHE_DIR": home / ".humming" / "cache",
        "HUMMING_TMP_DIR": home / ".humming" / "tmp",
        "CUTE_DSL_CACHE_DIR": tmp_path / "tmp" / user / "cutlass_python_cache",
        "CUDA_CACHE_PATH": home / ".nv" / "ComputeCache",
        "TORCHINDUCTOR_CACHE_DIR": tmp_path / "tmp" / f"torchinductor_{user}",
    }  # kernels.cute's is off: none
    assert all(path.is_dir() for path in where.values())  # made before any child: no candidate makes one first
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cute"))
    assert caches.gate_caches()[CACHE_ENV] == tmp_path / "cute"


def test_a_candidates_copy_holds_the_gates_entries_and_keeps_its_own(tmp_path, monkeypatch):
    """Made once and topped up with what the gate compiled since; what the candidate wrote in its copy stays there
    and never reaches the gate's. Triton's temporary folders and special files are not copied; links stay links."""
    gate = tmp_path / "triton"
    (gate / "A").mkdir(parents=True)
    (gate / "A" / "k.cubin").write_bytes(b"gate's")
    (gate / "tmp.123").mkdir()
    (gate / "tmp.123" / "half.cubin").write_bytes(b"being written")
    os.mkfifo(gate / "A" / "fifo")
    (gate / "A" / "link.json").symlink_to(gate / "A" / "k.cubin")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(gate))
    copy = Path(caches.candidate_env()["TRITON_CACHE_DIR"])
    assert copy.is_relative_to(caches.private_root()) and copy != gate
    assert (copy / "A" / "k.cubin").read_bytes() == b"gate's"
    assert (copy / "A" / "link.json").is_symlink() and not (copy / "A" / "fifo").exists()
    assert not (copy / "tmp.123").exists()
    (copy / "A" / "k.cubin").write_bytes(b"candidate's")
    (gate / "B").mkdir()
    (gate / "B" / "new.cubin").write_bytes(b"compiled by the gate since")
    assert Path(caches.candidate_env()["TRITON_CACHE_DIR"]) == copy
    assert (copy / "B" / "new.cubin").read_bytes() == b"compiled by the gate since"
    assert (copy / "A" / "k.cubin").read_bytes() == b"candidate's"  # its own entry kept
    assert (gate / "A" / "k.cubin").read_bytes() == b"gate's"


def test_a_cache_that_holds_the_candidates_copies_is_not_copied_into_them(monkeypatch):
    """TRITON_CACHE_DIR set to the temporary folder itself: its copy would hold itself, so it starts empty."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(caches.private_root().parent))
    copy = Path(caches.candidate_env()["TRITON_CACHE_DIR"])
    assert copy.is_dir() and list(copy.iterdir()) == []


def _children_see(tmp_path, monkeypatch, runs_candidate: bool, tried: list[Path] = ()) -> dict:
    gate = tmp_path / "triton"
    gate.mkdir(exist_ok=True)
    report = tmp_path / f"report-{runs_candidate}.json"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(gate))
    monkeypatch.setenv("K3FORGE_TEST_TRY", os.pathsep.join(str(p) for p in [gate, *tried]))
    monkeypatch.setenv("K3FORGE_TEST_REPORT", str(report))
    with Sandbox(runs_candidate=runs_candidate) as box:
        assert box.request("probe", entries=["tests.gates.core.tries_to_write:anything"])["errors"] == {}
    return json.loads(report.read_text())


def test_a_candidates_process_works_in_its_copies_and_the_standards_in_the_gates(tmp_path, monkeypatch):
    candidate = _children_see(tmp_path, monkeypatch, runs_candidate=True)
    private = caches.private_root()
    assert all(Path(path).is_relative_to(private) for path in candidate["env"].values() if path), candidate
    assert candidate["own"] == "done"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")  # the gate's own variables never moved
    standard = _children_see(tmp_path, monkeypatch, runs_candidate=False)
    assert standard["env"]["TRITON_CACHE_DIR"] == str(tmp_path / "triton") and standard["own"] == "done"


@needs_confinement
def test_a_confined_candidate_cannot_write_the_gates_caches(tmp_path, monkeypatch):
    seen = _children_see(tmp_path, monkeypatch, runs_candidate=True)
    assert seen["own"] == "done" and seen["tried"][str(tmp_path / "triton")] == "Read-only file system"
    assert not (tmp_path / "triton" / "planted").exists()
    assert str((tmp_path / "triton").resolve()) in sandbox.confinement()["gate_places"]


@needs_confinement
def test_no_child_can_put_a_request_in_place_of_another_childs(tmp_path, monkeypatch):
    """A child loads its requests as the gate's (a pickle): the request folders, the standard's sandbox's among them,
    are read-only to every child, so a candidate's process cannot run its code in another child that way."""
    with Sandbox(runs_candidate=False) as standard:
        seen = _children_see(tmp_path, monkeypatch, runs_candidate=True, tried=[standard._inbox])
        assert seen["tried"][str(standard._inbox)] == "Read-only file system"
        assert list(standard._inbox.iterdir()) == []


def test_each_op_gated_starts_from_fresh_copies(tmp_path, monkeypatch):
    """What one op's candidate wrote into its copy (an entry under another op's kernel's key) is gone when the next
    op's candidate starts: the copies are made again from the gate's."""
    gate = tmp_path / "triton"
    (gate / "A").mkdir(parents=True)
    (gate / "A" / "k.cubin").write_bytes(b"gate's")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(gate))
    with caches.copies_of_its_own():
        copy = Path(caches.candidate_env()["TRITON_CACHE_DIR"])
        (copy / "A" / "k.cubin").write_bytes(b"op one's candidate's")
        (copy / "B").mkdir()
        (copy / "B" / "next_ops_kernel.cubin").write_bytes(b"planted")
    assert not copy.exists()
    with caches.copies_of_its_own():
        copy = Path(caches.candidate_env()["TRITON_CACHE_DIR"])
        assert (copy / "A" / "k.cubin").read_bytes() == b"gate's"
        assert not (copy / "B").exists()
    assert (gate / "A" / "k.cubin").read_bytes() == b"gate's" and not (gate / "B").exists()
