"""A real byte-level BPE tokenizer for random checkpoints, saved beside them as `tokenizer.json`.

Grammar engines (llguidance, xgrammar) and the evals need a tokenizer whose ids are the model's: this one
has bos/eos/pad at the config's ids and at most `LEARNED_VOCAB` - 3 learned tokens (the 256 byte tokens plus
BPE merges) on the lowest free ids. The tiny preset's 512 ids are exactly filled; a larger vocabulary (K3's
163840) keeps its other ids unused, and a grammar mask never allows them. The merges are learned by the
`tokenizers` library from a corpus of JSON-ish text drawn from a fixed seed, so the same config always
gives the same tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .config import ConfigError, KimiK3Config
from .weights import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
LEARNED_VOCAB = 512  # byte tokens + merges + the 3 special tokens
BYTE_TOKENS = 256

# Words of the built-in corpus: JSON keys and values the structured-output schemas use, and prose.
_WORDS = (
    "name id age city email status items tags score price qty sku note active user order date count value "
    "type kind level mode color size red green blue small large shipped pending open closed true false null "
    "the code for key is and of to in a an what with from this that answer question data list first last"
).split()


def json_corpus(documents: int = 600, seed: int = 0) -> list[str]:
    """Deterministic JSON documents and sentences: nested objects, arrays, numbers, strings, literals."""
    rng = random.Random(seed)

    def value(depth: int):
        kind = rng.random()
        if kind < 0.3:
            return rng.choice(_WORDS)
        if kind < 0.5:
            return rng.randint(-999, 99999)
        if kind < 0.6:
            return round(rng.uniform(-100, 100), rng.randint(1, 3))
        if kind < 0.75 and depth < 2:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if kind < 0.9 and depth < 2:
            return {rng.choice(_WORDS): value(depth + 1) for _ in range(rng.randint(1, 3))}
        return rng.choice([True, False, None])

    out = []
    for _ in range(documents):
        doc = {rng.choice(_WORDS): value(0) for _ in range(rng.randint(1, 5))}
        separators = (",", ":") if rng.random() < 0.5 else (", ", ": ")
        out.append(json.dumps(doc, separators=separators))
        out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) + ".")
    return out


def _byte_level(tokenizer: Tokenizer) -> None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()


def build_tokenizer(cfg: KimiK3Config) -> Tokenizer:
    """Byte-level BPE for the config's vocabulary, special tokens at the config's ids."""
    specials = {cfg.bos_token_id: BOS, cfg.eos_token_id: EOS, cfg.pad_token_id: PAD}
    if len(specials) < 3:
        raise ConfigError(f"config: bos/eos/pad token ids {sorted(specials)} collide; a tokenizer needs three ids")
    if max(specials) >= cfg.vocab_size:
        raise ConfigError(f"config: special token ids {sorted(specials)} outside vocab_size {cfg.vocab_size}")
    learned = min(cfg.vocab_size, LEARNED_VOCAB) - len(specials)
    if learned < BYTE_TOKENS:
        raise ConfigError(f"config: vocab_size {cfg.vocab_size} cannot hold {BYTE_TOKENS} byte tokens and 3 specials")

    trained = Tokenizer(models.BPE())
    _byte_level(trained)
    trainer = trainers.BpeTrainer(vocab_size=learned, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(json_corpus(), trainer)
    if trained.get_vocab_size() != learned:
        raise RuntimeError(f"BPE training gave {trained.get_vocab_size()} tokens, expected {learned}: corpus too small")

    # Move the learned tokens to the lowest ids the special tokens leave free, then place the specials.
    body = json.loads(trained.to_str())
    free = (i for i in range(cfg.vocab_size) if i not in specials)
    new_id = {old: next(free) for old in range(learned)}
    vocab = {token: new_id[old] for token, old in body["model"]["vocab"].items()}
    vocab.update({token: i for i, token in specials.items()})
    body["model"]["vocab"] = vocab
    body["added_tokens"] = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, token in sorted(specials.items())
    ]
    return Tokenizer.from_str(json.dumps(body))


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> Path:
    path = Path(directory) / TOKENIZER_FILE
    tokenizer.save(str(path))
    return path


def load_tokenizer(directory: str | Path, cfg: KimiK3Config) -> Tokenizer:
    """A checkpoint's `tokenizer.json`, checked to be byte-level and to fit the config's vocabulary."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (`k3forge ckpt make` writes one)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path}: not a tokenizers file ({e})") from None
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise CheckpointError(f"{path}: decoder: {decoder.get('type')!r}, expected a byte-level BPE ('ByteLevel')")
    too_big = sorted(i for i in tokenizer.get_vocab(with_added_tokens=True).values() if i >= cfg.vocab_size)
    if too_big:
        raise CheckpointError(f"{path}: model.vocab: token ids {too_big[:5]} "
                              f"outside the config's vocab_size {cfg.vocab_size}")
    return tokenizer


def _byte_chars() -> dict[str, int]:
    """Which character stands for each byte in byte-level token strings (GPT-2's table, the one the
    `tokenizers` ByteLevel pre-tokenizer uses): printable Latin-1 bytes stand for themselves, the other
    bytes for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(BYTE_TOKENS):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(BYTE_TOKENS + shifted)] = b
            shifted += 1
    return table


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(bytes of every id in [0, vocab_size), b"" for unused ids; the special token ids)."""
    chars = _byte_chars()
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    out = [b""] * vocab_size
    special_ids = []
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if token in special:
            out[i] = token.encode()
            special_ids.append(i)
        else:
            out[i] = bytes(chars[c] for c in token)
    return out, sorted(special_ids)
