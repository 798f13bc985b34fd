"""Evidence a reviewer can trust (issue 22): validated means passed, verify checks what it reads, signatures,
and writes that an interruption cannot break. Each test here failed before its fix."""

import json
import os
import shutil
import tempfile

import pytest

from gates.cli import main
from gates.core.contracts import validation_problems
from gates.core.sources import sha256_file
from gates.core.status import Status
from gates.evidence.bundle import covered_sources, load_bundle, repair_interrupted_write, write_bundle
from gates.evidence.report import render_reports, rerender
from gates.evidence.signing import KEY_FILE_VAR, KEY_VAR, SigningKeyError, signing_key
from gates.evidence.verify import verify_bundle
from gates.problems import load_problem
from kernels.contract import load_contract
from tests.gates.fixtures.helpers import CPU_EXAMPLE, CPU_EXAMPLE_CONTRACTS, REAL_BUNDLE, kda_contract, rejudged

KEY = "k3forge-test-key-" + "0123456789abcdef" * 2


def recompute_manifest(directory) -> None:
    """What an agent editing a bundle does next: make the manifest match the edited files."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"] = {name: sha256_file(directory / name) for name in manifest["files"]}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def edit_bundle_json(directory, edit) -> None:
    data = json.loads((directory / "bundle.json").read_text())
    edit(data)
    (directory / "bundle.json").write_text(json.dumps(data, indent=2))
    recompute_manifest(directory)


def with_statuses(bundle, **statuses):
    gates = [g.model_copy(update={"status": Status(statuses[g.gate])}) if g.gate in statuses else g
             for g in bundle.gates]
    return rejudged(bundle, gates)


# ------------------------------------------------------------------------------------- validated means passed


def failed_numerics(bundle):
    """The bundle with its numerics gate failed the way the gate records it: a check that did not pass."""
    numerics = next(g for g in bundle.gates if g.gate == "numerics")
    checks = [{**c, "passed": False, "failures": 1} if c["check"] == "tolerance" else c
              for c in numerics.details["checks"]]
    failed = numerics.model_copy(update={"status": Status.FAILED_NUMERICS, "reason": "tolerance 1e-12",
                                         "details": {**numerics.details, "checks": checks}})
    gates = [failed if g.gate == "numerics" else g for g in bundle.gates]
    return rejudged(bundle, gates)


def test_verify_reports_the_verdict_and_fails_a_bundle_that_did_not_pass(bundle_dir, capsys):
    bundle = failed_numerics(load_bundle(bundle_dir))
    write_bundle(bundle_dir, bundle, render_reports(bundle))
    assert verify_bundle(bundle_dir) == []  # intact, fresh, consistent: it records a failure faithfully
    assert main(["evidence", "verify", str(bundle_dir)]) == 1
    assert "its verdict is FAILED_NUMERICS" in capsys.readouterr().out
    assert main(["evidence", "verify", "--allow-failed", str(bundle_dir)]) == 0
    assert "verdict FAILED_NUMERICS" in capsys.readouterr().out


def test_a_verdict_says_what_was_not_judged(gated, bundle_dir, capsys):
    """NOT_RUN is never PASSED: a bundle whose required evals did not run is reported as not judged (no failure to
    refuse); one where they passed is PASSED, naming the gates not required on its arch."""
    _, out = gated
    assert main(["evidence", "verify", str(out)]) == 0
    assert "verdict NOT_RUN (not judged here: evals)" in capsys.readouterr().out
    bundle = with_statuses(load_bundle(bundle_dir), evals="PASSED")
    write_bundle(bundle_dir, bundle, render_reports(bundle))
    assert main(["evidence", "verify", str(bundle_dir)]) == 0
    assert "verdict PASSED (not required on cpu: compile, benchmarks)" in capsys.readouterr().out


def test_validation_needs_every_gate_that_applies_on_the_arch_to_pass(bundle_dir):
    """The fixture contract (torch backend) on cpu: compile and benchmarks cannot apply there; contracts,
    numerics and evals must pass, and a NOT_RUN evals validates nothing."""
    contract, bundle = kda_contract(), load_bundle(bundle_dir)
    assert validation_problems(bundle, contract, "cpu") == [
        "the evals gate NOT_RUN: the eval model never entered this kernel's envelope"]
    assert validation_problems(with_statuses(bundle, evals="PASSED"), contract, "cpu") == []
    assert validation_problems(failed_numerics(with_statuses(bundle, evals="PASSED")), contract, "cpu") == [
        "the numerics gate FAILED_NUMERICS: tolerance 1e-12"]


def test_a_cpu_bundle_never_validates_a_gpu_arch(bundle_dir):
    assert validation_problems(load_bundle(bundle_dir), kda_contract(), "sm_90") == [
        "holds kda_decode on cpu, not kda_decode on sm_90"]


@pytest.fixture
def attn_res_root(tmp_path):
    """A repository root whose attn_res contract validates cpu (the CPU example), with a copy of the example's
    gated cpu bundle whose covered sources are recomputed for that root (the contract there, the rest in this
    checkout)."""
    contract_path = tmp_path / "contracts" / "attn_res.yaml"
    contract_path.parent.mkdir()
    shutil.copy(CPU_EXAMPLE, contract_path)
    contract = load_contract(contract_path)
    bundle = load_bundle(CPU_EXAMPLE_CONTRACTS).model_copy(update={
        "sources": covered_sources(contract, contract_path, load_problem("attn_res").source, tmp_path)})

    def write(**statuses):
        changed = with_statuses(bundle, **statuses)
        write_bundle(tmp_path / "evidence" / "attn_res" / "cpu", changed, render_reports(changed))
        return tmp_path
    return write


def test_contract_check_accepts_a_validated_arch_whose_bundle_passed(attn_res_root, capsys):
    assert main(["contract", "check", "--root", str(attn_res_root())]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("statuses, problem", [
    ({"evals": "NOT_RUN"}, "cpu is validated, but its bundle did not pass: the evals gate NOT_RUN"),
    ({"contracts": "ERROR"}, "cpu is validated, but its bundle did not pass: the contracts gate ERROR"),
])
def test_contract_check_refuses_a_validated_arch_whose_bundle_did_not_pass(attn_res_root, capsys, statuses, problem):
    assert main(["contract", "check", "--root", str(attn_res_root(**statuses))]) == 2
    assert problem in capsys.readouterr().err


# ------------------------------------------------------------------------------- verify checks what it reads


def test_verify_on_a_directory_without_bundles_fails_and_says_so(tmp_path, capsys):
    assert main(["evidence", "verify", str(tmp_path)]) == 1
    assert "no evidence bundles under" in capsys.readouterr().out


@pytest.mark.parametrize("tamper, expected", [
    (lambda d: (d / "manifest.json").write_text('{"files": 5}'), "manifest.json: not a manifest"),
    (lambda d: (d / "manifest.json").write_text("[1, 2"), "manifest.json: not a manifest"),
    (lambda d: (d / "manifest.json").write_text('{"files": {"bundle.json": "not a digest"}}'), "not a manifest"),
    (lambda d: _list(d, "../../../etc/hostname"), "lists '../../../etc/hostname', which is not the name of a file"),
    (lambda d: _list(d, "/etc/hostname"), "lists '/etc/hostname', which is not the name of a file"),
    (lambda d: _replace_with_link(d, "bundle.json"), "bundle.json: a symbolic link, not a file of the bundle"),
    (lambda d: _replace_with_link(d, "manifest.json"), "manifest.json: a symbolic link, not a file of the bundle"),
    (lambda d: (d / "extra").mkdir(), "extra: not in the manifest"),
])
def test_verify_reads_only_regular_files_inside_the_bundle(bundle_dir, capsys, tamper, expected):
    tamper(bundle_dir)
    assert any(expected in p for p in verify_bundle(bundle_dir)), verify_bundle(bundle_dir)
    assert main(["evidence", "verify", str(bundle_dir)]) == 1  # a problem reported, never a traceback
    assert expected in capsys.readouterr().out


def _list(directory, name: str) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][name] = "0" * 64
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _replace_with_link(directory, name: str) -> None:
    """The file moved out of the bundle, a link to it left in its place (the same bytes: only the link tells)."""
    outside = directory.parent.parent / f"outside-{name}"
    (directory / name).rename(outside)
    (directory / name).symlink_to(outside)


def test_a_bundle_directory_that_is_a_link_is_refused(bundle_dir):
    link = bundle_dir.parent / "linked"
    link.symlink_to(bundle_dir)
    assert verify_bundle(link) == [f"{link}: a symbolic link; a bundle is a directory of regular files"]


@pytest.fixture
def gpu_like_dir(gpu_like_bundle, tmp_path):
    """The synthetic H200 bundle written out, with a PASSED benchmarks gate (every point over 1.0×)."""
    bench = next(g for g in gpu_like_bundle.gates if g.gate == "benchmarks")
    rows = [{**r, "required_speedup": 1.0} for r in bench.details["rows"]]
    passed = bench.model_copy(update={"status": Status.PASSED, "reason": "",
                                      "details": {**bench.details, "rows": rows, "required_speedup": 1.0}})
    gates = [passed if g.gate == "benchmarks" else g for g in gpu_like_bundle.gates]
    bundle = rejudged(gpu_like_bundle, gates)
    directory = tmp_path / "kda_decode" / "sm_90"
    write_bundle(directory, bundle, render_reports(bundle))
    assert verify_bundle(directory) == []
    return directory


def _bench_row(data: dict) -> dict:
    return next(g for g in data["gates"] if g["gate"] == "benchmarks")["details"]["rows"][0]


def _scale_speedup(data: dict, factor: float) -> None:
    """Every statistic of the speedup scaled together (mean, blocks, interval): only the medians disagree."""
    row = _bench_row(data)
    row["speedup"] *= factor
    row["block_speedups"] = [s * factor for s in row["block_speedups"]]
    row["speedup_ci"] = [v * factor for v in row["speedup_ci"]]


@pytest.mark.parametrize("edit, expected", [
    (lambda data: _bench_row(data).update(speedup=float("nan")), "NaN is not a number a bundle may hold"),
    (lambda data: _bench_row(data).update(speedup=float("inf")), "Infinity is not a number a bundle may hold"),
    (lambda data: _scale_speedup(data, 3.0), "is far from the"),
    (lambda data: _bench_row(data).update(speedup_ci=[0.1, 0.2]), "does not contain the speedup"),
    (lambda data: _bench_row(data).update(block_speedups=[9.0]), "blocks, but 1 block speedups"),
    (lambda data: _bench_row(data).update(required_speedup=5.0), "is under the required 5×, yet the gate PASSED"),
    (lambda data: _bench_row(data).update(standard_alone_us=_bench_row(data)["standard"]["median_us"] / 2),
     "the standard took 2.00× its time alone beside the candidate (the gate's bound 1.25×), yet the gate PASSED"),
    (lambda data: next(g for g in data["gates"] if g["gate"] == "numerics")["details"]["rows"][0].update(
        close_fraction=1.5), "close_fraction: Input should be less than or equal to 1"),
])
def test_verify_checks_the_numbers_against_each_other(gpu_like_dir, edit, expected):
    edit_bundle_json(gpu_like_dir, edit)
    problems = verify_bundle(gpu_like_dir)
    assert any(expected in p for p in problems), problems


def _made_on(device: str):
    return lambda data: data["environment"].update(device_name=device)


@pytest.mark.parametrize("device, problems", [
    ("NVIDIA H200", []),
    ("NVIDIA H100 80GB HBM3", ["made on NVIDIA H100 80GB HBM3 but the contract lists NVIDIA H200 for sm_90 under "
                               "hardware.validated"]),
])
def test_a_gpu_bundle_from_a_device_its_contract_does_not_validate_is_refused(tmp_path, device, problems):
    """The KDA kernel's committed H200 bundle, otherwise intact, claiming an H100 made it: the same arch, another
    memory, and the contract validates sm_90 on the H200 alone."""
    directory = shutil.copytree(REAL_BUNDLE.parent, tmp_path / "kda_decode" / "sm_90")
    edit_bundle_json(directory, _made_on(device))
    assert verify_bundle(directory) == [f"{directory / 'bundle.json'}: {p}" for p in problems]


def test_a_bundle_of_an_arch_its_contract_only_declares_names_no_device(gpu_like_dir):
    """The fixture contract declares sm_90 (NVIDIA H200) and validates nothing: no device is claimed there."""
    edit_bundle_json(gpu_like_dir, _made_on("NVIDIA H100 80GB HBM3"))
    assert verify_bundle(gpu_like_dir) == []


def test_evidence_show_of_a_bundle_json_that_is_not_json_is_one_line(bundle_dir, capsys):
    (bundle_dir / "bundle.json").write_text("{")
    assert main(["evidence", "show", str(bundle_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bundle.json: not a bundle" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------------- signatures


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_VAR, KEY)
    return KEY.encode()


def test_a_signed_bundle_verifies_and_a_recomputed_manifest_does_not(bundle_dir, key, capsys):
    bundle = load_bundle(bundle_dir)
    write_bundle(bundle_dir, bundle, render_reports(bundle), key)
    assert (bundle_dir / "signature.json").is_file()
    assert verify_bundle(bundle_dir, key=key, require_signature=True) == []
    assert main(["evidence", "verify", "--require-signature", str(bundle_dir)]) == 0
    capsys.readouterr()
    edit_bundle_json(bundle_dir, lambda data: data.update(command="k3forge gate --seed 1"))
    assert verify_bundle(bundle_dir) == []  # without the key, a recomputed manifest looks intact
    (problem,) = verify_bundle(bundle_dir, key=key)
    assert "signature.json: does not match the manifest under this key" in problem
    assert main(["evidence", "verify", str(bundle_dir)]) == 1
    assert "does not match the manifest" in capsys.readouterr().out


def test_require_signature_rejects_an_unsigned_bundle_and_needs_a_key(bundle_dir, monkeypatch, capsys):
    monkeypatch.delenv(KEY_VAR, raising=False)
    monkeypatch.delenv(KEY_FILE_VAR, raising=False)
    assert main(["evidence", "verify", "--require-signature", str(bundle_dir)]) == 2
    assert "--require-signature: no key" in capsys.readouterr().err
    monkeypatch.setenv(KEY_VAR, KEY)
    assert main(["evidence", "verify", "--require-signature", str(bundle_dir)]) == 1
    assert "signature.json: missing: the bundle is not signed" in capsys.readouterr().out


def test_another_key_does_not_verify(bundle_dir, key):
    bundle = load_bundle(bundle_dir)
    write_bundle(bundle_dir, bundle, render_reports(bundle), key)
    (problem,) = verify_bundle(bundle_dir, key=b"x" * 32)
    assert "does not match the manifest under this key" in problem


def test_the_key_comes_from_one_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_VAR, raising=False)
    monkeypatch.delenv(KEY_FILE_VAR, raising=False)
    assert signing_key() is None
    (tmp_path / "key").write_text(KEY + "\n")
    monkeypatch.setenv(KEY_FILE_VAR, str(tmp_path / "key"))
    assert signing_key() == KEY.encode()
    monkeypatch.setenv(KEY_VAR, KEY)
    with pytest.raises(SigningKeyError, match="both"):
        signing_key()
    monkeypatch.delenv(KEY_FILE_VAR)
    monkeypatch.setenv(KEY_VAR, "short")
    with pytest.raises(SigningKeyError, match="5 bytes; it needs at least 32"):
        signing_key()


def test_rendering_a_signed_bundle_again_needs_its_key_and_keeps_it_signed(bundle_dir, key, monkeypatch):
    bundle = load_bundle(bundle_dir)
    write_bundle(bundle_dir, bundle, render_reports(bundle), key)
    (problem,) = rerender(bundle_dir)
    assert "the bundle is signed" in problem
    assert rerender(bundle_dir, key) == []
    assert verify_bundle(bundle_dir, key=key, require_signature=True) == []


def test_the_gate_signs_what_it_writes(tmp_path, monkeypatch, key):
    from gates.core import runner
    from gates.core.registry import registered

    monkeypatch.setattr(runner, "registered", lambda: [g for g in registered() if g.name == "contracts"])
    outcome = runner.gate_all(CPU_EXAMPLE_CONTRACTS, tmp_path / "scratch", ["attn_res"], key=key)
    ((directory, _),) = outcome.bundles
    assert verify_bundle(directory, key=key, require_signature=True) == []


# ------------------------------------------------------------------------------------- crash-safe bundle writes


def snapshot(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.is_dir() else {}


STEPS = ((os, "replace"), (os, "chmod"), (os, "fsync"), (shutil, "rmtree"), (tempfile, "mkdtemp"))


def test_an_interrupted_write_leaves_the_old_or_the_new_bundle_at_every_step(bundle_dir, monkeypatch):
    """Ctrl-C at the k-th filesystem step of a write, for every k: the bundle is the old one or the new one,
    whole; the next write leaves nothing of the interrupted one behind."""
    old_bundle = load_bundle(bundle_dir)
    new_bundle = old_bundle.model_copy(update={"command": "k3forge gate --ops kda_decode"})
    old, reports = snapshot(bundle_dir), render_reports(new_bundle)
    scratch = bundle_dir.parent.parent / "scratch" / "cpu"
    new = snapshot(write_bundle(scratch, new_bundle, reports))
    shutil.rmtree(scratch.parent)
    originals = {(owner, name): getattr(owner, name) for owner, name in STEPS}
    k = 0
    while True:
        k += 1
        calls = 0

        def step(original):
            def interrupted(*args, **kwargs):
                nonlocal calls
                calls += 1
                if calls == k:
                    raise KeyboardInterrupt
                return original(*args, **kwargs)
            return interrupted

        for (owner, name), original in originals.items():
            monkeypatch.setattr(owner, name, step(original))
        try:
            write_bundle(bundle_dir, new_bundle, reports)
            finished = True
        except KeyboardInterrupt:
            finished = False
        finally:
            for (owner, name), original in originals.items():
                monkeypatch.setattr(owner, name, original)
        assert snapshot(bundle_dir) in (old, new), f"interrupted at step {k}"
        if finished:
            break
        write_bundle(bundle_dir, old_bundle, render_reports(old_bundle))  # the next write, from the old bundle
        assert snapshot(bundle_dir) == old and [p.name for p in bundle_dir.parent.iterdir()] == ["cpu"]
    assert k > 10  # every file's sync, both renames and the cleanup were each interrupted once


def test_a_write_killed_between_its_two_renames_is_repaired_by_the_next(bundle_dir):
    """kill -9 runs no handler: the previous bundle sits aside, the new one staged, nothing in place."""
    before = snapshot(bundle_dir)
    aside = bundle_dir.parent / ".cpu.old-killed"
    aside.mkdir()
    os.replace(bundle_dir, aside / "bundle")
    (bundle_dir.parent / ".cpu.tmp-killed").mkdir()
    repair_interrupted_write(bundle_dir)
    assert snapshot(bundle_dir) == before and [p.name for p in bundle_dir.parent.iterdir()] == ["cpu"]
