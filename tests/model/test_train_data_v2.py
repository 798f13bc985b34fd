"""Data version 2 of the mini-K3's tasks (model/kimi_k3/train/data.py): recency and windowed-count samples are
well-formed (targets inside the sequence, answers recomputed from the generated tokens, the same per seed), a mix
without them draws version 1's rows exactly, runs record the version they trained on, and a version 1 checkpoint's
accuracy-eval items are what they were before version 2 (hashes taken from the code before it)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch

from gates.evals import accuracy
from gates.evals.accuracy import AccuracyConfig, Items
from model.kimi_k3.tokenizer import build_tokenizer
from model.kimi_k3.train.__main__ import parse
from model.kimi_k3.train.config import Recipe, mini_config
from model.kimi_k3.train.data import ASSIGNMENTS, WINDOWS, Tasks, data_version

# sha256 of version 1's eval items (_items_hash) and of a version 1 batch (_batch_hash), computed with the code
# before data version 2 (commit fa4d063)
V1_ITEMS = {("cpu", 0): "257adbbb3616048da0a6bc9c6108e7c08c5bb9b2010c16283ddbe637a917455c",
            ("cpu", 1): "4f90122da6e45fb192d7369dd6c58aa5d6f5c49ffc0488b0eba3b73e061379da",
            ("gpu", 0): "d36ee22c53c8215b08266c65bb0cbab2a5d33c6cbedfa1e785168793772ac2b7"}
V1_BATCH = "56b397c2b6357a4fba9992ca4e866d27134e85c2fcda92033706ae13ad2015ad"


@pytest.fixture(scope="module")
def tasks():
    cfg = mini_config()
    return Tasks(build_tokenizer(cfg), cfg)


def latest_values(tasks: Tasks, tokens: list[int]) -> dict[int, list[int]]:
    """Each key's assigned values in order, read back from a recency haystack (up to its newline)."""
    seen: dict[int, list[int]] = {}
    for i in range(tokens.index(tasks.newline) - 2):
        if tokens[i] in tasks.keys and tokens[i + 1] == tasks.eq:
            seen.setdefault(tokens[i], []).append(tokens[i + 2])
    return seen


@pytest.mark.parametrize("seed, length, keys", [(0, 128, 3), (1, 256, 8), (2, 1024, 8), (3, 65, 2)])
def test_recency_answers_are_the_latest_assignments(tasks, seed, length, keys):
    s = tasks.recency(random.Random(seed), length, keys)
    assert len(s.tokens) == length and len(s.targets) == len(s.meta["answers"]) == keys
    assert all(0 <= p < length - 1 and s.tokens[p] == tasks.eq and s.tokens[p - 2] == tasks.query for p in s.targets)
    assert [s.tokens[p + 1] for p in s.targets] == s.meta["answers"]
    assigned = latest_values(tasks, s.tokens)
    queried = [s.tokens[p - 1] for p in s.targets]
    assert sorted(queried) == sorted(assigned) and len(set(queried)) == keys
    for key, answer, stale in zip(queried, s.meta["answers"], s.meta["stale"]):
        values = assigned[key]
        assert ASSIGNMENTS[0] <= len(values) <= ASSIGNMENTS[1]
        assert values[-1] == answer and values[:-1] == stale and answer not in stale
    again = tasks.recency(random.Random(seed), length, keys)
    assert (again.tokens, again.targets, again.meta) == (s.tokens, s.targets, s.meta)


def test_recency_refuses_a_length_too_short(tasks):
    with pytest.raises(ValueError, match="recency"):
        tasks.recency(random.Random(0), 40, 8)


@pytest.mark.parametrize("seed, length, window", [(0, 160, None), (1, 256, 16), (2, 1024, 64), (3, 1024, None),
                                                  (4, 65, None)])
def test_window_answers_count_the_marker_over_the_last_n_tokens(tasks, seed, length, window):
    s = tasks.window(random.Random(seed), length, window)
    n, marker = s.meta["window"], s.meta["marker"]
    assert len(s.tokens) == length and n in WINDOWS and (window is None or n == window) and 2 * n + 16 <= length
    head = [tasks.bos] + tasks.count_prompt + [marker, tasks.values[n // 10], tasks.values[n % 10], tasks.to]
    assert s.tokens[:len(head)] == head and s.targets and s.targets[0] >= len(head) + n
    assert len(s.targets) == len(s.meta["answers"]) == len(s.meta["counts"])
    for p, answer, count in zip(s.targets, s.meta["answers"], s.meta["counts"]):
        assert 0 <= p < length - 1 and s.tokens[p] == tasks.query
        assert count == s.tokens[p - n:p].count(marker) and answer == tasks.values[count] == s.tokens[p + 1]
    assert set(s.tokens[len(head):]) <= set(tasks.keys) | {tasks.query} | set(tasks.values)
    assert sum(c > 0 for c in s.meta["counts"]) > 0 or length < 200
    again = tasks.window(random.Random(seed), length, window)
    assert (again.tokens, again.targets, again.meta) == (s.tokens, s.targets, s.meta)


def _batch_hash(ids, nxt, weight) -> str:
    return hashlib.sha256(ids.numpy().tobytes() + nxt.numpy().tobytes()
                          + (weight * 1e6).round().long().numpy().tobytes()).hexdigest()


def test_a_mix_without_version_2_tasks_is_version_1s(tasks):
    assert _batch_hash(*tasks.batch(random.Random(0), 8, 256, 0.5)) == V1_BATCH
    assert _batch_hash(*tasks.batch(random.Random(0), 8, 256, 0.5, recency_fraction=0.0,
                                    window_fraction=0.0)) == V1_BATCH
    assert data_version() == 1 and data_version(0.1, 0) == data_version(0, 0.1) == 2
    assert Recipe().data_version == 2 and Recipe(recency_fraction=0, window_fraction=0).data_version == 1


@pytest.mark.parametrize("kind", ["recency", "window"])
def test_version_2_rows_in_a_batch(tasks, kind):
    row = tasks.row(random.Random(5), 256, kind)
    assert len(row.tokens) == 257 and row.targets and max(row.targets) < 256
    ids, nxt, weight = tasks.batch(random.Random(6), 4, 128, 0.0, **{f"{kind}_fraction": 1.0})
    assert ids.shape == nxt.shape == weight.shape == (4, 128) and torch.equal(ids[:, 1:], nxt[:, :-1])
    assert abs(weight.sum().item() - 1) < 1e-6 and (weight > 0).sum(1).min() > 0
    ids, nxt, weight = tasks.batch(random.Random(7), 64, 64, 0.5, recency_fraction=0.125, window_fraction=0.125)
    assert abs(weight.sum().item() - 1) < 1e-6
    with pytest.raises(ValueError, match="fractions"):
        tasks.batch(random.Random(0), 4, 128, 0.5, recency_fraction=0.3, window_fraction=0.3)


def test_the_command_records_the_version_of_its_mix(tmp_path):
    assert parse(["--out", str(tmp_path / "a"), "--device", "cpu"]).recipe.data_version == 2
    run = parse(["--out", str(tmp_path / "b"), "--device", "cpu", "--recency-fraction", "0", "--window-fraction", "0"])
    assert run.recipe.data_version == 1 and run.recipe.as_dict()["window_fraction"] == 0


def _items_hash(items: Items) -> str:
    d = {"recall": {n: [(s.tokens, s.targets, s.meta) for s in v] for n, v in items.recall.items()},
         "json": [(s.tokens, s.targets, s.prompt_len, s.meta) for s in items.json],
         "pick": [(s.tokens, s.targets, s.prompt_len, {str(k): v for k, v in s.meta["distribution"].items()})
                  for s in items.pick],
         "arithmetic": [(s.tokens, s.targets, s.prompt_len, s.meta) for s in items.arithmetic]}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("device, seed", sorted(V1_ITEMS))
def test_version_1_eval_items_are_unchanged(tasks, device, seed):
    """A version 1 record draws exactly the items it drew before version 2 (and none of version 2's); a version 2
    record draws the same version 1 items, then its own."""
    budget = getattr(AccuracyConfig(), device)
    v1, v2 = Items.draw(tasks, budget, seed, 1), Items.draw(tasks, budget, seed, 2)
    assert _items_hash(v1) == _items_hash(v2) == V1_ITEMS[device, seed]
    assert not v1.recency and not v1.window and not v1.dynamics
    assert [len(v) for v in v2.recency.values()] == [budget.recency_per_length] * len(budget.recency_lengths)
    assert len(v2.window) == budget.window_prompts and len(v2.dynamics) <= accuracy.MAX_BATCH


def test_the_version_comes_from_the_checkpoints_record(tmp_path):
    if accuracy.default_ckpt() is None:
        pytest.skip("no committed checkpoint")
    assert accuracy.config_for(accuracy.TRAINED_CKPT, torch.device("cpu"), 0).data_version == 2  # run 2's
    (tmp_path / "training.json").write_text(json.dumps({"data_version": 1}))
    assert accuracy.config_for(tmp_path, torch.device("cpu"), 0).data_version == 1
    assert accuracy.config_for(None, torch.device("cpu"), 0).data_version == 1


@pytest.mark.parametrize("name, kind, higher", [
    ("recency@256", "accuracy", True), ("recency_nll@1024", "nll", False), ("window@256", "accuracy", True),
    ("window_nll@1024", "nll", False), ("recall@128", "accuracy", True), ("recall_nll@2048", "nll", False),
    ("json_fields@spec3", "accuracy", True), ("pick_tv@T0.7", "tv", False), ("pick_draws_tv", "tv", False),
    ("arith_p@T1", "accuracy", True)])
def test_metric_kinds(name, kind, higher):
    assert accuracy.metric(name) == accuracy.Metric(kind, higher)
