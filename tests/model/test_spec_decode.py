"""Speculative verification: acceptance rules, drafters, KDA/MLA rollback and the speculative engine loop
(CPU, tiny preset, fp32, where rounding cannot flip a near-tie)."""

from __future__ import annotations

import math

import pytest
import torch

from model.kimi_k3.batch import StepBatch
from model.kimi_k3.cache import ModelCache
from model.kimi_k3.drafters import NgramDrafter, SyntheticDrafter
from model.kimi_k3.engine import Engine, Generation, SamplingParams
from model.kimi_k3.sampling import top_p_probs
from model.kimi_k3.spec_decode import REJECTED, greedy_accept, rejection_sample

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [7, 8, 9, 7, 8, 9, 7], [300, 2, 77]]
NEW_TOKENS = 12
# fp32 sums of a different grouping (4 verified tokens in one GEMM vs 1 decoded): ~2e-5 on logits of ~8
CLOSE = {"rtol": 1e-4, "atol": 1e-4}


def tv_distance(samples: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (empirical - probs.double()).abs().sum().item()


def tv_bound(probs: torch.Tensor, n: int) -> float:
    """Four times the expected TV distance of n exact samples (E|X/n - p| = sqrt(2p(1-p)/(pi n)))."""
    p = probs.double()
    return 4 * 0.5 * torch.sqrt(2 * p * (1 - p) / (math.pi * n)).sum().item()


def generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(n)]


# ---- acceptance rules --------------------------------------------------------------------------------

def test_greedy_accept_keeps_the_matching_prefix_then_the_targets_token():
    best = torch.tensor([[4, 2, 7, 1], [4, 2, 7, 1], [4, 2, 7, 1]])
    logits = torch.nn.functional.one_hot(best, 9).float()
    drafts = torch.tensor([[4, 2, 7], [4, 5, 7], [0, 2, 7]])
    assert greedy_accept(logits, drafts).tolist() == [[4, 2, 7, 1], [4, 2, REJECTED, REJECTED],
                                                      [4, REJECTED, REJECTED, REJECTED]]


@pytest.mark.parametrize("deterministic", [True, False], ids=["one-hot-q", "sampled-q"])
def test_rejection_sampling_keeps_the_target_distribution(deterministic):
    """Synthetic p (3 positions) and q (2 drafts) over 6 tokens: the first emitted token follows p[0]; after
    an accepted first draft the next follows p[1]; draft 0 is accepted with probability sum(min(p, q))."""
    n, vocab, k = 8000, 6, 2
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=g), -1)
    q = torch.softmax(1.5 * torch.randn(k, vocab, generator=g), -1)
    if deterministic:
        drafts = q.argmax(-1).expand(n, k)
        q_used, accept_rate = None, p[0, drafts[0, 0]].item()  # one-hot q: accepted with probability p(x)
    else:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], -1)
        q_used, accept_rate = q.expand(n, k, vocab), torch.minimum(p[0], q[0]).sum().item()
    out = rejection_sample(p.expand(n, k + 1, vocab), drafts, q_used, generators(n))
    assert tv_distance(out[:, 0], p[0]) < tv_bound(p[0], n)
    accepted = out[:, 1] != REJECTED
    assert tv_distance(out[accepted, 1], p[1]) < tv_bound(p[1], int(accepted.sum()))
    assert abs(accepted.double().mean().item() - accept_rate) < 4 * math.sqrt(accept_rate * (1 - accept_rate) / n)
    assert torch.equal(out, rejection_sample(p.expand(n, k + 1, vocab), drafts, q_used, generators(n)))  # seeded


def test_rejection_sampling_with_a_certain_target_accepts_exactly_its_tokens():
    """p one-hot (top-p so small that one token is left): sampling degenerates to greedy acceptance."""
    best = torch.tensor([[3, 1, 4, 1]])
    p = torch.nn.functional.one_hot(best, 8).float()
    for drafts, want in (([3, 1, 4], [3, 1, 4, 1]), ([3, 2, 4], [3, 1, REJECTED, REJECTED])):
        out = rejection_sample(p, torch.tensor([drafts]), None, generators(1))
        assert out[0].tolist() == want


# ---- drafters -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("history, want", [
    ([1, 2, 3, 4, 1, 2], [3, 4, 1, 2]),  # latest occurrence of the suffix (1, 2), then copying runs on
    ([9, 1, 2, 5, 1, 2, 6, 1, 2], [6, 1, 2, 6]),  # the most recent of two matches
    ([5, 6, 7], [7, 7, 7, 7]),  # no match: the last token repeats
    ([4], [4, 4, 4, 4]),
])
def test_ngram_drafter(history, want):
    draft = NgramDrafter().propose([Generation(history[:1], history[1:])], 4)
    assert draft.tokens.tolist() == [want] and draft.probs is None


def test_synthetic_drafter_drafts_the_reference_then_wrong_tokens():
    drafter = SyntheticDrafter(2, {(1,): [10, 11, 12, 13, 14, 15]}, vocab_size=16)
    assert drafter.propose([Generation([1], [10])], 3).tokens.tolist() == [[11, 12, 14]]
    with pytest.raises(ValueError, match="ends before"):
        drafter.propose([Generation([1], [10, 11, 12, 13])], 3)


# ---- verification and rollback on the model ------------------------------------------------------------

def prefill(model, cache: ModelCache, prompt: list[int]) -> tuple[int, torch.Tensor]:
    slot = cache.allocate()
    hidden = model(torch.tensor(prompt), StepBatch((slot,), (len(prompt),), (0,)), cache)
    return slot, model.logits(hidden[-1:])


@pytest.fixture(scope="module")
def greedy_reference(tiny_model):
    return Engine(tiny_model, max_len=64).generate(PROMPTS, SamplingParams(NEW_TOKENS + 8))


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_rollback_leaves_the_states_of_plain_decoding(tiny_model, tiny_cfg, greedy_reference, accepted):
    """Verify the last token and 3 drafts of which `accepted` are right, commit, and compare every cache with
    plain decoding of the kept tokens; the next step's logits agree as well."""
    k, prompt, ref = 3, PROMPTS[0], greedy_reference[0].tokens
    drafts = ref[1:1 + accepted] + [(t + 1) % tiny_cfg.vocab_size for t in ref[1 + accepted:1 + k]]
    spec = ModelCache(tiny_cfg, tiny_model.tp, 1, 32, torch.float32, spec_tokens=k)
    slot, _ = prefill(tiny_model, spec, prompt)
    batch = StepBatch((slot,), (1 + k,), (len(prompt),), spec_tokens=k)
    logits = tiny_model.logits(tiny_model(torch.tensor(ref[:1] + drafts), batch, spec)).view(1, 1 + k, -1)
    emitted = greedy_accept(logits, torch.tensor([drafts]))[0]
    assert emitted.tolist()[:accepted + 1] == ref[1:accepted + 2]
    spec.commit([slot], [accepted + 1])

    plain = ModelCache(tiny_cfg, tiny_model.tp, 1, 32, torch.float32)
    _, decoded = prefill(tiny_model, plain, prompt)
    for i, token in enumerate(ref[:accepted + 1]):
        assert decoded.argmax().item() == token
        hidden = tiny_model(torch.tensor([token]), StepBatch((slot,), (1,), (plain.lengths[slot],)), plain)
        decoded = tiny_model.logits(hidden)
        torch.testing.assert_close(decoded[0], logits[0, i], **CLOSE)  # verify = decode, per position

    assert spec.lengths == plain.lengths == [len(prompt) + accepted + 1]
    n = spec.lengths[slot]
    for layer in plain.kv:
        torch.testing.assert_close(spec.kv[layer][slot, :n], plain.kv[layer][slot, :n], **CLOSE)
    for layer in plain.conv:
        torch.testing.assert_close(spec.conv[layer][slot], plain.conv[layer][slot], **CLOSE)
        torch.testing.assert_close(spec.ssm[layer][slot], plain.ssm[layer][slot], **CLOSE)
    nxt = torch.tensor([ref[accepted + 1]])
    after = [tiny_model.logits(tiny_model(nxt, StepBatch((slot,), (1,), (n,)), c)) for c in (spec, plain)]
    torch.testing.assert_close(after[0], after[1], **CLOSE)


def test_a_verified_slot_must_be_committed(tiny_model, tiny_cfg):
    cache = ModelCache(tiny_cfg, tiny_model.tp, 1, 32, torch.float32)
    slot, _ = prefill(tiny_model, cache, [1, 2, 3])
    verify = StepBatch((slot,), (3,), (3,), spec_tokens=2)
    with pytest.raises(ValueError, match="reserve_spec"):
        tiny_model(torch.tensor([4, 5, 6]), verify, cache)
    cache = ModelCache(tiny_cfg, tiny_model.tp, 1, 32, torch.float32, spec_tokens=2)
    slot, _ = prefill(tiny_model, cache, [1, 2, 3])
    with pytest.raises(ValueError, match="no verification step"):
        cache.commit([slot], [1])
    tiny_model(torch.tensor([4, 5, 6]), verify, cache)
    with pytest.raises(RuntimeError, match="not committed"):
        tiny_model(torch.tensor([7]), StepBatch((slot,), (1,), (6,)), cache)
    with pytest.raises(ValueError, match="keeps 4 of 3"):
        cache.commit([slot], [4])


def test_speculative_sampling_first_token_matches_plain_sampling(tiny_model, tiny_cfg, greedy_reference):
    """The first token a verification step emits at temperature > 0, over many seeds, against the exact plain
    sampling distribution of that position; the drafts are the greedy continuation, so both acceptance and
    rejection happen often."""
    n, k, temperature, top_p = 8000, 3, 0.5, 0.9
    prompt, ref = PROMPTS[0], greedy_reference[0].tokens
    plain = ModelCache(tiny_cfg, tiny_model.tp, 1, 32, torch.float32)
    _, logits = prefill(tiny_model, plain, prompt + ref[:1])
    p = top_p_probs(logits, temperature, top_p)[0]

    spec = ModelCache(tiny_cfg, tiny_model.tp, 1, 32, torch.float32, spec_tokens=k)
    slot, _ = prefill(tiny_model, spec, prompt)
    batch = StepBatch((slot,), (1 + k,), (len(prompt),), spec_tokens=k)
    verify = tiny_model.logits(tiny_model(torch.tensor(ref[:1 + k]), batch, spec))
    target = top_p_probs(verify, temperature, top_p).view(1, 1 + k, -1)
    out = rejection_sample(target.expand(n, -1, -1), torch.tensor(ref[1:1 + k]).expand(n, k), None, generators(n))
    assert 0.2 < p[ref[1]] < 0.8  # draft 0 is neither certain nor hopeless: both branches are exercised
    assert tv_distance(out[:, 0], p) < tv_bound(p, n)


# ---- the speculative engine loop ------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculative_decoding_gives_the_plain_tokens(tiny_model, greedy_reference, k):
    gens = Engine(tiny_model, max_len=64).generate(PROMPTS, SamplingParams(NEW_TOKENS), k, NgramDrafter())
    assert [g.tokens for g in gens] == [r.tokens[:NEW_TOKENS] for r in greedy_reference]
    for g, r in zip(gens, greedy_reference):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs[:NEW_TOKENS]), **CLOSE)


@pytest.mark.parametrize("k, accept", [(1, 1), (3, 0), (3, 2), (7, 6), (7, 7)])
def test_synthetic_drafter_is_accepted_exactly(tiny_model, greedy_reference, k, accept):
    engine = Engine(tiny_model, max_len=64)
    drafter = SyntheticDrafter.from_greedy(engine, PROMPTS, NEW_TOKENS, accept, k)
    gens = engine.generate(PROMPTS, SamplingParams(NEW_TOKENS), k, drafter)
    assert [g.tokens for g in gens] == [r.tokens[:NEW_TOKENS] for r in greedy_reference]
    steps = -(-(NEW_TOKENS - 1) // (accept + 1))  # the prefill emits one token, each step accept + 1
    assert all(g.accepted == [accept] * steps for g in gens)


def test_speculative_sampling_with_one_token_left_is_greedy(tiny_model, greedy_reference):
    """top-p so small that only the most likely token survives: the rejection-sampling path must then
    reproduce greedy decoding exactly, drafts accepted or not."""
    engine = Engine(tiny_model, max_len=64)
    params = SamplingParams(NEW_TOKENS, temperature=0.7, top_p=1e-6, seed=3)
    drafter = SyntheticDrafter.from_greedy(engine, PROMPTS, NEW_TOKENS, 2, 3)
    gens = engine.generate(PROMPTS, params, 3, drafter)
    assert [g.tokens for g in gens] == [r.tokens[:NEW_TOKENS] for r in greedy_reference]
    assert all(a == 2 for g in gens for a in g.accepted)


def test_speculative_sampling_is_seeded(tiny_model):
    engine = Engine(tiny_model, max_len=64)
    runs = [engine.generate(PROMPTS, SamplingParams(6, temperature=1.0, seed=s), 3, NgramDrafter()) for s in (5, 5, 6)]
    tokens = [[g.tokens for g in run] for run in runs]
    assert tokens[0] == tokens[1] != tokens[2]
    assert all(len(g.tokens) == 6 for g in runs[0])


def test_generate_refuses_bad_speculation_settings(tiny_model):
    engine = Engine(tiny_model, max_len=16)
    with pytest.raises(ValueError, match="needs spec_tokens > 0 and a drafter"):
        engine.generate([[1, 2]], SamplingParams(4), spec_tokens=3)
    with pytest.raises(ValueError, match="up to 17 cached tokens per sequence exceed the engine's max_len 16"):
        engine.generate([[1, 2]], SamplingParams(13), spec_tokens=3, drafter=NgramDrafter())
