"""Synthetic tasks with checkable answers, generated on the fly from a seed, over the checkpoint's tokenizer.

Every sample is a token list with the positions whose next token is supervised (`Sample.targets`), and what an
eval needs to judge the answer (`Sample.meta`). Recall, copying, picking and arithmetic are token-level (single
printable tokens, so any position is one token); JSON is text, tokenized as the tokenizer would.

- recall (multi-query associative recall, MRCR-like): `pairs` key=value pairs (`K=v`: an uppercase key, a digit
  or lowercase value) scattered through prose filler, then `?K=` queries for every key in another order; each
  value after a query's `=` is supervised.
- json: a schema (field names and types) and a record in another order -> the record as compact JSON following
  the schema (field order, types, no extra fields), then EOS.
- copy: `copy:` n tokens `>` -> the same n tokens, then EOS.
- pick: `pick:` n tokens (repeats allowed) `>` -> one of them drawn uniformly by position: the answer's
  distribution is known (each distinct token's multiplicity / n), so temperature sampling can be judged against it.
- arithmetic: `a+b=` with a + b <= 9 -> the digit, then EOS.

DATA_VERSION names this generator in the checkpoint's record; bump it whenever a format or distribution changes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from ..config import KimiK3Config

DATA_VERSION = 1
KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
VALUES = "0123456789abcdefghijklmnopqrstuvwxyz"
MAX_PAIRS = 16

# JSON fields by type: string values are words, enums fixed sets, integers ranges.
WORDS = ("red", "green", "blue", "open", "closed", "small", "large", "first", "last", "data", "note", "order",
         "list", "value", "code", "answer", "city", "user", "mode", "level")
FIELDS = {
    "name": ("str", WORDS), "city": ("str", WORDS), "note": ("str", WORDS),
    "color": ("enum", ("red", "green", "blue")), "status": ("enum", ("open", "closed", "pending", "shipped")),
    "size": ("enum", ("small", "large")),
    "age": ("int", (0, 120)), "qty": ("int", (1, 99)), "price": ("int", (0, 999)), "id": ("int", (1, 9999)),
    "active": ("bool", None), "first": ("bool", None),
}
TASKS = ("recall", "json", "copy", "pick", "arithmetic")


@dataclass
class Sample:
    tokens: list[int]
    targets: list[int] = field(default_factory=list)  # positions p whose next token tokens[p + 1] is supervised
    prompt_len: int = 0  # tokens before the answer (generation tasks)
    meta: dict = field(default_factory=dict)


class Tasks:
    """The task generators over one tokenizer (token ids looked up once)."""

    def __init__(self, tokenizer: Tokenizer, cfg: KimiK3Config):
        self.tokenizer = tokenizer
        self.bos, self.eos = cfg.bos_token_id, cfg.eos_token_id

        def one(text: str) -> int:
            i = tokenizer.token_to_id(text)
            if i is None:
                raise ValueError(f"tokenizer: {text!r} is not one token; the tasks need it to be")
            return i

        self.keys = [one(c) for c in KEYS]
        self.values = [one(c) for c in VALUES]
        self.eq, self.query, self.newline, self.to = one("="), one("?"), one("Ċ"), one(">")
        self.plus = one("+")
        self.filler = sorted(i for t, i in tokenizer.get_vocab().items()
                             if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2)
        self.copy_prompt, self.pick_prompt = self.text("copy:"), self.text("pick:")

    def text(self, s: str) -> list[int]:
        return self.tokenizer.encode(s, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- tasks -------------------------------------------------------------------------------------------------

    def recall(self, rng: random.Random, length: int, pairs: int) -> Sample:
        """`length` tokens: BOS, filler with `pairs` K=v pairs at random places, a newline, then every key queried."""
        keys = rng.sample(self.keys, pairs)
        values = [rng.choice(self.values) for _ in keys]
        filler = length - 1 - 3 * pairs - 1 - 4 * pairs  # BOS, K=v per pair, newline, ?K=v per pair
        if filler < 0:
            raise ValueError(f"recall: {length} tokens cannot hold {pairs} pairs and their queries")
        cuts = sorted(rng.randrange(filler + 1) for _ in keys)
        tokens, prev, where = [self.bos], 0, []
        for cut, k, v in zip(cuts, keys, values):
            tokens += rng.choices(self.filler, k=cut - prev)
            where.append(len(tokens))
            tokens += [k, self.eq, v]
            prev = cut
        tokens += rng.choices(self.filler, k=filler - prev)
        tokens.append(self.newline)
        order = rng.sample(range(pairs), pairs)
        targets, answers = [], []
        for i in order:
            tokens += [self.query, keys[i], self.eq]
            targets.append(len(tokens) - 1)
            answers.append(values[i])
            tokens.append(values[i])
        return Sample(tokens, targets, meta={"answers": answers, "depths": [where[i] / length for i in order]})

    def json(self, rng: random.Random) -> Sample:
        names = rng.sample(sorted(FIELDS), rng.randint(2, 5))
        record = {n: _value(rng, *FIELDS[n]) for n in names}
        shuffled = rng.sample(names, len(names))
        prompt = ("schema: " + " ".join(f"{n}:{FIELDS[n][0]}" for n in names) + "\nrecord: "
                  + " ".join(f"{n}={_text(record[n])}" for n in shuffled) + "\njson:")
        answer = json.dumps(record, separators=(",", ":"))
        head, body = [self.bos] + self.text(prompt), self.text(answer) + [self.eos]
        return Sample(head + body, list(range(len(head) - 1, len(head) + len(body) - 1)), len(head),
                      {"record": record, "schema": schema(names)})

    def copy(self, rng: random.Random) -> Sample:
        seq = rng.choices(self.values + self.keys, k=rng.randint(4, 24))
        head = [self.bos] + self.copy_prompt + seq + [self.to]
        body = seq + [self.eos]
        return Sample(head + body, list(range(len(head) - 1, len(head) + len(body) - 1)), len(head), {"answer": seq})

    def pick(self, rng: random.Random) -> Sample:
        """The answer is drawn from the listed tokens by position; meta['distribution'] is {token: probability}."""
        listed = rng.choices(self.values, k=rng.randint(2, 8))
        head = [self.bos] + self.pick_prompt + listed + [self.to]
        dist = {t: listed.count(t) / len(listed) for t in sorted(set(listed))}
        return Sample(head + [rng.choice(listed)], [len(head) - 1], len(head), {"distribution": dist})

    def arithmetic(self, rng: random.Random) -> Sample:
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        head = [self.bos, self.values[a], self.plus, self.values[b], self.eq]
        return Sample(head + [self.values[a + b], self.eos], [len(head) - 1, len(head)], len(head),
                      {"answer": self.values[a + b]})

    # ---- training batches --------------------------------------------------------------------------------------

    def row(self, rng: random.Random, length: int, recall: bool) -> Sample:
        """One training row of length + 1 tokens: a recall sample, or short samples packed back to back (the last
        cut, its targets past the row dropped)."""
        if recall:
            return self.recall(rng, length + 1, rng.randint(2, min(MAX_PAIRS, (length - 8) // 8)))
        tokens: list[int] = []
        targets: list[int] = []
        while len(tokens) < length + 1:
            s = getattr(self, rng.choice(TASKS[1:]))(rng)
            targets += [len(tokens) + p for p in s.targets]
            tokens += s.tokens
        return Sample(tokens[:length + 1], [p for p in targets if p < length])

    def batch(self, rng: random.Random, rows: int, length: int, recall_fraction: float,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs [rows, length], next tokens [rows, length], loss weights [rows, length]): the recall rows' few
        targets and the packed rows' many each carry their share of the loss (recall_fraction and the rest)."""
        recall = [rng.random() < recall_fraction for _ in range(rows)]
        samples = [self.row(rng, length, r) for r in recall]
        tokens = torch.tensor([s.tokens for s in samples])
        weights = torch.zeros(rows, length)
        for kind, share in ((True, recall_fraction), (False, 1 - recall_fraction)):
            picked = [s for s, r in zip(samples, recall) if r is kind]
            total = sum(len(s.targets) for s in picked)
            for i, (s, r) in enumerate(zip(samples, recall)):
                if r is kind:
                    weights[i, s.targets] = share / total
        weights /= weights.sum()
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device), weights.to(device)


def _value(rng: random.Random, kind: str, domain):
    if kind in ("str", "enum"):
        return rng.choice(domain)
    if kind == "int":
        return rng.randint(*domain)
    return rng.random() < 0.5


def _text(value) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def schema(names: list[str]) -> dict:
    """The JSON schema a json sample's answer follows (every field required, no others)."""
    types = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"}}
    props = {n: {"enum": list(FIELDS[n][1])} if FIELDS[n][0] == "enum" else types[FIELDS[n][0]] for n in names}
    return {"type": "object", "properties": props, "required": list(names), "additionalProperties": False}
