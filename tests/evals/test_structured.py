"""The structured-output eval: grammar-forced JSON is valid on every schema whatever the logits, identical
greedy tokens are required (near-ties excused) with and without speculative decoding, and a token budget that
runs out is a failure."""

from __future__ import annotations

from dataclasses import replace

import llguidance
import pytest
import torch

from gates.evals.paths import Session, perturbed
from gates.evals.result import Status
from gates.evals.schemas import SCHEMAS
from gates.evals.structured import GRAMMAR_OPTIONS, StructuredConfig, _allowed, _compare, _Decode, _Vocabulary, run
from model.kimi_k3.config import preset
from model.kimi_k3.tokenizer import build_tokenizer

CPU = StructuredConfig().cpu


def config(**update):
    return StructuredConfig(cpu=CPU.model_copy(update=update))


def checks(result):
    return {c.name: c for c in result.checks}


def random_logits(seed=0):
    """A logit transform that throws the model's logits away for seeded noise of the same spread."""
    gen = torch.Generator().manual_seed(seed)
    return lambda logits: torch.randn(logits.shape, generator=gen) * 2


def test_identical_path_every_schema_valid(make_pair, progress):
    result = run(StructuredConfig(), make_pair(), progress)
    assert result.status == Status.PASSED, result.failed_checks
    assert result.metrics["valid_rate_reference"] == result.metrics["valid_rate_candidate"] == 1.0
    rows = result.tables[0].rows
    assert [(row[0], row[1]) for row in rows] == [(name, k) for k in (0, 3) for name in SCHEMAS]
    assert checks(result)["speculative tokens identical to plain decoding"].passed
    assert all(row[7] == "identical / identical" for row in rows if row[1] == 3)
    # JSON repeats keys and punctuation: prompt-lookup drafts are accepted often, so verification really ran
    assert result.metrics["verify_steps"] > 0 and result.metrics["draft_acceptance"] > 0.1


def noisy_verify(monkeypatch, paths, same_noise_every_call):
    """Verification steps of `paths` return noise instead of the model's logits (decode steps are untouched):
    the same noise at every call (seeded afresh), or one stream of noise."""
    noise = random_logits(1)
    original = Session.verify

    def verify(self, tokens):
        logits = original(self, tokens)
        if self.path not in paths:
            return logits
        return (random_logits(1) if same_noise_every_call else noise)(logits)

    monkeypatch.setattr(Session, "verify", verify)


def test_speculative_decoding_that_emits_wrong_tokens_fails(make_pair, progress, monkeypatch):
    """The candidate's verification steps give other logits than its decode steps (here: noise): caught."""
    pair = make_pair()
    noisy_verify(monkeypatch, [pair.candidate], same_noise_every_call=False)
    result = run(config(schemas=("nested",), spec_tokens=(0, 3)), pair, progress)
    c = checks(result)
    assert result.status == Status.FAILED_EVAL and not c["speculative tokens identical to plain decoding"].passed
    assert "between paths diverged" in c["speculative tokens identical to plain decoding"].detail
    assert c["candidate outputs valid"].passed  # the grammar still forces valid JSON
    assert not result.notes


def test_a_reference_that_leaves_its_own_plain_run_holds_the_candidate_to_its_speculative_tokens(
        make_pair, progress, monkeypatch):
    """Both paths' verification steps turned into the same seeded noise: their speculative runs leave their plain
    runs alike. That is not the candidate's doing: it matches the reference's speculative tokens, so it passes, and
    a note says the reference's own runs parted."""
    pair = make_pair()
    noisy_verify(monkeypatch, [pair.reference, pair.candidate], same_noise_every_call=True)
    result = run(config(schemas=("nested",), spec_tokens=(0, 3)), pair, progress)
    row = result.tables[0].rows[-1]
    assert row[6] == "identical" and row[7].startswith("diverged")  # the paths agree; both left their plain runs
    assert result.status == Status.PASSED, result.failed_checks
    assert len(result.notes) == 1 and "the reference's own speculative run left its plain run" in result.notes[0]


def test_a_candidate_that_leaves_the_reference_where_the_reference_left_its_plain_run_fails(
        make_pair, progress, monkeypatch):
    """Where the reference's own runs part, the candidate's speculative tokens must still be the reference's."""
    pair = make_pair()
    noise = {pair.reference: random_logits(1), pair.candidate: random_logits(2)}  # each path its own noise
    original = Session.verify
    monkeypatch.setattr(Session, "verify", lambda self, tokens: noise[self.path](original(self, tokens)))
    result = run(config(schemas=("nested",), spec_tokens=(0, 3)), pair, progress)
    assert not checks(result)["speculative tokens identical to plain decoding"].passed
    assert not result.notes


def test_grammar_forces_validity_but_different_tokens_fail(make_pair, progress):
    pair = make_pair()
    noisy = replace(pair.candidate, name="noise", logit_transforms=(random_logits(),))
    result = run(config(schemas=("nested", "order"), spec_tokens=(0,)), replace(pair, candidate=noisy), progress)
    c = checks(result)
    assert c["candidate outputs valid"].value == 1.0 and c["candidate outputs parse"].value == 1.0
    same = c["greedy tokens identical between paths"]
    assert result.status == Status.FAILED_EVAL and result.failed_checks == [same]
    assert "diverged at step" in same.detail


def test_logit_scale_cannot_change_greedy_output(make_pair, progress):
    pair = make_pair()
    result = run(config(schemas=("enum", "arrays"), spec_tokens=(0,)),
                 replace(pair, candidate=perturbed(pair.candidate)), progress)
    assert result.status == Status.PASSED


def test_output_that_outgrows_its_budget_fails(make_pair, progress):
    result = run(config(schemas=("order",), max_tokens=8, spec_tokens=(0,)), make_pair(), progress)
    c = checks(result)
    assert result.status == Status.FAILED_EVAL and not c["reference outputs valid"].passed
    assert "no end within 8 tokens" in c["reference outputs valid"].detail


def test_unknown_schema_is_refused(make_pair, progress):
    with pytest.raises(ValueError, match=r"schemas \['xml'\] unknown"):
        run(config(schemas=("xml",)), make_pair(), progress)


def test_mask_unpacking_matches_llguidance(tiny_tokenizer, tiny_cfg):
    vocab = _Vocabulary(tiny_tokenizer, tiny_cfg.vocab_size, tiny_cfg.eos_token_id, tiny_cfg.bos_token_id)
    grammar_tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS["order"], overrides=GRAMMAR_OPTIONS)
    matcher = llguidance.LLMatcher(grammar_tok, grammar, log_level=0)
    for text in ('{"id":"', 'ABC-12', '34","items":[{"sku":"'):
        bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:tiny_cfg.vocab_size]
        allowed = _allowed(matcher, tiny_cfg.vocab_size)
        assert torch.equal(allowed, bias > 0) and 0 < allowed.sum() < tiny_cfg.vocab_size
        assert matcher.consume_tokens(tiny_tokenizer.encode(text).ids)


def test_unused_ids_of_a_padded_vocabulary_are_never_allowed():
    """K3's 163840 ids over a 512-token tokenizer: the mask allows only ids the tokenizer defines."""
    cfg = preset("k3")
    tok = build_tokenizer(cfg)
    grammar_tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(
        _Vocabulary(tok, cfg.vocab_size, cfg.eos_token_id, cfg.bos_token_id)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS["scalars"], overrides=GRAMMAR_OPTIONS)
    matcher = llguidance.LLMatcher(grammar_tok, grammar, log_level=0)
    defined = set(tok.get_vocab(with_added_tokens=True).values())
    for text in ('{"name":"', 'ab', '","age":1'):
        allowed = set(_allowed(matcher, cfg.vocab_size).nonzero().flatten().tolist())
        assert allowed and allowed <= defined
        assert matcher.consume_tokens(tok.encode(text).ids)


@pytest.mark.parametrize("cand,gap,verdict", [
    ([1, 2, 3], 0.5, "identical"),
    ([1, 9, 9], 1e-5, "near-tie at step 1"),
    ([1, 9, 9], 0.5, "diverged at step 1"),
    ([1, 2], 0.5, "diverged at step 2"),
])
def test_divergence_is_excused_only_at_a_near_tie(cand, gap, verdict):
    ref = _Decode(tokens=[1, 2, 3], gaps=[1.0, gap, 1.0], stopped=True)
    assert _compare(ref, _Decode(tokens=cand), tie_tolerance=1e-4).startswith(verdict)


@pytest.mark.parametrize("reference_vs_plain, plain_between, speculative_between, held", [
    ("identical", "identical", "identical", False),  # nothing parted: the candidate answers for its own runs
    ("diverged at step 3", "identical", "identical", True),  # the reference's speculative run left its plain run
    ("identical", "near-tie at step 6", "near-tie at step 7", True),  # the candidate's plain run took a near-tie
    ("identical", "near-tie at step 6", "diverged at step 2", False),  # ... but its speculative run is not the ref's
    ("diverged at step 3", "identical", "diverged at step 2", False),
])
def test_when_the_candidate_is_held_to_the_references_speculative_tokens(reference_vs_plain, plain_between,
                                                                        speculative_between, held):
    from gates.evals.structured import _held_to_reference

    assert _held_to_reference(reference_vs_plain, plain_between, speculative_between) is held


def jitter(scale, seed):
    """A logit transform that adds seeded noise of `scale`: rounding-like drift, not a different model."""
    gen = torch.Generator().manual_seed(seed)
    return lambda logits: logits + torch.randn(logits.shape, generator=gen) * scale


def test_the_standard_paths_own_gap_shift_widens_the_tie_tolerance(make_pair, progress):
    """With the standard beside as the yardstick, a divergence within slack x the standard's own gap shift from the
    reference is excused (on the GPU a routing flip moves a legitimate path that far); the same candidate without
    the yardstick fails at the budget's fixed tolerance."""
    pair = make_pair()
    drifting = replace(pair.candidate, name="drift", logit_transforms=(jitter(0.3, 3),))
    alone = run(config(schemas=("nested",), spec_tokens=(0,)), replace(pair, candidate=drifting), progress)
    assert alone.status == Status.FAILED_EVAL and "standard_gap_shift" not in alone.metrics
    standard = replace(pair.candidate, name="standard", logit_transforms=(jitter(0.5, 4),))
    beside = run(config(schemas=("nested",), spec_tokens=(0,)),
                 replace(pair, candidate=drifting, standard=standard), progress)
    assert beside.status == Status.PASSED, beside.failed_checks
    shift = beside.metrics["standard_gap_shift"]
    assert shift > 0.1 and beside.metrics["tie_tolerance"] == pytest.approx(1.5 * shift)
    assert any("standard path's largest top-2 gap shift" in note for note in beside.notes)


def test_a_standard_that_tracks_the_reference_excuses_nothing(make_pair, progress):
    pair = make_pair()
    noisy = replace(pair.candidate, name="noise", logit_transforms=(random_logits(),))
    result = run(config(schemas=("nested",), spec_tokens=(0,)),
                 replace(pair, candidate=noisy, standard=pair.candidate), progress)
    assert result.status == Status.FAILED_EVAL
    assert result.metrics["tie_tolerance"] == CPU.tie_tolerance  # the standard's shift is rounding-small
