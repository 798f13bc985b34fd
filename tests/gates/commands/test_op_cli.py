"""`k3forge op list` / `op show`: every op is listed, and one op's pieces are found where the layout puts them."""

from __future__ import annotations

from gates.cli import main
from gates.commands.op import places
from model.kimi_k3.ops.registry import OPS


def test_list_names_every_op(capsys):
    assert main(["op", "list"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in OPS)


def test_show_finds_every_piece_of_kda_decode(capsys):
    p = places(OPS["kda_decode"])
    assert p.module == "model/kimi_k3/ops/kda_decode.py"
    assert p.contract == "contracts/kda_decode.yaml" and p.problem == "gates/problems/kda_decode.py"
    assert any(k.startswith("model/kimi_k3/specialized/kda_decode/") for k in p.kernels)
    assert "tests/specialized/test_kda_decode.py" in p.tests
    assert p.notes == ("model/kimi_k3/specialized/kda_decode/NOTES.md",)
    assert {"cpu", "sm_90"} <= set(p.verdicts)
    assert main(["op", "show", "kda_decode"]) == 0
    assert "kda_decode_standard" in capsys.readouterr().out


def test_an_op_without_kernels_says_so():
    p = places(OPS["rms_norm"])
    assert p.kernels == () and p.contract is None and p.verdicts == {}


def test_an_unknown_op_is_a_usage_error(capsys):
    assert main(["op", "show", "nope"]) == 2
    assert "no such op" in capsys.readouterr().err
