"""The `k3forge` command: config, ckpt and generate as a user types them."""

import json

import pytest

from gates.cli import main
from tests.gates.fixtures.helpers import CPU_EXAMPLE


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys, tiny_ckpt):
    code, out, _ = run(capsys, "generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                       "--dtype", "fp32", "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4 and len(result["logprobs"]) == 4
    assert all(0 <= t < 512 for t in result["tokens"]) and all(lp <= 0 for lp in result["logprobs"])


def test_generate_with_an_fp8_mla_cache(capsys, tiny_ckpt):
    code, out, _ = run(capsys, "generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                       "--dtype", "fp32", "--kv-cache-dtype", "fp8", "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4 and result["dispatch"]["ops"]["mla_decode_fp8"]["standard"] > 0


def test_generate_same_seed_same_tokens(capsys, tiny_ckpt):
    args = ("generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "7,8", "--max-new-tokens", "6", "--temperature", "1",
            "--seed", "3", "--json")
    first = run(capsys, *args)[1]
    assert run(capsys, *args)[1] == first


@pytest.mark.parametrize("argv,message", [
    (("--prompt-ids", "1,x"), "--prompt-ids: '1,x' is not a comma-separated list"),
    (("--prompt-ids", "1", "--top-p", "0"), "--top-p in (0, 1]"),
    (("--prompt-ids", "1,100000"), "outside the vocabulary"),
])
def test_generate_usage_errors(capsys, tiny_ckpt, argv, message):
    code, _, err = run(capsys, "generate", "--ckpt", str(tiny_ckpt), *argv)
    assert code == 2 and message in err


def test_generate_contracts_usage_errors(capsys, tiny_ckpt, tmp_path):
    """--contracts: only with latency_specialized, a directory, whose contracts load (named by file and field)."""
    base = ("generate", "--ckpt", str(tiny_ckpt), "--prompt-ids", "1")
    code, _, err = run(capsys, *base, "--contracts", str(tmp_path))
    assert code == 2 and "--contracts: only used with --decode-backend latency_specialized" in err
    code, _, err = run(capsys, *base, "--decode-backend", "latency_specialized", "--contracts", str(tmp_path / "no"))
    assert code == 2 and f"--contracts {tmp_path / 'no'}: no such contracts directory" in err
    (tmp_path / "attn_res.yaml").write_text(CPU_EXAMPLE.read_text().replace("backend: torch", "backend: tpu"))
    code, _, err = run(capsys, *base, "--decode-backend", "latency_specialized", "--contracts", str(tmp_path))
    assert code == 2 and f"--contracts {tmp_path}: {tmp_path / 'attn_res.yaml'}: backend: " in err


def test_generate_missing_checkpoint(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--ckpt", str(tmp_path / "nope"), "--prompt-ids", "1")
    assert code == 2 and "not a checkpoint directory" in err


def test_ckpt_make_then_config_show(capsys, tmp_path):
    code, out, _ = run(capsys, "ckpt", "make", "--preset", "tiny", "--out", str(tmp_path / "c"), "--seed", "4")
    assert code == 0 and (tmp_path / "c" / "config.json").exists()
    code, out, _ = run(capsys, "config", "show", "--config", str(tmp_path / "c"), "--tp", "2", "--json")
    info = json.loads(out)
    assert info["mla_layer_ids"] == [3, 7] and info["weights"]["layers.0.self_attn.A_log"]["shape"] == [2]


def test_ckpt_make_refuses_the_full_k3(capsys, tmp_path):
    code, _, err = run(capsys, "ckpt", "make", "--preset", "k3", "--out", str(tmp_path / "k3"))
    assert code == 2 and "GB" in err and not (tmp_path / "k3").exists()


def test_config_show_bad_tp(capsys):
    code, _, err = run(capsys, "config", "show", "--preset", "k3", "--tp", "5")
    assert code == 2 and "linear_attn_config.num_heads: 96 is not divisible by TP size 5" in err
