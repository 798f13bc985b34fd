"""The accuracy eval's machinery on the tiny random model (the trained checkpoint's own runs are in
tests/adversarial/test_accuracy_bites.py): the standard path passes against the reference, a kernel registered by
`kernel_path` is the one that runs, margins come from the calibration, and random weights are not judged."""

from __future__ import annotations

import json

import pytest

from gates.cli import main
from gates.evals import accuracy, run_eval
from gates.evals.accuracy import AccuracyConfig, Floors, Items, calibrate, kernel_path, margins, measure
from gates.evals.paths import backend_path
from gates.evals.result import Status
from model.kimi_k3.train.data import Tasks

SMALL = AccuracyConfig().cpu.model_copy(update={"recall_lengths": (48, 64), "recall_per_length": 2, "recall_pairs": 4,
                                                "json_prompts": 2, "json_max_tokens": 12, "short_prompts": 2,
                                                "draws": 64, "recency_lengths": (64,), "recency_per_length": 2,
                                                "recency_keys": 2, "window_length": 64, "window_prompts": 2})


@pytest.fixture(scope="module")
def small():
    return AccuracyConfig(cpu=SMALL)


def test_standard_against_reference_passes_with_every_metric(make_pair, progress, small):
    result = run_eval(accuracy.NAME, make_pair(), progress, small, accuracy.GATE)
    assert result.status is Status.PASSED, result.failed_checks
    names = {c.name for c in result.checks}
    assert {"recall@48", "recall_nll@64", "json_valid", "json_fields@spec3", "pick_tv@T0.7", "pick_draws_tv",
            "arith_p@T1"} <= names
    assert result.tables[0].columns[:4] == ["metric", "reference", "standard", "candidate"]


def test_a_registered_kernel_is_the_one_that_runs(tiny_model, tiny_tokenizer, progress):
    path = kernel_path(tiny_model, "kda_decode", "tests.adversarial.broken_decode:decay_scaled", "decay")
    tasks = Tasks(tiny_tokenizer, tiny_model.cfg)
    items = Items.draw(tasks, SMALL, 0)
    broken = measure(path, tasks, items, SMALL, progress)
    reference = measure(backend_path(tiny_model, "reference"), tasks, items, SMALL, progress)
    calls = path.dispatch_counts()["kda_decode"]
    assert calls["specialized"] > 0 and not calls["fallbacks"]
    assert broken["recall_nll@64"] != reference["recall_nll@64"]


def test_version_2_items_add_their_metrics_and_change_no_other(tiny_model, tiny_tokenizer, progress):
    """A data version 2 checkpoint's items add recency and window scores (fed in their own batch); the version 1
    metrics come out the same as without them."""
    tasks, path = Tasks(tiny_tokenizer, tiny_model.cfg), backend_path(tiny_model, "reference")
    v1 = measure(path, tasks, Items.draw(tasks, SMALL, 0), SMALL, progress)
    v2 = measure(path, tasks, Items.draw(tasks, SMALL, 0, data_version=2), SMALL, progress)
    assert set(v2) - set(v1) == {"recency@64", "recency_nll@64", "window@64", "window_nll@64"}
    assert {k: v2[k] for k in v1} == v1
    assert 0 <= v2["window@64"] <= 1 and v2["recency_nll@64"] > 0


def test_margins_are_the_larger_of_floor_and_calibration():
    measured = calibrate([{"recall@64": 0.5, "pick_tv@T1": 0.2}, {"recall@64": 0.6, "pick_tv@T1": 0.1}],
                         [{"recall@64": 0.45, "pick_tv@T1": 0.2}, {"recall@64": 0.6, "pick_tv@T1": 0.1}], slack=2.0)
    assert measured["recall@64"]["margin"] == pytest.approx(0.1) and measured["pick_tv@T1"]["margin"] == 0
    budget = SMALL.model_copy(update={"floors": Floors(accuracy=0.05, nll=0.01, tv=0.03)})
    assert margins(budget, measured, measured) == pytest.approx({"recall@64": 0.1, "pick_tv@T1": 0.03})


def test_a_likelihood_is_judged_either_way_and_a_score_one_way():
    """A mean NLL further than the margin from the reference's fails whether it rose or fell (a perturbed
    recurrence moves it either way item by item); a score or a distance fails only for the worse."""
    reference = {"window_nll@256": 1.5, "recall@128": 0.9, "pick_tv@T1": 0.3}
    margin = {"window_nll@256": 1e-5, "recall@128": 0.05, "pick_tv@T1": 0.01}

    def failed(**candidate):
        checks, _ = accuracy.judge(reference, {**reference, **candidate}, margin)
        return [c.name for c in checks if not c.passed]

    assert failed(**{"window_nll@256": 1.5 - 3e-5}) == failed(**{"window_nll@256": 1.5 + 3e-5}) == ["window_nll@256"]
    assert failed(**{"window_nll@256": 1.5 - 5e-6}) == []
    assert failed(**{"recall@128": 1.0, "pick_tv@T1": 0.1}) == []  # better scores pass
    assert failed(**{"recall@128": 0.8, "pick_tv@T1": 0.32}) == ["recall@128", "pick_tv@T1"]


def test_random_weights_are_not_judged(capsys):
    code = main(["eval", "--preset", "tiny", "--only", "accuracy", "--json"])
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert code == 0 and result["status"] == "NOT_RUN" and "trained checkpoint" in result["reason"]


@pytest.mark.parametrize("options", [["--budget", "gate"], ["--dtype", "bfloat16"]])
def test_the_cli_refuses_a_calibration_off_its_own_budget_and_dtype(options, capsys, tmp_path):
    """calibration.json holds a device kind's margins at the eval's own budget and dtype: a calibration measured on
    the gate's items or a bf16 run on a CPU must not replace them (one line, before any model loads)."""
    assert accuracy.main([*options, "--calibrate", "--json", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --calibrate") and "\n" not in err and not (tmp_path / "a.json").exists()


def test_the_gate_budget_is_the_evals_gates_own():
    from gates.checks.evals import accuracy_config

    gpu = accuracy_config("cuda", accuracy.TRAINED_CKPT)
    assert gpu.gpu == accuracy.GATE_GPU_BUDGET and gpu.cpu == AccuracyConfig().cpu
    assert max(accuracy.GATE_GPU_BUDGET.recall_lengths) < max(AccuracyConfig().gpu.recall_lengths)
