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

Data version 2 adds two tasks whose answers depend on the recurrent state's dynamics (forgetting) rather than on
keeping every write (NOTES.md, "Data version 2"):

- recency: like recall, but each of `keys` keys is assigned 2-4 times (`K=v`, interleaved at random places in the
  filler; a key's latest value differs from its earlier ones), and each `?K=` query asks the key's LATEST value.
- window (windowed count): `count:` a marker key, the window N (two digit tokens, N in WINDOWS) and `>`, then a
  stream of uppercase tokens from a small alphabet with `?` queries at random places, each answered by the number
  of markers among the N tokens before the `?` (earlier queries and answers included: the window is positions),
  as a VALUES token (0-9, then a-z for 10-35).

DATA_VERSION names this generator in the checkpoint's record; bump it whenever a format or distribution changes.
A run whose recipe mixes in none of version 2's tasks draws exactly version 1's rows and records version 1
(`data_version`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from ..config import KimiK3Config

DATA_VERSION = 2
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
TASKS_V2 = ("recency", "window")  # data version 2: whole rows each, like recall
MAX_RECENCY_KEYS = 8
ASSIGNMENTS = (2, 4)  # a recency key's assignments, min and max
WINDOWS = (16, 32, 64)  # the windowed count's N
MARKER_P = (0.05, 0.25)  # the windowed count's marker probability per stream token, drawn per sample


def data_version(recency_fraction: float = 0.0, window_fraction: float = 0.0) -> int:
    """The data version a training mix draws from: 1 while no version 2 task is mixed in (the rows are then exactly
    version 1's), DATA_VERSION otherwise."""
    return DATA_VERSION if recency_fraction > 0 or window_fraction > 0 else 1


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
        self.count_prompt = self.text("count:")

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

    # ---- data version 2: the state's dynamics -----------------------------------------------------------------

    def recency(self, rng: random.Random, length: int, keys: int) -> Sample:
        """`length` tokens: BOS, filler with each of `keys` keys assigned 2-4 times (K=v, all assignments in random
        order at random places), a newline, then every key queried for its latest value."""
        chosen = rng.sample(self.keys, keys)
        times = [rng.randint(*ASSIGNMENTS) for _ in chosen]
        history = []  # per key, its values in assignment order; the last differs from every earlier one
        for n in times:
            earlier = [rng.choice(self.values) for _ in range(n - 1)]
            history.append(earlier + [rng.choice([v for v in self.values if v not in earlier])])
        events = [i for i, n in enumerate(times) for _ in range(n)]
        rng.shuffle(events)
        filler = length - 1 - 3 * len(events) - 1 - 4 * keys  # BOS, K=v per assignment, newline, ?K=v per key
        if filler < 0:
            raise ValueError(f"recency: {length} tokens cannot hold {len(events)} assignments of {keys} keys and "
                             f"their queries")
        cuts = sorted(rng.randrange(filler + 1) for _ in events)
        tokens, prev, seen, latest = [self.bos], 0, [0] * keys, [0] * keys
        for cut, i in zip(cuts, events):
            tokens += rng.choices(self.filler, k=cut - prev)
            latest[i] = len(tokens)
            tokens += [chosen[i], self.eq, history[i][seen[i]]]
            seen[i] += 1
            prev = cut
        tokens += rng.choices(self.filler, k=filler - prev)
        tokens.append(self.newline)
        order = rng.sample(range(keys), keys)
        targets, answers = [], []
        for i in order:
            tokens += [self.query, chosen[i], self.eq]
            targets.append(len(tokens) - 1)
            answers.append(history[i][-1])
            tokens.append(history[i][-1])
        return Sample(tokens, targets, meta={"answers": answers, "stale": [history[i][:-1] for i in order],
                                             "depths": [latest[i] / length for i in order]})

    def window(self, rng: random.Random, length: int, window: int | None = None) -> Sample:
        """`length` tokens: BOS, `count:` marker N `>`, then the stream with `?` queries (the first once N stream
        tokens are in, then every N/4 to N tokens), each answered by the markers among the N tokens before it.
        N: `window`, or drawn from the WINDOWS that leave room for a few queries (2N + 16 <= length)."""
        n = rng.choice([w for w in WINDOWS if 2 * w + 16 <= length] or WINDOWS[:1]) if window is None else window
        alphabet = rng.sample(self.keys, rng.randint(3, 8))
        marker, others, p = alphabet[0], alphabet[1:], rng.uniform(*MARKER_P)
        head = [self.bos] + self.count_prompt + [marker, self.values[n // 10], self.values[n % 10], self.to]
        if n >= 100 or len(head) + n + 2 > length:
            raise ValueError(f"window: {length} tokens cannot hold the prompt, a window of {n} and a query")
        while True:  # a count past the last VALUES token (35) is drawn again (~1e-8 per query at N = 64, p = 0.25)
            tokens, targets, answers = list(head), [], []
            query = len(head) + n + rng.randrange(min(n // 4, length - 2 - len(head) - n) + 1)
            while len(tokens) < length:
                if len(tokens) == query and len(tokens) + 2 <= length:
                    count = tokens[query - n:query].count(marker)
                    targets.append(len(tokens))
                    answers.append(count)
                    tokens += [self.query, self.values[min(count, len(self.values) - 1)]]
                    query = len(tokens) + rng.randint(max(1, n // 4), n)
                else:
                    tokens.append(marker if rng.random() < p else rng.choice(others))
            if max(answers) < len(self.values):
                break
        return Sample(tokens, targets, meta={"answers": [self.values[c] for c in answers], "counts": answers,
                                             "window": n, "marker": marker, "marker_p": p})

    # ---- training batches --------------------------------------------------------------------------------------

    def row(self, rng: random.Random, length: int, kind: str | bool) -> Sample:
        """One training row of length + 1 tokens: a recall, recency or window sample, or ("packed", or False) short
        samples packed back to back (the last cut, its targets past the row dropped). True is "recall"."""
        kind = {True: "recall", False: "packed"}.get(kind, kind)
        if kind == "recall":
            return self.recall(rng, length + 1, rng.randint(2, min(MAX_PAIRS, (length - 8) // 8)))
        if kind == "recency":
            return self.recency(rng, length + 1, rng.randint(2, max(2, min(MAX_RECENCY_KEYS, (length - 8) // 20))))
        if kind == "window":
            return self.window(rng, length + 1)
        if kind != "packed":
            raise ValueError(f"row: unknown kind {kind!r}")
        tokens: list[int] = []
        targets: list[int] = []
        while len(tokens) < length + 1:
            s = getattr(self, rng.choice(TASKS[1:]))(rng)
            targets += [len(tokens) + p for p in s.targets]
            tokens += s.tokens
        return Sample(tokens[:length + 1], [p for p in targets if p < length])

    def batch(self, rng: random.Random, rows: int, length: int, recall_fraction: float,
              device: torch.device | str = "cpu", *, recency_fraction: float = 0.0,
              window_fraction: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs [rows, length], next tokens [rows, length], loss weights [rows, length]): each row's kind drawn
        by the fractions (recall, then recency, then window, the rest packed short tasks), and each kind's
        targets carry its fraction of the loss (renormalized over the kinds the batch has). Without recency and
        window rows the draws and weights are version 1's exactly."""
        fractions = {"recall": recall_fraction, "recency": recency_fraction, "window": window_fraction}
        if min(fractions.values()) < 0 or sum(fractions.values()) > 1 + 1e-9:
            raise ValueError(f"batch: fractions {fractions} must be >= 0 and sum to at most 1")
        fractions["packed"] = max(0.0, 1 - sum(fractions.values()))
        kinds = [_kind(rng.random(), fractions) for _ in range(rows)]
        samples = [self.row(rng, length, k) for k in kinds]
        tokens = torch.tensor([s.tokens for s in samples])
        weights = torch.zeros(rows, length)
        for kind, share in fractions.items():  # version 1's shares exactly when only recall is on (x + 0.0 == x)
            picked = [s for s, k in zip(samples, kinds) if k == kind]
            total = sum(len(s.targets) for s in picked)
            for i, (s, k) in enumerate(zip(samples, kinds)):
                if k == kind:
                    weights[i, s.targets] = share / total
        weights /= weights.sum()
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device), weights.to(device)


def _kind(u: float, fractions: dict[str, float]) -> str:
    """The row kind a uniform draw u picks: recall below recall_fraction (version 1's test), then recency and window
    by their fractions, else packed."""
    edge = 0.0
    for kind in ("recall", "recency", "window"):
        edge += fractions[kind]
        if u < edge:
            return kind
    return "packed"


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
