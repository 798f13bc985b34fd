"""One error path for the whole command line (issue 22): options checked before any work starts, every error a
user can cause as one plain-text line with exit code 2, Ctrl-C as one line with exit code 130. Each test here
failed before its fix."""

import shutil
import time

import pytest
from pydantic import BaseModel, ValidationError

from gates.cli import EXIT_INTERRUPTED, error_message, main
from gates.tasks.schema import load_tasks
from tests.gates.fixtures.helpers import CONTRACTS, write_contract

MARKUP = "[bold red]x[/]"  # rich would take it for markup: as a path, a directory `[bold red]x[` holding `]`


def error_line(capsys) -> str:
    """The one line a failed command printed on stderr."""
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_gate_refuses_an_out_that_is_a_file_before_running_any_gate(tmp_path, capsys):
    write_contract(tmp_path)
    out = tmp_path / "evidence"
    out.write_text("not a directory")
    started = time.monotonic()
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(out)]) == 2
    assert f"--out {out}: exists and is not a directory" in error_line(capsys)
    assert time.monotonic() - started < 10  # refused up front, not after the gates ran


def test_eval_refuses_a_report_path_that_is_a_file_before_loading(tmp_path, capsys):
    report = tmp_path / "report"
    report.write_text("")
    assert main(["eval", "--report", str(report)]) == 2
    assert f"--report {report}: exists and is not a directory" in error_line(capsys)


@pytest.mark.parametrize("target, message", [
    (lambda d: d, "is a directory, not a file"),
    (lambda d: (d / "file").write_text("") or d / "file" / "bench.json", "is not a directory"),
])
def test_bench_refuses_a_json_path_it_cannot_write_before_timing(tmp_path, capsys, target, message):
    assert main(["bench", "--contracts", str(CONTRACTS), "--json", str(target(tmp_path))]) == 2
    assert message in error_line(capsys)


@pytest.mark.parametrize("device, message", [("bogus", "--device bogus: Expected one of cpu, cuda"),
                                             ("cuda:7", "--device cuda:7: this machine has")])
def test_a_device_this_machine_lacks_is_one_line(tiny_ckpt, capsys, device, message):
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1", "--device", device]) == 2
    assert message in error_line(capsys)


def test_markup_in_a_path_prints_verbatim(tmp_path, capsys):
    weird = tmp_path / MARKUP
    weird.parent.mkdir()
    weird.write_text("")
    assert main(["gate", "--contracts", str(CONTRACTS), "--out", str(weird)]) == 2
    assert str(weird) in error_line(capsys)
    weird.unlink()
    weird.mkdir()
    assert main(["evidence", "verify", str(weird)]) == 1
    assert MARKUP in capsys.readouterr().out


def test_a_bundle_in_a_directory_named_like_markup_shows_verbatim(bundle_dir, tmp_path, capsys):
    weird = shutil.copytree(bundle_dir, tmp_path / MARKUP / "kda_decode" / "cpu")
    assert main(["evidence", "verify", str(weird)]) == 0
    assert MARKUP in capsys.readouterr().out
    assert main(["evidence", "show", str(weird)]) == 0
    assert MARKUP in capsys.readouterr().out.replace("\n", "")


def test_ctrl_c_is_one_line_and_exit_130(bundle_dir, monkeypatch, capsys):
    from gates.commands import evidence

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evidence, "verify_tree", interrupted)
    assert main(["evidence", "verify", str(bundle_dir)]) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_an_os_error_names_the_file_and_the_reason():
    assert error_message(PermissionError(13, "Permission denied", "/evidence/x")) == "/evidence/x: Permission denied"


# ------------------------------------------------------------------------------------------------------- YAML


def test_a_duplicate_key_in_a_contract_is_one_problem(tmp_path, capsys):
    path = write_contract(tmp_path)
    path.write_text(path.read_text() + "backend: triton\n")
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(tmp_path / "ev")]) == 2
    problems = [line for line in capsys.readouterr().err.splitlines() if "kda_decode.yaml" in line]
    assert len(problems) == 1 and "key 'backend' appears twice in one mapping at line" in problems[0], problems


def test_a_yaml_syntax_error_in_a_contract_is_one_problem(tmp_path, capsys):
    path = write_contract(tmp_path)
    path.write_text(path.read_text() + "shapes: {heads: [2, 4\n")
    assert main(["gate", "--contracts", str(tmp_path), "--out", str(tmp_path / "ev")]) == 2
    problems = [line for line in capsys.readouterr().err.splitlines() if "kda_decode.yaml" in line]
    assert len(problems) == 1 and "not valid YAML (" in problems[0], problems


@pytest.mark.parametrize("extra, message", [("name: again\n", "key 'name' appears twice"),
                                            ("ops: [a,\n", "not valid YAML (")])
def test_a_task_template_with_a_duplicate_key_or_a_syntax_error_is_one_problem(tmp_path, extra, message):
    from gates.core.sources import REPO_ROOT

    for suffix in (".yaml", ".md"):
        shutil.copy(REPO_ROOT / "agent_tasks" / f"moe_router{suffix}", tmp_path / f"moe_router{suffix}")
    (tmp_path / "moe_router.yaml").write_text((tmp_path / "moe_router.yaml").read_text() + extra)
    tasks, problems = load_tasks(tmp_path)
    assert tasks == {} and len(problems) == 1 and message in problems[0], problems


# --------------------------------------------------------------------------------------------------- ckpt make


def test_ckpt_make_refuses_a_directory_that_is_not_empty_unless_forced(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["ckpt", "make", "--out", str(out)]) == 2
    assert "not empty; --force writes" in error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["ckpt", "make", "--out", str(out), "--force"]) == 0
    assert (out / "config.json").is_file() and (out / "notes.txt").read_text() == "mine"


def test_ckpt_make_refuses_an_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.write_text("")
    assert main(["ckpt", "make", "--out", str(out)]) == 2
    assert "exists and is not a directory" in error_line(capsys)


def test_a_validation_error_is_one_line():
    class Options(BaseModel):
        trials: int
        runs: int

    with pytest.raises(ValidationError) as e:
        Options(trials="x", runs="y")
    assert error_message(e.value).count("\n") == 0 and "Options: trials:" in error_message(e.value)


@pytest.mark.parametrize("argv, name", [
    (lambda d: ["config", "show", "--config", str(d / "config.json")], "config.json"),
    (lambda d: ["eval", "--ckpt", str(d)], "config.json"),
    (lambda d: ["task", "list", "--root", str(d)], "agent_tasks/binary.yaml"),
])
def test_a_file_that_is_not_text_is_one_line_naming_it(tmp_path, capsys, argv, name):
    (tmp_path / "agent_tasks").mkdir()
    for path in (tmp_path / "config.json", tmp_path / "agent_tasks" / "binary.yaml"):
        path.write_bytes(b"{\xff\xfe")
    assert main(argv(tmp_path)) == 2
    assert f"{tmp_path / name}: not UTF-8 text (byte 0xff at offset 1)" in error_line(capsys)


def test_a_contract_that_is_not_text_is_one_problem_among_the_others(tmp_path, capsys):
    contracts = tmp_path / "contracts"
    shutil.copytree(CONTRACTS, contracts)
    (contracts / "linear.yaml").write_bytes(b"op: \xff")
    assert main(["contract", "check", "--root", str(tmp_path)]) != 0
    printed = capsys.readouterr()
    assert f"{contracts / 'linear.yaml'}: <file>: not UTF-8 text (byte 0xff at offset 4)" in printed.out + printed.err
    assert "1 problem(s); 1 contract(s) pass" in printed.err  # the other contract is still checked
