"""The long-context eval: buckets reported one by one, and each known-bad path caught by its own check."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
from pydantic import ValidationError

from gates.evals.long_context import LongContextBudget, LongContextConfig, _Answer, _buckets, _Haystack, _Probe, run
from gates.evals.paths import DecodePath, DispatchedEngine, ReferenceDispatcher, perturbed
from gates.evals.result import Status

SMALL = LongContextConfig(cpu=LongContextConfig().cpu.model_copy(
    update={"lengths": (128, 320), "decode_steps": 3, "prefill_chunk": 128}))


class DriftingKDA(ReferenceDispatcher):
    """Reference ops, but every KDA decode step leaves its recurrent state 0.1 % too large."""

    def call(self, name, *args):
        out = super().call(name, *args)
        if name == "kda_decode":
            ssm, slots = args[2], args[3]
            ssm[slots] *= 1.001
        return out


def checks(result):
    return {c.name: c for c in result.checks}


def test_identical_path_passes_per_bucket_and_deterministically(make_pair, progress):
    result = run(SMALL, make_pair(), progress)
    assert result.status == Status.PASSED, result.failed_checks
    assert run(SMALL, make_pair(), progress).model_dump() == result.model_dump()
    rows = result.tables[0].rows
    assert [row[0] for row in rows] == [128, 320]
    assert all(row[2] == 0 and row[5] == "4/4" and row[8] == 0 and row[4] is None for row in rows)
    assert {"logit_drift@128", "logit_drift@320", "kda_state_rel_err@320", "retrieval_ref@128"} <= set(result.metrics)
    assert not any(k.startswith(("mean", "avg")) for k in result.metrics)
    assert "not recall" in result.notes[0]


def test_scaled_logits_fail_on_drift_only(make_pair, progress):
    pair = make_pair()
    result = run(SMALL, replace(pair, candidate=perturbed(pair.candidate)), progress)
    c = checks(result)
    assert result.status == Status.FAILED_EVAL and result.failed_checks == [c["max logit drift"]]
    assert c["max logit drift"].value > 100 * c["max logit drift"].bound


def test_nan_logits_never_pass(make_pair, progress):
    def one_nan(logits):
        return logits.index_fill(0, torch.tensor([7]), float("nan"))

    pair = make_pair()
    result = run(SMALL, replace(pair, candidate=replace(pair.candidate, logit_transforms=(one_nan,))), progress)
    assert result.status == Status.FAILED_EVAL and checks(result)["max logit drift"].value == float("inf")


def test_drifting_kda_state_fails(make_pair, tiny_model, progress):
    bad = DecodePath("drifting-kda", partial(DispatchedEngine, tiny_model, ops=DriftingKDA.for_model(tiny_model)))
    result = run(SMALL, replace(make_pair(), candidate=bad), progress)
    c = checks(result)
    assert result.status == Status.FAILED_EVAL and not c["KDA state relative error"].passed


def test_haystack_stretches_are_exact_and_keys_findable(tiny_tokenizer):
    hay = _Haystack(tiny_tokenizer, seed=0)
    first = hay.stretch(0, 300, keys=3)
    second = hay.stretch(300, 200, keys=2)
    assert len(first) == 300 and len(second) == 200 and len(hay.keys) == 5
    doc = first + second
    for key, value, position in hay.keys:
        assert tiny_tokenizer.decode(doc[position:position + 40]).startswith(f" The code for key {key} is {value}.")
    key, value, position, question = hay.probe()
    assert (key, value, position) in hay.keys and key in tiny_tokenizer.decode(question)


def test_lengths_must_ascend():
    with pytest.raises(ValidationError, match="strictly ascending"):
        LongContextBudget(lengths=(256, 128), prefill_chunk=64, logit_atol=1, state_rtol=1)


def test_buckets_too_close_for_the_probe_are_refused(make_pair, progress):
    config = LongContextConfig(cpu=SMALL.cpu.model_copy(update={"lengths": (128, 130)}))
    with pytest.raises(ValueError, match="bucket 130 is not past the context so far"):
        run(config, make_pair(), progress)


def test_a_drifting_standard_beside_widens_the_state_bound(make_pair, tiny_model, progress):
    """The KDA state drift that fails beside nothing passes beside a standard that drifts as much."""
    pair = make_pair()
    drifting = DecodePath("drifting-kda", partial(DispatchedEngine, tiny_model, ops=DriftingKDA.for_model(tiny_model)))
    twin = DecodePath("drifting-kda-2", partial(DispatchedEngine, tiny_model, ops=DriftingKDA.for_model(tiny_model)))
    result = run(SMALL, replace(pair, candidate=drifting, standard=twin), progress)
    assert result.status == Status.PASSED, result.failed_checks
    state = checks(result)["KDA state relative error"]
    assert state.value > SMALL.cpu.state_rtol and "yardstick" in state.detail
    rows = result.tables[0].rows
    for row in rows:
        assert row[9] == pytest.approx(SMALL.cpu.slack * max(r[10] for r in rows)) and row[8] == pytest.approx(row[10])
    drift_plot, state_plot = result.plots  # per bucket, candidate beside standard, the bound drawn
    assert state_plot.categories == [str(r[0]) for r in rows] and state_plot.bound == state.bound
    assert state_plot.series == {"candidate": [r[8] for r in rows], "standard": [r[10] for r in rows]}
    assert drift_plot.series["standard"] == [r[4] for r in rows]


def answer(drift: float) -> _Answer:
    """Logits that differ from zeros by `drift` in one entry, and a state of norm 1."""
    return _Answer(logits=[torch.zeros(8).index_fill(0, torch.tensor([3]), drift)], states={1: torch.ones(1)})


@pytest.mark.parametrize("cand_drifts, passed", [((1.95, 2.0), True), ((1.95, 3.5), False)])
def test_drift_bound_is_the_standards_worst_bucket(tiny_tokenizer, cand_drifts, passed):
    """A routing flip (drift ~2) hit the standard in the first bucket only and the candidate in both: as precise
    as the standard. Past slack x the standard's worst, it is not."""
    budget = SMALL.cpu
    probes = [_Probe(context, 0, "X", [answer(0.0), answer(c), answer(s)])
              for context, c, s in zip((128, 320), cand_drifts, (1.9, 0.1))]
    buckets = _buckets(probes, budget, tiny_tokenizer)
    assert [b.drift_bound for b in buckets] == [pytest.approx(budget.slack * 1.9)] * 2
    assert all(b.drift <= b.drift_bound for b in buckets) is passed
