"""The sampling eval passes an identical path and fails known-bad ones, each on the check meant to catch it.

Budgets keep the CPU gate's draws per test (the statistical power lives there) but fewer positions."""

from __future__ import annotations

from dataclasses import replace

from gates.evals.paths import perturbed
from gates.evals.result import Status
from gates.evals.sampling import SamplingConfig, run
from model.kimi_k3.sampling import sample

CPU = SamplingConfig().cpu
SMALL = SamplingConfig(cpu=CPU.model_copy(update={"positions": 6, "sampled_positions": 1}))


def one_setting(temperature, top_p):
    return SamplingConfig(cpu=SMALL.cpu.model_copy(update={"temperatures": (temperature,), "top_ps": (top_p,)}))


def checks(result):
    return {c.name: c for c in result.checks}


def test_identical_path_passes(make_pair, progress):
    result = run(SMALL, make_pair(), progress)
    assert result.status == Status.PASSED, result.failed_checks
    c = checks(result)
    assert c["exact TV"].value == 0 and c["KL at T=1"].value == 0 and c["draws outside top-p"].value == 0
    assert 0 < c["empirical KS"].value < c["empirical KS"].bound
    assert len(result.tables[1].rows) == len(CPU.temperatures) * len(CPU.top_ps)


def test_deterministic_for_a_seed(make_pair, progress):
    config = SamplingConfig(cpu=SMALL.cpu.model_copy(update={"samples": 1024}))
    first = run(config, make_pair(), progress).model_dump()
    assert run(config, make_pair(), progress).model_dump() == first
    assert run(config.model_copy(update={"seed": 1}), make_pair(), progress).model_dump() != first


def test_logits_scaled_by_1_05_fail(make_pair, progress):
    pair = make_pair()
    result = run(SMALL, replace(pair, candidate=perturbed(pair.candidate)), progress)
    assert result.status == Status.FAILED_EVAL
    c = checks(result)
    assert not c["exact TV"].passed and c["exact TV"].value > 20 * CPU.tv_bound
    assert not c["KL at T=1"].passed
    # its sampler draws from the distribution its logits define, within its nucleus: the draws are right, the
    # exact checks are what see the logits are not
    assert c["empirical TV"].passed and c["empirical KS"].passed and c["draws outside top-p"].passed


def test_sampler_ignoring_top_p_fails(make_pair, progress):
    def leaky(logits, temperature, top_p, generators):
        return sample(logits, temperature, 1.0, generators)

    pair = make_pair()
    result = run(one_setting(1.0, 0.95), replace(pair, candidate=replace(pair.candidate, sampler=leaky)), progress)
    c = checks(result)
    assert result.status == Status.FAILED_EVAL and not c["draws outside top-p"].passed
    assert c["exact TV"].passed  # the logits are right; only the sampler is wrong


def test_sampler_at_the_wrong_temperature_fails_on_draws_alone(make_pair, progress):
    def hotter(logits, temperature, top_p, generators):
        return sample(logits, temperature / 1.05, top_p, generators)

    pair = make_pair()
    result = run(one_setting(1.0, 1.0), replace(pair, candidate=replace(pair.candidate, sampler=hotter)), progress)
    c = checks(result)
    assert c["exact TV"].passed and not c["empirical KS"].passed


def test_a_standard_path_beside_sets_the_precision_the_candidate_is_held_to(make_pair, progress):
    """With a yardstick, the bounds are the standard's own distance from the reference (x slack): a candidate as
    far off as a sloppy standard passes; the same candidate beside an exact standard fails."""
    pair = make_pair()
    scaled = perturbed(pair.candidate)
    beside_sloppy = run(SMALL, replace(pair, candidate=scaled, standard=perturbed(pair.candidate)), progress)
    assert beside_sloppy.status == Status.PASSED, beside_sloppy.failed_checks
    c = checks(beside_sloppy)
    assert c["exact TV"].value == beside_sloppy.metrics["standard_tv_max"] > 20 * CPU.tv_bound
    assert c["exact TV"].bound == CPU.slack * beside_sloppy.metrics["standard_tv_max"]
    (plot,) = beside_sloppy.plots  # worst position per (temperature, top-p), the candidate beside the standard
    assert plot.bound == c["exact TV"].bound and max(plot.series["candidate"]) == c["exact TV"].value
    assert [max(plot.series[s]) for s in ("candidate", "standard")] == [c["exact TV"].value] * 2
    beside_exact = run(SMALL, replace(pair, candidate=scaled, standard=pair.candidate), progress)
    assert beside_exact.status == Status.FAILED_EVAL
    assert (not checks(beside_exact)["mean exact TV"].passed
            and "yardstick 0" in checks(beside_exact)["exact TV"].detail)


def test_a_sampler_far_off_fails_its_draws_beside_a_sloppy_standard(make_pair, progress):
    """The draws are held to the distance between the candidate's own exact distribution and the reference's at
    that row, plus sampling noise: a sloppy standard beside (which widens the exact bounds) widens nothing here.
    Right logits, a sampler at twice the temperature: the exact checks pass, the draws fail in TV and KS."""
    def hot(logits, temperature, top_p, generators):
        return sample(logits, temperature * 2, top_p, generators)

    pair = make_pair()
    candidate = replace(pair.candidate, sampler=hot)
    result = run(one_setting(1.0, 1.0), replace(pair, candidate=candidate, standard=perturbed(pair.candidate, 2.0)),
                 progress)
    c = checks(result)
    assert c["exact TV"].passed and c["KL at T=1"].passed
    assert not c["empirical TV"].passed and not c["empirical KS"].passed
    assert c["empirical TV"].bound < 0.1 and c["empirical KS"].bound < 0.1


def test_every_bound_in_the_report_is_the_one_applied_and_can_fail(make_pair, progress):
    """The exact table shows the bound the max-TV check applied (the yardstick's, beside a standard), not the
    budget's absolute one; every draw test's bounds are below 1, so a TV of any sampler can exceed them."""
    pair = make_pair()
    result = run(SMALL, replace(pair, standard=perturbed(pair.candidate)), progress)
    exact, draws = result.tables
    bound = exact.columns.index("max TV bound")
    assert {row[bound] for row in exact.rows} == {checks(result)["exact TV"].bound} != {CPU.tv_bound}
    for column in ("TV bound", "KS bound"):
        assert all(0 < row[draws.columns.index(column)] < 0.1 for row in draws.rows), (column, draws.rows)
