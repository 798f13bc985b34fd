"""The byte-level BPE tokenizer saved with random checkpoints: exact vocabulary, special ids from the config,
byte-exact round trips, the same file from every build, and clear errors for a tokenizer that does not fit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from model.kimi_k3.config import ConfigError, preset
from model.kimi_k3.tokenizer import (
    BOS,
    EOS,
    PAD,
    TOKENIZER_FILE,
    _byte_chars,
    build_tokenizer,
    load_tokenizer,
    token_bytes,
)
from model.kimi_k3.weights import CheckpointError

TEXT = '{"name": "Zoë", "items": [1, 2.5, null], "ok": true}\n\t\\u00e9 ✓'


@pytest.mark.parametrize("name", ["tiny", "k3"])
def test_special_ids_and_round_trip(name):
    cfg = preset(name)
    tok = build_tokenizer(cfg)
    ids = tok.get_vocab(with_added_tokens=True)
    assert len(ids) == 512 and max(ids.values()) < cfg.vocab_size
    assert (ids[BOS], ids[EOS], ids[PAD]) == (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    encoded = tok.encode(TEXT).ids
    assert tok.decode(encoded) == TEXT and len(encoded) < len(TEXT.encode())  # merges compress JSON
    raw, special = token_bytes(tok, cfg.vocab_size)
    assert b"".join(raw[i] for i in encoded) == TEXT.encode()
    assert special == sorted([cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id])
    assert sum(1 for b in raw if b) == 512  # every other id of a larger vocabulary stays unused


def test_tiny_fills_its_vocabulary_exactly():
    ids = sorted(build_tokenizer(preset("tiny")).get_vocab(with_added_tokens=True).values())
    assert ids == list(range(512))


def test_byte_table_is_the_byte_level_alphabet():
    assert sorted(_byte_chars()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_byte_chars().values()) == list(range(256))


def test_same_tokenizer_in_a_fresh_process():
    """Training is deterministic across processes (hash seeds differ), so a checkpoint's tokenizer is reproducible."""
    code = "from model.kimi_k3.config import preset; from model.kimi_k3.tokenizer import build_tokenizer; " \
           "print(build_tokenizer(preset('tiny')).to_str())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).parents[2]).stdout.strip()
    assert other == build_tokenizer(preset("tiny")).to_str()


def test_checkpoint_carries_its_tokenizer(tiny_ckpt, tiny_cfg):
    assert load_tokenizer(tiny_ckpt, tiny_cfg).to_str() == build_tokenizer(tiny_cfg).to_str()


def test_colliding_special_ids_are_refused():
    cfg = preset("tiny").model_copy(update={"eos_token_id": 1})
    with pytest.raises(ConfigError, match="collide"):
        build_tokenizer(cfg)


def test_bad_tokenizer_files_name_the_problem(tiny_ckpt, tiny_cfg, tmp_path):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    path = ckpt / TOKENIZER_FILE
    small = tiny_cfg.model_copy(update={"vocab_size": 256})
    with pytest.raises(CheckpointError, match=r"tokenizer.json: model.vocab: token ids \[256, .*vocab_size 256"):
        load_tokenizer(ckpt, small)
    body = json.loads(path.read_text())
    body["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    path.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="decoder: 'Metaspace', expected a byte-level BPE"):
        load_tokenizer(ckpt, tiny_cfg)
    path.write_text("{")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a tokenizers file"):
        load_tokenizer(ckpt, tiny_cfg)
    path.unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        load_tokenizer(ckpt, tiny_cfg)
