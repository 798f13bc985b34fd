"""`bench layer` and `bench step` on the tiny preset on CPU: the same code path as on the H200 (layers built from
bindings, random weights in checkpoint formats, op calls recorded and costed, both backends, reference checks),
untimed. The timed runs are GPU tests."""

from __future__ import annotations

import pytest
import torch

from model.kimi_k3.bench.cli import add_commands
from model.kimi_k3.bench.layers import build_layer, layer_bytes, layer_ids, planned_bytes, standard_copy_bytes
from model.kimi_k3.bench.run import (
    DECLARED,
    HEADROOM_BYTES,
    BenchError,
    batch_points,
    bench_layers,
    bench_step,
    bytes_between_turns,
    dispatcher,
    fit_weight_sets,
    schedule,
    set_order,
    speculative_tokens_per_step,
)
from model.kimi_k3.cache import ModelCache
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
    assert {"linear", "rms_norm", "attn_res_norm"} <= set(checks)
    assert all(c["ok"] for c in checks.values())


def test_floors_off_a_gpu_are_at_the_declared_bandwidth_and_say_so(cfg):
    """CI's tiny shapes have no GPU to measure: every row's floor is at sm_90's declared figure, and the row says
    which figure and that it was declared, not measured."""
    from kernels.arch import known

    (layer,) = bench_layers(cfg, "kda", tp=1, batch=1, context=4, count=1, backends=["auto"], device=CPU)
    (step,) = bench_step(cfg, tp=1, batch=1, context=4, spec_tokens=0, acceptance=1.0, backends=["auto"],
                         device=CPU, kda_sets=1, mla_sets=1)
    declared = known("sm_90").mem_bw_Bps
    for row in (layer, step):
        assert row.floor_bandwidth_Bps == declared
        assert row.floor_bandwidth_source == "declared for sm_90 (NVIDIA H200); no GPU measured it"
    assert layer.floor_us == pytest.approx(layer.bytes / declared * 1e6)
    assert step.floor_ms == pytest.approx(step.bytes / declared * 1e3)


def test_floors_on_a_gpu_are_at_its_copy_bandwidth_measured_once(monkeypatch):
    """On a GPU the floors are at the copy bandwidth measured on that very device (an H100 copies ~2.98 TB/s where
    sm_90's declared figure is the H200's 4.3), measured once per process and device: every row of a run is at the
    same figure, and no later point pays the 2 GiB measurement again."""
    from model.kimi_k3.bench import run

    measured = []
    monkeypatch.setattr(run.arch_info, "measure_copy_bandwidth", lambda index: measured.append(index) or 2.98e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA H100 80GB HBM3 #{index}")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    run._measured_bandwidth.cache_clear()
    try:
        first = run.floor_bandwidth(torch.device("cuda", 0))
        assert run.floor_bandwidth(torch.device("cuda", 0)) is first
        other = run.floor_bandwidth(torch.device("cuda", 1))
    finally:
        run._measured_bandwidth.cache_clear()
    assert measured == [0, 1]
    assert first == run.FloorBandwidth(2.98e12, "measured on NVIDIA H100 80GB HBM3 #0")
    assert other.source == "measured on NVIDIA H100 80GB HBM3 #1"


def test_an_mla_layer_over_an_fp8_cache(cfg):
    """kv_cache_dtype "fp8": the cache in e4m3 (half a bf16 one's bytes), decoded by mla_decode_fp8,
    whose cost counts its one-byte entries; the row says which cache it timed."""
    lid = layer_ids(cfg, "mla")[0]
    fp8 = build_layer(cfg, lid, tp_size=1, batch=2, context=8, device=CPU, seed=0, kv_cache_dtype="fp8")
    assert all(t.dtype == torch.float8_e4m3fn for t in fp8.cache.kv.values())
    assert (planned_bytes(cfg, lid, 1, 2, 8) - planned_bytes(cfg, lid, 1, 2, 8, kv_cache_dtype="fp8")
            == sum(t.numel() for t in fp8.cache.kv.values()))  # one byte an entry element, not two
    (row,) = bench_layers(cfg, "mla", tp=1, batch=2, context=8, count=1, backends=["auto"], device=CPU,
                          kv_cache_dtype="fp8")
    (bf16,) = bench_layers(cfg, "mla", tp=1, batch=2, context=8, count=1, backends=["auto"], device=CPU)
    assert row.kv_cache == "fp8" and row.dispatch["mla_decode_fp8"]["standard"] > 0 and "mla_decode" not in row.dispatch
    assert row.bytes < bf16.bytes and row.output_rel_l2 < 2e-2


@pytest.mark.parametrize("kind, blocks", [("kda", {"attn_res", "attention", "moe"}),
                                          ("mla", {"attn_res", "attention", "moe"}),
                                          ("dense", {"attn_res", "attention", "mlp"})])
def test_a_layer_row_splits_its_bytes_per_block(cfg, kind, blocks):
    """Each op call is charged to the block of the layer it ran in: the blocks' bytes add up to the layer's, each
    with its floor at the row's bandwidth; off a GPU nothing is traced, so no block has a time."""
    (row,) = bench_layers(cfg, kind, tp=1, batch=2, context=4, count=2, backends=["auto"], device=CPU)
    assert set(row.blocks) == blocks
    assert sum(b["bytes"] for b in row.blocks.values()) == pytest.approx(row.bytes)
    for b in row.blocks.values():
        assert b["us"] is None and b["kernels"] is None and b["bytes"] > 0
        assert b["floor_us"] == pytest.approx(b["bytes"] / row.floor_bandwidth_Bps * 1e6)


def test_each_call_is_charged_to_the_innermost_block_running(cfg):
    """The MoE's router, experts, latent norm and shared experts count to the MoE; KDA's recurrence and its
    projections to attention; the mixes with their input norms (attn_res_norm) to AttnRes; and outside a tracked
    layer, to 'other'."""
    from model.kimi_k3.bench.run import target
    from model.kimi_k3.bench.trace import OTHER, tracking_blocks

    bl = build_layer(cfg, layer_ids(cfg, "kda")[1], tp_size=1, batch=2, context=4, device=CPU, seed=0)
    ops = dispatcher("auto", target(1, CPU))
    ops.begin_step(bl.step)
    ops.record()
    with tracking_blocks(ops, [bl.layer]):
        bl.run(ops)
    bl.run(ops)  # the hooks are gone: every call is outside any block
    n = len(ops.calls) // 2
    inside = {}
    for (name, _, _), block in zip(ops.calls[:n], ops.call_blocks[:n]):
        inside.setdefault(name, set()).add(block)
    assert inside["moe_route"] == inside["moe_experts"] == inside["situ_mlp"] == {"moe"}
    assert inside["kda_decode"] == {"attention"} and inside["attn_res_norm"] == {"attn_res"}
    assert inside["rms_norm"] == {"moe"} and inside["linear"] == {"attention", "moe"}  # the latent norm
    assert ops.call_blocks[n:] == [OTHER] * n and ops.block == OTHER


def test_a_kernel_belongs_to_the_innermost_range_holding_its_start():
    from model.kimi_k3.bench.trace import _innermost

    ranges = [(0.0, 100.0, "attn_res"), (10.0, 40.0, "attention"), (50.0, 90.0, "moe")]
    assert [_innermost(t, ranges, "other") for t in (5.0, 10.0, 40.0, 45.0, 60.0, 95.0, 150.0)] == [
        "attn_res", "attention", "attention", "attn_res", "moe", "attn_res", "other"]


@pytest.mark.gpu
def test_a_traced_layer_splits_its_kernels_per_block_on_the_gpu(cfg):
    """On a GPU every kernel of the eager trace lands in a block of its layer (none outside: 'other' is absent),
    the MoE's shared experts (a side stream) in the MoE; the blocks hold the same kernels as the ops and glue do;
    the floors are at the bandwidth measured on this device."""
    cuda = torch.device("cuda")
    for row in bench_layers(cfg, "kda", tp=1, batch=2, context=4, count=2, backends=["auto", "latency_specialized"],
                            device=cuda, iters=3):
        assert row.floor_bandwidth_source.startswith("measured on ") and 1e11 < row.floor_bandwidth_Bps < 2e13
        assert set(row.blocks) == {"attn_res", "attention", "moe"}, row.blocks
        assert sum(b["kernels"] for b in row.blocks.values()) == pytest.approx(
            sum(o["kernels"] for o in row.ops.values()))
        assert sum(b["us"] for b in row.blocks.values()) == pytest.approx(sum(o["us"] for o in row.ops.values()))
        assert row.blocks["moe"]["kernels"] >= row.ops["situ_mlp"]["kernels"] + row.ops["moe_route"]["kernels"]
        assert all(b["us"] > 0 and b["bytes"] > 0 for b in row.blocks.values())


def test_an_op_outside_its_envelope_falls_back_and_is_counted(cfg):
    """No repository contract validates the cpu arch: on this machine the KDA kernel (validated on the H200 only)
    falls back for the arch at every call, and each is counted."""
    rows = bench_layers(cfg, "kda", tp=1, batch=1, context=4, count=1, backends=["latency_specialized"], device=CPU)
    kda = rows[0].dispatch["kda_decode"]
    assert kda["specialized"] == 0 and kda["fallbacks"].get("arch", 0) == kda["standard"] > 0


def test_a_kernel_that_raises_in_a_bench_is_named_not_hidden():
    """A specialized kernel that raises falls back to the standard, which is then what the row timed: the tally
    keeps what it said and the bench prints it (and exits 1), where a table alone showed a quietly slower backend
    (the first H200 `bench layer --kind mla`: every mla_decode call refused the model's strided views)."""
    from types import SimpleNamespace

    from model.kimi_k3.bench.run import kernel_errors, tally_decisions
    from model.kimi_k3.dispatch import Fallback, Reason

    said = "q_nope, q_pe, kv_cache, slots, lengths, w_uk and w_uv must be contiguous"
    tally = tally_decisions([("mla_decode", False, Fallback(Reason.ERROR, said)), ("linear", True, None),
                             ("mla_decode", False, Fallback(Reason.ERROR, said)),
                             ("attn_res", False, Fallback(Reason.DTYPE, "fp32 only"))])
    assert tally["mla_decode"] == {"specialized": 0, "standard": 2, "fallbacks": {"error": 2}, "errors": [said]}
    assert "errors" not in tally["attn_res"] and tally["linear"]["specialized"] == 1
    row = SimpleNamespace(backend="declared", batch=16, dispatch=tally)
    assert kernel_errors([row]) == [f"declared batch 16: mla_decode's specialized kernel raised, so the standard ran "
                                    f"and was timed: {said}"]


def test_the_declared_backend_counts_kernels_that_only_declare_the_arch():
    """`declared` runs the kernels of contracts that list this arch as declared (counted validated, as the gate's
    own evals count it) beside the validated ones; latency_specialized runs only validated ones; neither takes a
    kernel of another arch. Every sm_90 kernel is validated today, so GB300's sm_100 (declared by most contracts,
    validated by none) shows the declared-only case."""
    from model.kimi_k3.dispatch import Target

    def runnable(backend: str, target: Target) -> set[str]:  # the ops whose kernels it imported to run
        return {op for op, s in dispatcher(backend, target).specialized.items() if s.fn is not None}

    h200 = Target("sm_90", "NVIDIA H200", 8, torch.bfloat16)
    validated = runnable("latency_specialized", h200)
    assert {"kda_decode", "linear", "moe_experts", "mla_decode", "moe_route"} <= validated
    assert validated <= runnable(DECLARED, h200)
    gb300 = Target("sm_100", "NVIDIA GB300", 8, torch.bfloat16)
    assert runnable("latency_specialized", gb300) == set()
    declared = dispatcher(DECLARED, gb300).specialized
    assert {"kda_decode", "linear", "mla_decode", "moe_route"} <= set(declared) and "moe_experts" not in declared
    assert all("sm_100" in s.contract.archs_validated for s in declared.values())
    other = Target("sm_120", "a GPU no contract names", 8, torch.bfloat16)
    assert dispatcher(DECLARED, other).specialized == {}


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


def test_a_step_makes_the_mla_block_table_once_as_the_model_does(cfg, monkeypatch):
    """The step's layers share one StepBatch and one pass: its MLA layers read the table the first made (one
    more is made when each MLA weight set's bytes are recorded, a layer run alone)."""
    assert sum(kind == "mla" for kind in schedule(cfg)) >= 2
    made = []
    block_table = ModelCache.block_table
    monkeypatch.setattr(ModelCache, "block_table", lambda self, slots: made.append(1) or block_table(self, slots))
    bench_step(cfg, tp=1, batch=2, context=4, spec_tokens=0, acceptance=1.0, backends=["auto"], device=CPU,
               kda_sets=2, mla_sets=1)
    assert len(made) == 2


GiB = 1 << 30
# run 13's H100 (80 GB): one weight set's bytes at K3 TP8, batch 64, context 8K (planned_bytes + the standard's
# repacked experts), and what the device had free after batch 1 had run in the same process
K3_TP8_BATCH64 = {"dense": int(0.3232 * GiB), "kda": int(3.9531 * GiB), "mla": int(4.4448 * GiB)}
ASKED = {"dense": 1, "kda": 8, "mla": 3}


def test_step_sets_that_fit_are_built_as_asked():
    assert fit_weight_sets(ASKED, K3_TP8_BATCH64, int(60 * GiB)) == ASKED  # 45.3 GiB + 8 of headroom


def test_step_sets_that_do_not_fit_are_fewer_kda_first():
    """Run 13's case: 8 KDA and 3 MLA sets need 45.3 GiB, 32.3 GiB were free. Sets come off the kind with the most,
    one at a time (KDA 8 -> 3), then at a tie off the larger set (MLA), until the rest and the headroom fit."""
    assert fit_weight_sets(ASKED, K3_TP8_BATCH64, int(32.3 * GiB)) == {"dense": 1, "kda": 3, "mla": 2}
    assert fit_weight_sets(ASKED, K3_TP8_BATCH64, int(40 * GiB)) == {"dense": 1, "kda": 4, "mla": 3}
    one_each = sum(K3_TP8_BATCH64.values()) + HEADROOM_BYTES
    assert fit_weight_sets(ASKED, K3_TP8_BATCH64, one_each) == {"dense": 1, "kda": 1, "mla": 1}
    with pytest.raises(BenchError, match=r"one weight set of each kind \(dense, kda, mla\) needs 8.7 GiB; 16.0 GiB "
                                         r"are free \(keep 8 GiB headroom\)"):
        fit_weight_sets(ASKED, K3_TP8_BATCH64, one_each - 1 - int(0.7 * GiB))


def test_a_step_that_does_not_fit_cycles_fewer_sets_and_says_why(cfg, monkeypatch):
    """bench_step builds the sets fit_weight_sets leaves of what the device holds (free bytes faked here: the CPU has
    no limit), records them in the row and says in its progress why they are fewer than asked."""
    from model.kimi_k3.bench import run

    lid = {kind: layer_ids(cfg, kind)[0] for kind in ASKED}
    set_bytes = {k: planned_bytes(cfg, lid[k], 1, 2, 4) + standard_copy_bytes(cfg, lid[k], 1) for k in ASKED}
    free = HEADROOM_BYTES + set_bytes["dense"] + 2 * set_bytes["kda"] + 2 * set_bytes["mla"]
    monkeypatch.setattr(run, "free_device_bytes", lambda device: free)
    said = []
    (row,) = bench_step(cfg, tp=1, batch=2, context=4, spec_tokens=0, acceptance=1.0, backends=["auto"], device=CPU,
                        kda_sets=3, mla_sets=2, progress=said.append)
    assert row.weight_sets == fit_weight_sets({"dense": 1, "kda": 3, "mla": 2}, set_bytes, free)
    assert row.weight_sets == {"dense": 1, "kda": 2, "mla": 2}
    assert any("2 KDA and 2 MLA weight sets, not 3 and 2: those need" in line and "GiB are free" in line
               for line in said)


def test_bytes_between_two_turns_of_a_weight_set():
    """From one turn of a set to its next the device reads the turn's layer and every layer between; a set's last
    turn is followed by its first in the next step, the head between."""
    kinds = ["dense", "kda", "kda", "mla", "kda"]
    assert set_order(kinds, {"dense": 1, "kda": 2, "mla": 1}) == [("dense", 0), ("kda", 0), ("kda", 1), ("mla", 0),
                                                                  ("kda", 0)]
    layer = {"dense": 1.0, "kda": 10.0, "mla": 100.0}
    assert bytes_between_turns(kinds, {"dense": 1, "kda": 2, "mla": 1}, layer, head_bytes=1000.0) == 120.0
    assert bytes_between_turns(kinds, {"dense": 1, "kda": 1, "mla": 1}, layer, head_bytes=1000.0) == 10.0
    assert bytes_between_turns(["kda"], {"kda": 1}, layer, head_bytes=5.0) == 15.0  # a step of one layer


def test_free_bytes_count_what_an_earlier_point_left_cached(monkeypatch):
    """Before fitting, the caching allocator's blocks and the experts' standard's repacked weight sets (kept until
    its cache is cleared) are released, so an earlier point's layers count as free."""
    from model.kimi_k3.bench import run
    from model.kimi_k3.ops import moe_experts_standard as standard

    calls = []
    monkeypatch.setattr(standard, "clear_cache", lambda: calls.append("clear_cache"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append("mem_get_info") or (5 * GiB, 80 * GiB))
    assert run.free_device_bytes(torch.device("cuda", 0)) == 5 * GiB
    assert calls == ["clear_cache", "empty_cache", "mem_get_info"]
    assert run.free_device_bytes(CPU) is None


def test_bad_requests_are_clear_errors(cfg):
    with pytest.raises(BenchError, match="comma-separated list of positive integers"):
        batch_points("1,x")
    with pytest.raises(BenchError, match="comma-separated list of positive integers"):
        batch_points("0")
    with pytest.raises(BenchError, match="backend 'fast'"):
        bench_layers(cfg, "kda", 1, 1, 4, 1, ["fast"], CPU)


@pytest.mark.parametrize("argv, message", [
    (["layer", "--context", "0"], "--context: 0 is below 1"),
    (["layer", "--context", "-5"], "--context: -5 is below 1"),
    (["layer", "--layers", "0"], "--layers: 0 is below 1"),
    (["layer", "--iters", "x"], "--iters: 'x' is not an integer"),
    (["step", "--spec-tokens", "-1"], "--spec-tokens: -1 is below 0"),
    (["step", "--acceptance", "2"], "--acceptance: 2.0 is not in"),
    (["step", "--mla-sets", "0"], "--mla-sets: 0")])
def test_bad_numbers_are_usage_errors_before_anything_runs(capsys, argv, message):
    """Each used to reach the model and end in a traceback (a zero-length cache, an empty layer list)."""
    from gates.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv, "--preset", "tiny", "--device", "cpu"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("what", ["layer", "step"])
def test_a_tp_size_the_model_cannot_split_names_the_field(capsys, what):
    from gates.cli import main

    assert main(["bench", what, "--preset", "tiny", "--device", "cpu", "--tp", "3", "--batch", "1"]) == 2
    assert "linear_attn_config.num_heads: 4 is not divisible by TP size 3" in capsys.readouterr().err


def test_help_names_every_option(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="what"))
    for what, options in (("layer", ("--kind", "--layers", "--tp", "--batch", "--context", "--backend", "--json",
                                     "--collectives", "--kv-cache-dtype")),
                          ("step", ("--kda-sets", "--mla-sets", "--spec-tokens", "--acceptance"))):
        with pytest.raises(SystemExit):
            parser.parse_args([what, "--help"])
        text = capsys.readouterr().out
        assert all(o in text for o in options)


def test_collectives_rows_beside_the_excluded_ones_over_gloo(tmp_path):
    """`--collectives` on CPU: both ranks over gloo run the same layers with their all-reduces (untimed), and the
    rows say which ran with them."""
    import json

    from gates.cli import main

    argv = ["bench", "layer", "--preset", "tiny", "--device", "cpu", "--tp", "2", "--batch", "1,2", "--layers", "2",
            "--context", "4", "--backend", "auto", "--collectives", "--json", str(tmp_path / "l.json")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert [(r["batch"], r["collectives"]) for r in rows] == [(1, "gloo"), (2, "gloo"), (1, "excluded"),
                                                              (2, "excluded")]
    assert all(r["ranks_us"] == [None, None] for r in rows[:2]) and all(r["ranks_us"] is None for r in rows[2:])
    # the same rank-local work: the bytes agree, and each rank's layer matches its own reference layer
    assert [r["bytes"] for r in rows[:2]] == [r["bytes"] for r in rows[2:]]
    assert all(r["output_rel_l2"] < 2e-2 for r in rows)


@pytest.mark.parametrize("gpus, extra, message", [
    (0, [], "--device cuda: this machine has no CUDA GPU"),
    (1, [], "--collectives: TP2 on cuda needs 2 GPUs (one per rank); 1 visible"),
    (2, ["--device", "cuda:1"], "--collectives: TP2 on cuda:1: rank r runs on cuda:r"),
])
def test_collectives_refuse_clearly_without_a_gpu_per_rank(capsys, monkeypatch, gpus, extra, message):
    from gates.cli import main
    from model.kimi_k3.errors import EXIT_USAGE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert main(["bench", "layer", "--tp", "2", "--collectives", *extra]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err.replace("\n", "") and "Traceback" not in err


def test_the_allreduce_floor_refuses_clearly_without_a_gpu_per_rank(capsys, monkeypatch):
    from model.kimi_k3.bench.allreduce import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["--tp", "2"]) == 2
    assert capsys.readouterr().err == "error: TP2 on cuda needs 2 GPUs (one per rank); 1 visible\n"
    assert main(["--tp", "1"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err
