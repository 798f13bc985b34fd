"""The structured-output eval: grammar-forced JSON is valid on every schema whatever the logits, identical
greedy tokens are required (near-ties excused) with and without speculative decoding, and a token budget that
runs out is a failure."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import llguidance
import pytest
import torch

from gates.evals.paths import RouteSwap, RoutingTap, Session, perturbed
from gates.evals.result import Status
from gates.evals.schemas import SCHEMAS
from gates.evals.structured import (
    GRAMMAR_OPTIONS,
    StructuredConfig,
    _allowed,
    _compare,
    _Decode,
    _first_difference,
    _generate,
    _key_shift,
    _margin,
    _Vocabulary,
    run,
)
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
    # the candidate's speculative run took a near-tie routing branch the reference itself decodes
    ("identical", "identical", "routing near-tie at step 30 (...: identical)", True),
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
    assert any("yardstick's largest top-2 gap shift" in note for note in beside.notes)


def test_a_standard_that_tracks_the_reference_excuses_nothing(make_pair, progress):
    pair = make_pair()
    noisy = replace(pair.candidate, name="noise", logit_transforms=(random_logits(),))
    result = run(config(schemas=("nested",), spec_tokens=(0,)),
                 replace(pair, candidate=noisy, standard=pair.candidate), progress)
    assert result.status == Status.FAILED_EVAL
    assert result.metrics["tie_tolerance"] == CPU.tie_tolerance  # the standard's shift is rounding-small


def swapped(path, swap):
    """The reference's own branch with one router choice swapped: where a rounding difference can take a path."""
    def make_engine(max_len):
        engine = path.make_engine(max_len)
        engine.ops = RoutingTap(swap).wrap(engine.ops)
        return engine

    return replace(path, name="swapped", make_engine=make_engine)


@pytest.fixture(scope="module")
def near_tie_branch(make_pair):
    """The reference's nearest router choice (smallest key margin) on the nested schema whose swap changes the
    greedy tokens: (swap, its margin)."""
    pair, cfg = make_pair(), make_pair().cfg
    schema = SCHEMAS["nested"]
    prompt = [cfg.bos_token_id] + pair.tokenizer.encode(f"Reply with {schema['title']} as JSON:\n",
                                                        add_special_tokens=False).ids
    vocabulary = _Vocabulary(pair.tokenizer, cfg.vocab_size, cfg.eos_token_id, cfg.bos_token_id)
    generate = partial(_generate, grammar_tok=llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary)),
                       grammar=llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=GRAMMAR_OPTIONS),
                       prompt=prompt, max_tokens=CPU.max_tokens, schema=schema, eos=cfg.eos_token_id, spec_tokens=0)
    max_len = len(prompt) + CPU.max_tokens
    ref = generate(pair.reference.session(max_len, RoutingTap())).decode
    k = cfg.num_experts_per_token
    for margin, position, layer in sorted((_margin(keys, k), position, layer) for position, layers in ref.keys.items()
                                          for layer, keys in enumerate(layers))[:8]:
        swap = RouteSwap(position, layer)
        if generate(pair.reference.session(max_len, RoutingTap(swap))).decode.tokens != ref.tokens:
            return swap, margin
    pytest.fail("no near-tie router choice of the tiny model changes the nested schema's tokens")


def test_a_divergence_traced_to_a_near_tie_router_choice_is_excused(make_pair, progress, near_tie_branch):
    """The candidate is the reference's branch at a router choice within the routing tolerance: the reference,
    swapped there, decodes its tokens, so the divergence is excused and says where it came from."""
    swap, margin = near_tie_branch
    pair = make_pair()
    result = run(config(schemas=("nested",), spec_tokens=(0,), route_tie_tolerance=margin * 1.01),
                 replace(pair, candidate=swapped(pair.reference, swap)), progress)
    assert result.status == Status.PASSED, result.failed_checks
    verdict = result.tables[0].rows[0][6]
    assert verdict.startswith("routing near-tie") and f"position {swap.position}" in verdict, verdict


def test_a_router_branch_passes_with_speculative_decoding_too(make_pair, progress, near_tie_branch):
    swap, margin = near_tie_branch
    pair = make_pair()
    result = run(config(schemas=("nested",), spec_tokens=(0, 3), route_tie_tolerance=margin * 1.01),
                 replace(pair, candidate=swapped(pair.reference, swap)), progress)
    assert result.status == Status.PASSED, result.failed_checks
    plain, speculative = result.tables[0].rows
    assert plain[6].startswith("routing near-tie"), plain[6]
    assert speculative[6].startswith(("routing near-tie", "identical")), speculative[6]


@pytest.mark.parametrize("update", [{"route_tie_tolerance_factor": 0.5}, {"route_swaps": 0}])
def test_a_router_branch_beyond_the_tolerance_or_untried_fails(make_pair, progress, near_tie_branch, update):
    swap, margin = near_tie_branch
    pair = make_pair()
    budget = {"route_tie_tolerance": margin * update.pop("route_tie_tolerance_factor", 1.01), **update}
    result = run(config(schemas=("nested",), spec_tokens=(0,), **budget),
                 replace(pair, candidate=swapped(pair.reference, swap)), progress)
    assert result.status == Status.FAILED_EVAL
    assert result.tables[0].rows[0][6].startswith("diverged")


def test_a_candidate_no_router_branch_explains_fails_however_wide_the_routing_tolerance(make_pair, progress):
    """Every choice a near-tie (tolerance 1): the swaps tried decode the reference's branches, never the noise."""
    pair = make_pair()
    noisy = replace(pair.candidate, name="noise", logit_transforms=(random_logits(),))
    result = run(config(schemas=("nested",), spec_tokens=(0,), route_tie_tolerance=1.0, route_swaps=2),
                 replace(pair, candidate=noisy), progress)
    assert result.status == Status.FAILED_EVAL and result.tables[0].rows[0][6].startswith("diverged")


def test_key_shift_stops_where_the_contexts_part():
    """Over the positions up to the parted token's, through the first where a layer chose other experts."""
    base = torch.tensor([0.9, 0.8, 0.1, 0.0])
    ref = _Decode(tokens=[1, 2, 3], prompt_len=2, keys={p: [base] for p in range(4)})
    moved = {0: [base + 0.01], 1: [torch.tensor([0.9, 0.05, 0.1, 0.0])], 2: [base + 0.5], 3: [base + 0.7]}
    other = _Decode(tokens=[1, 2, 4], prompt_len=2, keys=moved)
    assert _first_difference(ref, other) == 2
    assert _key_shift(ref, other, top_k=2) == pytest.approx(0.75)  # position 1 swapped experts: 2 and 3 unseen
    ref.prompt_len = 1  # the first token was chosen at position 0: parted there, only position 0 counts
    assert _key_shift(ref, _Decode(tokens=[9], keys=moved), top_k=2) == pytest.approx(0.01)
    assert _margin(base, 2) == pytest.approx(0.7)
