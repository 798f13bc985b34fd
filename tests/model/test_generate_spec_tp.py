"""`k3forge generate` with --tp and --spec-tokens (CPU, tiny checkpoint, fp32)."""

from __future__ import annotations

import json

import pytest

from gates.cli import main
from model.kimi_k3.errors import EXIT_OK, EXIT_USAGE

MAX_NEW = 8


def generate(capsys, ckpt, *extra: str) -> dict:
    argv = ["generate", "--ckpt", str(ckpt), "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", str(MAX_NEW),
            "--dtype", "fp32", "--device", "cpu", "--json", *extra]
    assert main(argv) == EXIT_OK
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_speculative_and_tensor_parallel_generation_match_plain(capsys, tiny_ckpt):
    plain = generate(capsys, tiny_ckpt)
    assert "accepted_per_step" not in plain
    spec = generate(capsys, tiny_ckpt, "--spec-tokens", "3", "--drafter", "synthetic:2")
    assert spec["tokens"] == plain["tokens"]
    assert spec["accepted_per_step"] == [2] * -(-(MAX_NEW - 1) // 3)
    tp2 = generate(capsys, tiny_ckpt, "--tp", "2", "--spec-tokens", "2")  # ngram drafter by default
    assert tp2["tokens"] == plain["tokens"] and len(tp2["accepted_per_step"]) >= 1


@pytest.mark.parametrize("extra, message", [
    (["--drafter", "ngram"], "only used with --spec-tokens"),
    (["--spec-tokens", "3", "--drafter", "synthetic:4"], "needs A <= --spec-tokens"),
    (["--spec-tokens", "3", "--drafter", "synthetic:2", "--temperature", "1"], "--temperature 0"),
    (["--spec-tokens", "3", "--drafter", "eagle"], "expected ngram or synthetic:A"),
    (["--tp", "0"], "--tp: must be >= 1"),
    (["--tp", "3"], "not divisible by TP size 3"),
])
def test_bad_options_are_usage_errors(capsys, tiny_ckpt, extra, message):
    argv = ["generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1,2", "--device", "cpu", *extra]
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err.replace("\n", "")
