"""The decode bundle from bench records: made, verified, refused when the records disagree, stale when a source
the runs loaded changes, broken when a file is edited."""

from __future__ import annotations

import html
import json
import shutil

import pytest

from gates.cli import main
from gates.evidence import decode
from gates.evidence.verify import verify_bundle


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("records")
    common = ["--preset", "tiny", "--device", "cpu", "--tp", "1", "--context", "3", "--batch", "1"]
    assert main(["bench", "layer", *common, "--kind", "mla", "--layers", "1", "--json", str(out / "l.json")]) == 0
    assert main(["bench", "step", *common, "--kda-sets", "1", "--mla-sets", "1", "--json", str(out / "s.json")]) == 0
    return [out / "l.json", out / "s.json"]


def test_a_bundle_from_records_is_intact_and_fresh(records, tmp_path):
    assert main(["evidence", "decode", *map(str, records), "--out", str(tmp_path / "b")]) == 0
    b = decode.load(tmp_path / "b")
    assert {r["kind"] for r in b.layers} == {"mla"} and len(b.steps) == 2
    assert "model/kimi_k3/bench/run.py" in b.sources and "contracts/kda_decode.yaml" in b.sources
    assert verify_bundle(tmp_path / "b") == []
    assert "K3 decode on cpu" in (tmp_path / "b" / "report.md").read_text()


def test_records_of_two_commits_make_no_bundle(records, tmp_path):
    other = tmp_path / "other.json"
    rec = json.loads(records[0].read_text())
    rec["environment"]["commit"] = "0" * 40
    other.write_text(json.dumps(rec))
    with pytest.raises(decode.DecodeError, match="environment.commit"):
        decode.from_records([records[1], other])


def test_a_record_says_whether_the_measured_tree_was_its_commit(records, tmp_path, monkeypatch):
    """The bench records the checkout as a gate does: a runner's K3FORGE_COMMIT names the commit (its copy of the
    tree may carry another commit's history, so dirty is unknown); a tree that differs from HEAD is said so."""
    from model.kimi_k3.bench.cli import run_environment

    monkeypatch.setenv("K3FORGE_COMMIT", "d98eea86e5c32548524dc9ef59d11de82b599a90")
    env = run_environment()
    assert env["commit"] == "d98eea86e5c32548524dc9ef59d11de82b599a90" and env["dirty"] is None
    rec = json.loads(records[0].read_text())
    assert set(rec["environment"]) >= {"commit", "dirty"}
    rec["environment"]["dirty"] = True
    (tmp_path / "dirty.json").write_text(json.dumps(rec))
    bundle = decode.from_records([tmp_path / "dirty.json"])
    decode.write(bundle, tmp_path / "b")
    assert "the measured tree differed from it" in (tmp_path / "b" / "report.md").read_text()


def test_rows_of_the_declared_backend_are_never_evidence(records, tmp_path):
    """`bench --backend declared` times kernels no gate validated on the arch: a record holding such rows makes no
    bundle, and the error says which backend and what to run instead."""
    other = tmp_path / "declared.json"
    rec = json.loads(records[0].read_text())
    rec["rows"] = [{**rec["rows"][0], "backend": "declared"}]
    other.write_text(json.dumps(rec))
    with pytest.raises(decode.DecodeError, match=r"declared.json: rows of backend 'declared'.*--backend both"):
        decode.from_records([records[1], other])


def test_an_edited_report_or_a_changed_source_is_caught(records, tmp_path):
    bundle = decode.from_records(records)
    decode.write(bundle, tmp_path / "b")
    shutil.copytree(tmp_path / "b", tmp_path / "edited")
    (tmp_path / "edited" / "report.md").write_text("all fast\n")
    assert any("modified" in p for p in verify_bundle(tmp_path / "edited"))
    bundle.sources["model/kimi_k3/bench/run.py"] = "0" * 64
    decode.write(bundle, tmp_path / "stale")
    assert any("stale: model/kimi_k3/bench/run.py" in p for p in verify_bundle(tmp_path / "stale"))


def test_a_contract_added_since_the_measurements_is_staleness(records, tmp_path):
    """The specialized path runs every contract validated on the arch: a contract the runs never read (simulated by
    one missing from the recorded sources) could change what they ran, so the bundle is stale and says which."""
    bundle = decode.from_records(records)
    del bundle.sources["contracts/linear.yaml"]
    decode.write(bundle, tmp_path / "b")
    assert [p.split(": ", 1)[1] for p in verify_bundle(tmp_path / "b")] == [
        "stale: contracts/linear.yaml is a contract added since the measurements were made"]


def test_a_change_to_the_gate_tooling_is_a_note_not_staleness(records, tmp_path):
    """The CLI, gate and evidence code under gates/ launched the benches but cannot change what ran: a change there
    leaves the bundle fresh with a note naming it; a change anywhere in the measured path makes it stale."""
    bundle = decode.from_records(records)
    tooling = next(p for p in bundle.sources if p.startswith(decode.TOOLING))
    assert decode.tooling_note(bundle) is None
    bundle.sources[tooling] = "0" * 64
    decode.write(bundle, tmp_path / "b")
    assert verify_bundle(tmp_path / "b") == []
    assert tooling in decode.tooling_note(decode.load(tmp_path / "b"))
    bundle.sources["kernels/timing.py"] = "0" * 64
    decode.write(bundle, tmp_path / "stale")
    assert [p.split(": ", 1)[1] for p in verify_bundle(tmp_path / "stale")] == [
        "stale: kernels/timing.py changed since the measurements were made"]


def test_rows_with_and_without_collectives_are_two_series(records):
    """`bench layer --collectives` records a row with the all-reduces and one without at the same batch and
    backend: the plot keeps both."""
    bundle = decode.from_records(records)
    row = {**bundle.layers[0], "us": 10.0, "floor_us": 5.0}  # CPU records carry no times
    bundle.layers = [row, {**row, "collectives": "nccl", "us": 20.0}]
    (chart,) = [v for k, v in decode._plots(bundle).items() if k.startswith("layer")]
    label = decode.BACKEND_LABEL.get(row["backend"], row["backend"])
    assert f"{label} + collectives" in chart and chart.count(label) >= 2


def test_the_report_names_the_bandwidth_of_the_floors_and_renders_older_bundles(records, tmp_path):
    """Rows record the bandwidth their floors are at (measured on the device, or declared off a GPU); the report
    says it above each table. Bundles made before the rows recorded it still render, saying the floors were at
    the arch's declared figure."""
    bundle = decode.from_records(records)
    decode.write(bundle, tmp_path / "new")
    sentence = "Floors at 4.30 TB/s (copy bandwidth declared for sm_90 (NVIDIA H200); no GPU measured it)."
    for report in ("report.md", "report.html"):
        assert (tmp_path / "new" / report).read_text().count(sentence) == 2  # the MLA layer's table, the step's
    measured = {"floor_bandwidth_Bps": 2.98e12, "floor_bandwidth_source": "measured on NVIDIA H100 80GB HBM3"}
    assert decode.floors([{**row, **measured} for row in bundle.steps]) == (
        "Floors at 2.98 TB/s (copy bandwidth measured on NVIDIA H100 80GB HBM3).")
    for row in (*bundle.layers, *bundle.steps):
        del row["floor_bandwidth_Bps"], row["floor_bandwidth_source"]
    decode.write(bundle, tmp_path / "old")
    assert verify_bundle(tmp_path / "old") == []
    for report in ("report.md", "report.html"):
        assert "Floors at the arch's declared copy bandwidth (not recorded in these rows)." in html.unescape(
            (tmp_path / "old" / report).read_text())


def test_each_step_row_shows_its_own_weight_sets(records, tmp_path):
    """`bench step` builds fewer sets where the device cannot hold the asked ones, so rows of one bundle may differ:
    each row's sets are in its own table line."""
    bundle = decode.from_records(records)
    bundle.steps[1] = {**bundle.steps[1], "batch": 64, "weight_sets": {"dense": 1, "kda": 3, "mla": 2}}
    decode.write(bundle, tmp_path / "b")
    for report in ("report.md", "report.html"):
        text = (tmp_path / "b" / report).read_text()
        assert "1 dense, 1 kda, 1 mla" in text and "1 dense, 3 kda, 2 mla" in text


def test_the_report_has_a_per_block_table_with_both_backends_and_renders_older_bundles(records, tmp_path):
    """Layer rows carry a per-block breakdown: the report sets each block's standard and specialized µs side by side
    with the speedup, bytes and floor. Rows recorded before the breakdown (older bundles) render without it."""
    bundle = decode.from_records(records)
    auto, spec = (r for r in bundle.layers if r["backend"] in ("auto", "latency_specialized"))
    for r, us in ((auto, 30.0), (spec, 12.0)):
        r["blocks"] = {name: {**b, "us": us, "kernels": 4.0} for name, b in r["blocks"].items()}
    (table,) = decode.block_tables(bundle.layers)
    assert table["title"] == "TP1, batch 1" and [b["block"] for b in table["blocks"]] == ["attn_res", "attention",
                                                                                          "moe"]
    assert all(b["speedup"] == pytest.approx(2.5) and b["bytes"] > 0 for b in table["blocks"])
    assert not table["piped"] and all(b["piped_speedup"] is None for b in table["blocks"])
    decode.write(bundle, tmp_path / "new")
    for report in ("report.md", "report.html"):
        text = (tmp_path / "new" / report).read_text()
        assert "Per block: " in text and text.count("2.50×") == 3 and "n-pipeline specialized" not in text
    for r, us in ((auto, 40.0), (spec, 25.0)):  # the MoE also timed alone in-pipeline
        r["blocks"]["moe"]["us_in_pipeline"] = us
    (table,) = decode.block_tables(bundle.layers)
    moe = table["blocks"][-1]
    assert table["piped"] and moe["piped_speedup"] == pytest.approx(1.6) and table["blocks"][0]["piped_speedup"] is None
    decode.write(bundle, tmp_path / "piped")
    for report in ("report.md", "report.html"):
        text = (tmp_path / "piped" / report).read_text()
        assert "1.60×" in text and text.count("2.50×") == 3
    for row in bundle.layers:
        del row["blocks"]
    assert decode.block_tables(bundle.layers) == []
    decode.write(bundle, tmp_path / "old")
    assert verify_bundle(tmp_path / "old") == []
    assert "Per block: " not in (tmp_path / "old" / "report.md").read_text()
