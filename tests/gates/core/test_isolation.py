"""The OS wall around candidate code: the tree and the Python installation read-only, the key file hidden, no
capability left to undo either, and an honest account where the machine allows none of it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gates.core import isolation
from gates.core.sandbox import confinement
from gates.core.sources import REPO_ROOT

# Run under the launcher: says what it was told, then tries what a candidate's process would.
PROBE = """
import json, os, subprocess, sys, tempfile
from pathlib import Path
out = {"confined": os.environ.get("K3FORGE_CONFINED")}
def attempt(name, action):
    try:
        action()
        out[name] = "done"
    except OSError as e:
        out[name] = e.strerror
repo, site, key = sys.argv[1:4]
attempt("write_tree", lambda: Path(repo, "gates", "_planted.py").write_text("x = 1"))
attempt("write_installation", lambda: Path(site, "_planted.pth").write_text("import os"))
attempt("write_tmp", lambda: tempfile.NamedTemporaryFile(dir=tempfile.gettempdir()).close())
out["key"] = Path(key).read_text() if key != "-" else None
out["capabilities"] = [line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                       if line.startswith(("CapEff", "CapPrm", "CapBnd"))]
remount = subprocess.run(["mount", "-o", "remount,rw,bind", repo], capture_output=True)
out["remount"] = remount.returncode
nested = subprocess.run(["unshare", "-Urm", "mount", "-o", "remount,rw,bind", repo], capture_output=True)
out["nested_remount"] = nested.returncode
print(json.dumps(out))
"""


def site_packages() -> Path:
    return Path(next(p for p in sys.path if p.endswith("-packages") and Path(p).is_dir()))


@pytest.fixture(autouse=True)
def nothing_planted():
    yield
    (REPO_ROOT / "gates" / "_planted.py").unlink(missing_ok=True)
    (site_packages() / "_planted.pth").unlink(missing_ok=True)


def probe(plan: dict, key: Path | None = None) -> dict:
    argv, env = isolation.command([sys.executable, "-c", PROBE, str(REPO_ROOT), str(site_packages()),
                                   str(key) if key else "-"], plan)
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


needs_confinement = pytest.mark.skipif(
    not isolation.available().startswith("confined"),
    reason="this machine allows no mount namespace (no CAP_SYS_ADMIN and no unprivileged user namespaces): the "
           "sandbox's watch is the only wall")


def test_the_plan_guards_the_tree_and_the_installation_but_not_what_must_be_written(tmp_path):
    writable = tmp_path / "cache"
    writable.mkdir()
    key = tmp_path / "key"
    key.write_text("secret")
    plan = isolation.plan(REPO_ROOT, writable=[writable], hidden=[key, tmp_path / "absent"])
    read_only = [Path(p) for p in plan["read_only"]]
    assert REPO_ROOT.resolve() in read_only
    assert any(site_packages().resolve().is_relative_to(p) for p in read_only)
    # nothing that holds a directory the process must write, and no place inside another
    assert not any(writable.resolve().is_relative_to(p) for p in read_only)
    assert not any(p != q and p.is_relative_to(q) for p in read_only for q in read_only)
    assert plan["hidden"] == [str(key)]


@needs_confinement
def test_a_confined_process_cannot_write_the_tree_or_the_installation_nor_undo_its_walls(tmp_path):
    key = tmp_path / "key"
    key.write_text("the evidence key")
    out = probe(isolation.plan(REPO_ROOT, writable=[], hidden=[key]), key)
    assert out["confined"].startswith("confined in") and "1 key file(s) hidden" in out["confined"]
    assert out["write_tree"] == out["write_installation"] == "Read-only file system"
    assert out["write_tmp"] == "done" and out["key"] == ""
    assert out["capabilities"] == ["0000000000000000"] * 3
    assert out["remount"] != 0 and out["nested_remount"] != 0  # the read-only mounts are locked in a new namespace
    assert not (REPO_ROOT / "gates" / "_planted.py").exists()


def test_a_process_with_threads_is_not_confined_and_says_why():
    """A mount namespace is a thread's: a thread started before it would keep the old view."""
    code = ("import threading, time; threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); "
            "from gates.core.isolation import confine; print(confine({'read_only': [], 'hidden': []}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "not confined: 2 threads already run (a mount namespace is a thread's)"


@needs_confinement
def test_a_sandboxs_child_is_confined():
    from gates.core.sandbox import Sandbox

    with Sandbox() as box:
        box.request("probe", entries=["model.kimi_k3.ops.kda:kda_decode"])
    assert box.confined.startswith("confined in") and str(REPO_ROOT.resolve()) in box.confined
    assert set(confinement()["read_only"]) <= set(box.confined.split("read-only ")[1].split(";")[0].split(", "))


def test_where_unconfined_the_watch_guards_the_installation_and_leaves_the_tree_to_the_trees_guard():
    places = isolation.unguarded_installation(REPO_ROOT, [])
    assert REPO_ROOT.resolve() not in places
    assert any(site_packages().resolve().is_relative_to(p) for p in places)  # a virtual environment in the tree too
