"""`k3forge gate` and `k3forge evidence`: exit codes, bundles, and what they print."""

import pytest

from gates.cli import main
from gates.evidence.bundle import load_bundle
from tests.gates.fixtures.helpers import write_contract

QUICK = ["--trials", "1", "--runs", "2", "--steps", "4"]


def test_gate_passes_on_cpu_and_evidence_verifies(gated, capsys):
    code, out = gated
    assert code == 0
    assert (out / "index.md").is_file() and (out / "index.json").is_file()
    assert main(["evidence", "verify", str(out)]) == 0
    assert "1 of 1 bundle(s) intact and fresh" in capsys.readouterr().out
    assert main(["evidence", "show", str(out / "kda_decode" / "cpu")]) == 0
    shown = capsys.readouterr().out
    assert "kda_decode" in shown and "PASSED" in shown and "needs a CUDA GPU" in shown and "intact and fresh" in shown


def test_render_says_which_bundles_it_rendered_and_refuses_a_tampered_one(bundle_dir, capsys):
    assert main(["evidence", "render", str(bundle_dir)]) == 0
    assert "reports rendered again" in capsys.readouterr().out
    (bundle_dir / "report.md").write_text("# all good")
    assert main(["evidence", "render", str(bundle_dir)]) == 1
    assert "report.md: modified after the bundle was written" in capsys.readouterr().out


def test_verify_fails_on_a_tampered_bundle(bundle_dir, capsys):
    (bundle_dir / "bundle.json").write_text((bundle_dir / "bundle.json").read_text().replace("PASSED", "PASSED "))
    assert main(["evidence", "verify", str(bundle_dir)]) == 1
    assert "bundle.json: modified after the bundle was written" in capsys.readouterr().out


def test_a_failing_candidate_exits_1(tmp_path):
    write_contract(tmp_path, implementation="tests.adversarial.candidates:mutates_input")
    out = tmp_path / "evidence"
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(out), *QUICK]) == 1
    bundle = load_bundle(out / "kda_decode" / "cpu")
    assert bundle.verdict.value == "FAILED_NUMERICS"
    assert "input proj changed" in (out / "kda_decode" / "cpu" / "report.md").read_text()


def test_an_unimportable_implementation_is_a_contract_error(tmp_path, capsys):
    write_contract(tmp_path, implementation="model.kimi_k3.specialized.missing:kda_decode")
    out = tmp_path / "evidence"
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(out), *QUICK]) == 2
    assert "implementation: cannot import model.kimi_k3.specialized.missing:kda_decode" in capsys.readouterr().err
    bundle = load_bundle(out / "kda_decode" / "cpu")
    assert [g.status.value for g in bundle.gates] == ["ERROR", "NOT_RUN", "NOT_RUN", "NOT_RUN", "NOT_RUN"]
    assert bundle.gates[2].reason == "the contracts gate ERROR"


@pytest.mark.parametrize("args, message", [
    (["--ops", "rope_fused"], "no valid contract for rope_fused"),
    (["--trials", "0"], "--trials: Input should be greater than or equal to 1"),
    (["--max-blocks", "2"], "max_blocks 2 is below min_blocks 3"),
])
def test_usage_errors_exit_2(tmp_path, capsys, args, message):
    write_contract(tmp_path)
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(tmp_path / "ev"), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_contract_exits_2_and_names_the_field(tmp_path, capsys):
    write_contract(tmp_path, batch={"min": 9, "max": 8})
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(tmp_path / "ev")]) == 2
    assert "kda_decode.yaml: batch: empty range: min 9 > max 8" in capsys.readouterr().err
    assert not (tmp_path / "ev").exists()


def test_show_refuses_a_directory_of_bundles(gated, capsys):
    _, out = gated
    assert main(["evidence", "show", str(out)]) == 2
    assert "not a bundle directory" in capsys.readouterr().err


def test_a_scratch_out_directory_still_finds_other_archs_evidence(tmp_path, monkeypatch):
    """kda_decode is validated on sm_90 by a bundle in the repository's evidence/: gating it on this CPU into a
    scratch directory must still find that bundle (where the contract says), not look for it in the scratch."""
    from gates.core import runner
    from gates.core.registry import registered
    from gates.core.sources import REPO_ROOT

    monkeypatch.setattr(runner, "registered", lambda: [g for g in registered() if g.name == "contracts"])
    outcome = runner.gate_all(REPO_ROOT / "contracts", tmp_path / "scratch", ["kda_decode"])
    assert outcome.contract_problems == []
    (_, bundle), = outcome.bundles
    assert [(g.gate, g.status.value) for g in bundle.gates] == [("contracts", "PASSED")]


def test_a_gate_on_a_device_its_contract_does_not_list_exits_2_before_anything_runs(tmp_path, capsys, monkeypatch):
    """The bundle would not verify, so no GPU time is spent on it: one line naming the contract and the devices."""
    from dataclasses import replace

    from gates.commands import gate
    from kernels.arch import known

    contracts = tmp_path / "contracts"
    contracts.mkdir()
    path = write_contract(contracts, hardware={"validated": [{"arch": "sm_90", "devices": ["NVIDIA H200"]}]})
    monkeypatch.setattr(gate, "detect", lambda: replace(known("sm_90"), device_name="NVIDIA H100 80GB HBM3"))
    assert main(["gate", "--contracts", str(contracts), "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert "hardware.validated lists NVIDIA H200 for sm_90, not NVIDIA H100 80GB HBM3" in err and path.name in err
    assert not (tmp_path / "ev").exists()
