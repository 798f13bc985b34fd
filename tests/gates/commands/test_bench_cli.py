"""`k3forge bench` (what `make bench` runs): the benchmark gate alone, no evidence written."""

import json
import re

from rich.console import Console

from gates.cli import main
from gates.commands.bench import _table
from tests.gates.conftest import synthetic_benchmarks
from tests.gates.fixtures.helpers import CONTRACTS


def test_on_cpu_every_op_says_why_it_was_not_timed(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--contracts", str(CONTRACTS), "--json", str(out)]) == 2  # nothing was measured
    shown = capsys.readouterr().out
    assert "kda_decode: NOT_RUN: needs a CUDA GPU; this machine has none" in shown and "nothing was timed" in shown
    assert json.loads(out.read_text())["kda_decode"]["status"] == "NOT_RUN"
    assert not (tmp_path / "evidence").exists()
    assert re.search(r"^\s+\d+\.\d s  kda_decode · benchmarks$", shown, re.M)  # no terminal: timed lines


def test_each_op_is_shown_as_soon_as_it_is_timed(capsys):
    assert main(["bench", "--ops", "attn_res,kda_decode"]) == 2
    shown = capsys.readouterr().out
    assert shown.index("attn_res: NOT_RUN") < shown.index(" kda_decode · benchmarks") < shown.index("kda_decode: NOT")


def test_unknown_op_is_a_usage_error(capsys):
    assert main(["bench", "--contracts", str(CONTRACTS), "--ops", "flash_mla"]) == 2
    assert "--ops: no valid contract for flash_mla" in capsys.readouterr().err


def test_table_shows_speedups_with_their_intervals():
    console = Console(record=True, width=200)
    console.print(_table("kda_decode", synthetic_benchmarks(required=1.5)))
    text = console.export_text()
    row = next(line for line in text.splitlines() if line.startswith("│ batch 64 · heads 6"))
    cells = [c.strip() for c in row.split("│")]
    assert re.fullmatch(r"\d\.\d\d× \[\d\.\d\d, \d\.\d\d\]", cells[4]) and cells[5:7] == ["3", "1.5×"]
    assert text.lstrip().startswith("kda_decode: SLOWER")  # the 6-head batch-64 point is under 1.5×
    assert any(line.startswith("│ batch 17 · heads 12 · head_dim 128 · bf16 (drawn)") for line in text.splitlines())
