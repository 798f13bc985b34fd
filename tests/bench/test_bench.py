"""`bench layer` and `bench step` on the tiny preset on CPU: the same code path as on the H200 (layers built from
bindings, random weights in checkpoint formats, op calls recorded and costed, both backends, reference checks),
untimed. The timed runs are GPU tests."""

from __future__ import annotations

import pytest
import torch

from model.kimi_k3.bench.cli import add_commands
from model.kimi_k3.bench.layers import build_layer, layer_bytes, layer_ids, planned_bytes
from model.kimi_k3.bench.run import (
    BenchError,
    batch_points,
    bench_layers,
    bench_step,
    schedule,
    speculative_tokens_per_step,
)
from model.kimi_k3.config import preset

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg():
    return preset("tiny")


@pytest.mark.parametrize("kind", ["kda", "mla", "dense"])
def test_layer_rows_for_both_backends(cfg, kind):
    rows = bench_layers(cfg, kind, tp=1, batch=2, context=4, count=2, backends=["auto", "latency_specialized"],
                        device=CPU)
    assert [r.backend for r in rows] == ["auto", "latency_specialized"]
    for r in rows:
        assert r.layers_in_graph == 2 and r.us is None  # untimed off the GPU
        assert r.bytes > 0 and r.floor_us > 0
        assert r.output_rel_l2 < 2e-2
    checks = rows[0].op_checks
    assert {"linear", "rms_norm", "attn_res"} <= set(checks)
    assert all(c["ok"] for c in checks.values())


def test_an_op_outside_its_envelope_falls_back_and_is_counted(cfg):
    """The CPU attn_res kernel's contract takes fp32 activations; the bench's layers run bf16."""
    rows = bench_layers(cfg, "kda", tp=1, batch=1, context=4, count=1, backends=["latency_specialized"], device=CPU)
    attn_res = rows[0].dispatch["attn_res"]
    assert attn_res["specialized"] == 0 and attn_res["fallbacks"].get("dtype", 0) == attn_res["standard"] > 0


def test_layer_bytes_count_only_routed_experts(cfg):
    """Bytes include only the experts the step routes to: a bigger batch touches more of them."""
    one, many = (bench_layers(cfg, "kda", tp=1, batch=b, context=4, count=1, backends=["auto"], device=CPU)[0]
                 for b in (1, 8))
    assert many.bytes > one.bytes


def test_planned_bytes_match_what_a_layer_allocates(cfg):
    lid = layer_ids(cfg, "mla")[0]
    built = build_layer(cfg, lid, tp_size=1, batch=3, context=5, device=CPU, seed=0)
    caches = [*built.cache.kv.values(), *built.cache.conv.values(), *built.cache.ssm.values()]
    assert planned_bytes(cfg, lid, 1, 3, 5) == layer_bytes(built.layer) + sum(t.numel() * t.element_size()
                                                                               for t in caches)


def test_step_covers_every_layer_and_counts_accepted_tokens(cfg):
    rows = bench_step(cfg, tp=1, batch=2, context=4, spec_tokens=3, acceptance=6 / 7, backends=["auto"],
                      device=CPU, kda_sets=2, mla_sets=1)
    (row,) = rows
    assert row.layers == cfg.num_hidden_layers == len(schedule(cfg))
    assert row.tokens_per_step == pytest.approx(speculative_tokens_per_step(3, 6 / 7)) == pytest.approx(1 + 18 / 7)
    assert row.bytes > 0 and row.ms is None


def test_bad_requests_are_clear_errors(cfg):
    with pytest.raises(BenchError, match="comma-separated list of positive integers"):
        batch_points("1,x")
    with pytest.raises(BenchError, match="comma-separated list of positive integers"):
        batch_points("0")
    with pytest.raises(BenchError, match="backend 'fast'"):
        bench_layers(cfg, "kda", 1, 1, 4, 1, ["fast"], CPU)


def test_help_names_every_option(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="what"))
    for what, options in (("layer", ("--kind", "--layers", "--tp", "--batch", "--context", "--backend", "--json")),
                          ("step", ("--kda-sets", "--mla-sets", "--spec-tokens", "--acceptance"))):
        with pytest.raises(SystemExit):
            parser.parse_args([what, "--help"])
        text = capsys.readouterr().out
        assert all(o in text for o in options)
