"""The gate runner keeps a CPU bundle that a new run judges the same (issue 22): `make gate` on a fresh clone
leaves committed CPU evidence byte for byte. Only the contracts gate runs here, which is enough to judge."""

import pytest

from gates.core import runner
from gates.core.registry import registered
from tests.gates.fixtures.helpers import CPU_EXAMPLE_CONTRACTS


@pytest.fixture
def contracts_gate_only(monkeypatch):
    monkeypatch.setattr(runner, "registered", lambda: [g for g in registered() if g.name == "contracts"])


def files(directory) -> dict:
    return {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_a_cpu_run_that_judges_the_same_keeps_the_bundle_byte_for_byte(tmp_path, contracts_gate_only):
    out = tmp_path / "evidence"
    assert runner.gate_all(CPU_EXAMPLE_CONTRACTS, out, ["attn_res"]).kept == []
    before = files(out)
    outcome = runner.gate_all(CPU_EXAMPLE_CONTRACTS, out, ["attn_res"])  # another secret seed, date, seconds
    assert outcome.kept == [out / "attn_res" / "cpu"] and outcome.exit_code == 0
    assert files(out) == before  # the index too


def test_a_run_that_judges_differently_rewrites_the_bundle(tmp_path, contracts_gate_only):
    out = tmp_path / "evidence"
    runner.gate_all(CPU_EXAMPLE_CONTRACTS, out, ["attn_res"])
    outcome = runner.gate_all(CPU_EXAMPLE_CONTRACTS, out, ["attn_res"], runner.new_options(trials=3))
    assert outcome.kept == []
    (_, bundle), = outcome.bundles
    assert runner.load_bundle(out / "attn_res" / "cpu").options.trials == 3 == bundle.options.trials


def test_each_op_is_gated_with_an_empty_compile_cache_of_its_own(monkeypatch):
    """What a gated op's children compile persists only for that op's run: a planted or stale user cache is never
    loaded into it, and the caller's setting comes back afterwards."""
    import os
    from pathlib import Path

    from gates.core.runner import compile_cache_of_its_own
    from kernels.cute import CACHE_ENV, compile_cache_dir

    monkeypatch.setenv(CACHE_ENV, "/somewhere/the/user/keeps/kernels")
    with compile_cache_of_its_own():
        directory = compile_cache_dir()
        assert directory != Path("/somewhere/the/user/keeps/kernels") and directory.is_dir()
        assert not any(directory.iterdir())
    assert not directory.exists() and os.environ[CACHE_ENV] == "/somewhere/the/user/keeps/kernels"
    monkeypatch.delenv(CACHE_ENV)
    with compile_cache_of_its_own():
        pass
    assert CACHE_ENV not in os.environ
