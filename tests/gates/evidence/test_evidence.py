"""Bundles: written atomically, verified for integrity (manifest) and freshness (covered sources)."""

import json

import pytest

from gates.core.sources import sha256_file
from gates.evidence.bundle import load_bundle, write_bundle
from gates.evidence.index import write_index
from gates.evidence.report import render_reports, rerender
from gates.evidence.verify import find_bundles, verify_bundle, verify_tree


def test_gated_bundle_is_intact_and_fresh(gated):
    code, out = gated
    assert code == 0
    (directory,) = find_bundles(out)
    assert sorted(p.name for p in directory.iterdir()) == ["bundle.json", "manifest.json", "report.html", "report.md"]
    assert verify_bundle(directory) == []
    manifest = json.loads((directory / "manifest.json").read_text())
    assert set(manifest["files"]) == {"bundle.json", "report.html", "report.md"}


def test_bundle_records_what_and_where(gated):
    _, out = gated
    bundle = load_bundle(out / "kda_decode" / "cpu")
    assert bundle.schema_version == 3 and bundle.op == "kda_decode" and bundle.arch == "cpu"
    assert bundle.options.seed == 7 and bundle.options.seed_given
    assert bundle.environment.torch and bundle.environment.gpu_count == 0
    assert [(g.gate, g.status.value) for g in bundle.gates] == [
        ("contracts", "PASSED"), ("compile", "NOT_RUN"), ("numerics", "PASSED"), ("benchmarks", "NOT_RUN"),
        ("evals", "NOT_RUN")]
    roles = {r for s in bundle.sources for r in s.roles}
    assert {"contract", "problem", "implementation", "reference", "standard"} <= roles


@pytest.mark.parametrize("tamper, expected", [
    (lambda d: (d / "report.html").write_text("<p>all good</p>"), "report.html: modified after the bundle was written"),
    (lambda d: (d / "report.md").unlink(), "report.md: listed in the manifest but missing"),
    (lambda d: (d / "notes.txt").write_text("x"), "notes.txt: not in the manifest"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing"),
])
def test_integrity(bundle_dir, tamper, expected):
    tamper(bundle_dir)
    problems = verify_bundle(bundle_dir)
    assert any(expected in p for p in problems), problems


def test_a_forged_verdict_does_not_load(bundle_dir):
    """Rewriting the verdict (and the manifest to match) still fails: the verdict must follow the gates."""
    path = bundle_dir / "bundle.json"
    data = json.loads(path.read_text())
    data["gates"][2]["status"] = "FAILED_NUMERICS"
    path.write_text(json.dumps(data))
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["files"]["bundle.json"] = sha256_file(path)
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    (problem,) = verify_bundle(bundle_dir)
    assert ("does not follow the bundle schema (<root>: Value error, verdict NOT_RUN does not follow from the gates' "
            "statuses (FAILED_NUMERICS)") in problem


def test_freshness_names_the_stale_file(bundle_dir, tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("def kda_decode(): ...\n")
    bundle = load_bundle(bundle_dir)
    entry = bundle.sources[0].model_copy(update={"path": str(source), "roles": ["implementation"],
                                                 "sha256": sha256_file(source)})
    bundle = bundle.model_copy(update={"sources": [entry, *bundle.sources[1:]]})
    write_bundle(bundle_dir, bundle, render_reports(bundle))
    assert verify_bundle(bundle_dir) == []
    source.write_text("def kda_decode(): return 0\n")
    (problem,) = verify_bundle(bundle_dir)
    assert f"stale: {source} (implementation) changed since the evidence was made" in problem
    source.unlink()
    assert "no longer exists" in verify_bundle(bundle_dir)[0]


def test_a_failed_write_leaves_the_old_bundle(bundle_dir):
    before = {p.name: p.read_bytes() for p in bundle_dir.iterdir()}
    with pytest.raises(TypeError):
        write_bundle(bundle_dir, load_bundle(bundle_dir), {"report.md": None})  # rendering produced no text
    assert {p.name: p.read_bytes() for p in bundle_dir.iterdir()} == before
    assert [p.name for p in bundle_dir.parent.iterdir()] == ["cpu"]  # no temporary directory left behind


def test_rewrite_replaces_the_bundle(bundle_dir):
    bundle = load_bundle(bundle_dir)
    write_bundle(bundle_dir, bundle.model_copy(update={"command": "again"}), render_reports(bundle))
    assert load_bundle(bundle_dir).command == "again" and verify_bundle(bundle_dir) == []
    assert [p.name for p in bundle_dir.parent.iterdir()] == ["cpu"]


def test_tree_and_index_skip_unfinished_writes(bundle_dir):
    evidence = bundle_dir.parent.parent
    (bundle_dir.parent / ".cpu.tmp-x").mkdir()
    (bundle_dir.parent / ".cpu.tmp-x" / "bundle.json").write_text("{")
    assert list(verify_tree(evidence)) == [bundle_dir]
    (row,) = write_index(evidence)
    assert row["op"] == "kda_decode" and row["verdict"] == "NOT_RUN" and row["report"] == "kda_decode/cpu/report.html"
    assert "| kda_decode | cpu | **NOT_RUN** |" in (evidence / "index.md").read_text()


def test_a_runner_names_the_commit_of_its_copy(monkeypatch):
    """The GPU runner's copy has someone else's repository (or none): the commit it declares is recorded."""
    from gates.evidence.bundle import git_state

    monkeypatch.setenv("K3FORGE_COMMIT", "d98eea86e5c32548524dc9ef59d11de82b599a90")
    assert git_state().model_dump() == {"commit": "d98eea86e5c32548524dc9ef59d11de82b599a90", "branch": None,
                                        "dirty": None}
    monkeypatch.delenv("K3FORGE_COMMIT")
    assert git_state().commit and git_state().dirty is not None  # this checkout's own state


def test_a_bundle_judged_by_other_gate_code_is_noted_not_distrusted(bundle_dir):
    from gates.core.sources import harness_digest
    from gates.evidence.verify import judged_by_other_gate_code

    assert load_bundle(bundle_dir).harness == harness_digest()
    assert judged_by_other_gate_code(bundle_dir, harness_digest()) is None
    assert "differs from this tree's" in judged_by_other_gate_code(bundle_dir, "0" * 64)  # the gate code changed
    assert verify_bundle(bundle_dir) == []


def test_reports_render_again_from_the_bundle_and_nothing_else_changes(bundle_dir):
    """New templates can be applied to old evidence: the reports come back from bundle.json, byte for byte the
    bundle.json stays, and the manifest matches again."""
    judged = (bundle_dir / "bundle.json").read_bytes()
    report = (bundle_dir / "report.html").read_text()
    (bundle_dir / "report.html").write_text(report.replace("PASSED", "FAILED"))
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["files"]["report.html"] = sha256_file(bundle_dir / "report.html")
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))  # a report edited by hand, manifest to match
    assert rerender(bundle_dir) == []
    assert (bundle_dir / "report.html").read_text() == report and (bundle_dir / "bundle.json").read_bytes() == judged
    assert verify_bundle(bundle_dir) == []


@pytest.mark.parametrize("tamper, expected", [
    (lambda d: (d / "bundle.json").write_text((d / "bundle.json").read_text().replace('"PASSED"', '"ERROR"', 1)),
     "bundle.json: modified after the bundle was written"),
    (lambda d: _rewrite_with_manifest(d, json.dumps(json.loads((d / "bundle.json").read_text()))),
     "would not write it back unchanged"),
])
def test_a_bundle_that_is_not_intact_is_not_rendered_again(bundle_dir, tamper, expected):
    tamper(bundle_dir)
    before = {p.name: p.read_bytes() for p in bundle_dir.iterdir()}
    (problem,) = rerender(bundle_dir)
    assert expected in problem
    assert {p.name: p.read_bytes() for p in bundle_dir.iterdir()} == before


def _rewrite_with_manifest(directory, bundle_text: str) -> None:
    """bundle.json rewritten (same content, other formatting) with a manifest that matches it."""
    (directory / "bundle.json").write_text(bundle_text)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["bundle.json"] = sha256_file(directory / "bundle.json")
    (directory / "manifest.json").write_text(json.dumps(manifest))

