"""Decode paths: which ops each runs, the shared model's dispatcher left alone, the known-bad twin, the
k3-layer configs and random models the GPU evals use, and how run_eval records paths that cannot run."""

from __future__ import annotations

import pytest
import torch

from gates.evals import EvalGate, run_eval, single_threaded_on_cpu
from gates.evals.paths import DecodePath, RouteSwap, RoutingTap, backend_path, perturbed
from gates.evals.result import EvalResult, Status
from gates.evals.sampling import SamplingConfig
from gates.evals.subject import first_layers, load_pair, random_model
from model.kimi_k3.config import ConfigError, preset
from model.kimi_k3.ops.registry import OPS, Op
from tests.gates.fixtures.helpers import CPU_EXAMPLE_CONTRACTS

PROMPT = [5, 17, 300, 42]


def decode(path, steps=3):
    session = path.session(len(PROMPT) + steps)
    logits = [session.feed(PROMPT)]
    for t in range(steps):
        logits.append(session.feed([int(logits[-1].argmax())]))
    return torch.stack(logits)


def test_reference_path_runs_reference_ops_only(make_pair, monkeypatch):
    """Give kda_decode a standard implementation: the standard path calls it, the reference path never does."""
    calls = []

    def standard(*args):
        calls.append(1)
        return OPS["kda_decode"].reference(*args)

    monkeypatch.setattr(Op, "standard", lambda op, gpu: standard if op.name == "kda_decode" else op.reference)
    pair = make_pair()
    decode(pair.reference)
    assert calls == []
    decode(pair.candidate)
    assert len(calls) == 3 * 6  # 3 decode steps x 6 KDA layers


def test_paths_agree_exactly_on_cpu_and_leave_the_model_dispatcher(make_pair, tiny_model):
    ops = tiny_model.ops
    pair = make_pair()
    assert torch.equal(decode(pair.reference), decode(pair.candidate))
    assert tiny_model.ops is ops


def test_perturbed_scales_logits(make_pair):
    pair = make_pair()
    base, bad = decode(pair.candidate), decode(perturbed(pair.candidate))
    torch.testing.assert_close(bad, base * 1.05)
    assert perturbed(pair.candidate).name == "auto*1.05"


def test_kda_states_are_the_sessions(make_pair, tiny_cfg):
    session = make_pair().reference.session(8)
    session.feed(PROMPT)
    states = session.kda_states()
    assert sorted(states) == [i for i in range(tiny_cfg.num_hidden_layers) if not tiny_cfg.is_mla_layer(i)]
    assert all(s.shape == (4, 32, 32) and s.abs().sum() > 0 for s in states.values())
    assert session.length == len(PROMPT)
    before = {layer: s.clone() for layer, s in states.items()}
    session.feed([5])
    assert all(torch.equal(states[layer], before[layer]) for layer in states)  # a snapshot, not a live view
    assert not all(torch.equal(s, before[layer]) for layer, s in session.kda_states().items())


def test_backends(tiny_model):
    """latency_specialized runs the contracted CPU kernel (the CPU example's AttnRes) where its envelope holds, and
    counts it; with the repository's contracts nothing is validated on cpu, so every op runs its standard."""
    path = backend_path(tiny_model, "latency_specialized", contracts_dir=CPU_EXAMPLE_CONTRACTS)
    session = path.session(8)
    session.feed(PROMPT)
    session.feed([5])
    assert session.engine.ops.report()["ops"]["attn_res"]["specialized"] > 0
    repository = backend_path(tiny_model, "latency_specialized").session(8)
    repository.feed(PROMPT)
    repository.feed([5])
    assert all(op["specialized"] == 0 for op in repository.engine.ops.report()["ops"].values())
    with pytest.raises(ValueError, match="unknown decode backend 'fast'"):
        backend_path(tiny_model, "fast")
    only = backend_path(tiny_model, "latency_specialized", only=["attn_res"], contracts_dir=CPU_EXAMPLE_CONTRACTS)
    assert only.name == "latency_specialized[attn_res]"
    with pytest.raises(ValueError, match="no contract for op\\(s\\) nope"):
        backend_path(tiny_model, "latency_specialized", only=["nope"])


def test_a_path_over_an_fp8_mla_cache(tiny_model):
    path = backend_path(tiny_model, "auto", kv_cache_dtype="fp8")
    session = path.session(8)
    session.feed(PROMPT)
    session.feed([5])
    assert path.name == "auto (fp8 MLA cache)" and session.engine.cache.kv_fp8
    assert session.engine.ops.report()["ops"]["mla_decode_fp8"]["standard"] > 0


def test_a_routing_tap_records_every_position_and_moe_layer(make_pair, tiny_cfg):
    """Keys are the reference formula on the router's input, one [E] row per position per MoE layer; a rejected
    draft's position is recorded again when it is decoded again."""
    tap = RoutingTap()
    session = make_pair().reference.session(16, tap)
    session.feed(PROMPT)
    session.verify([7, 8, 9])
    session.keep(1)
    session.feed([8])
    moe_layers = sum(map(tiny_cfg.is_moe_layer, range(tiny_cfg.num_hidden_layers)))
    assert moe_layers > 0 and sorted(tap.keys) == list(range(len(PROMPT) + 3))
    assert all(len(layers) == moe_layers and all(k.shape == (tiny_cfg.num_experts,) for k in layers)
               for layers in tap.keys.values())
    assert all(((k >= -1e3) & torch.isfinite(k)).all() for layers in tap.keys.values() for k in layers)


def test_a_swapped_router_choice_changes_that_position_and_later_ones_only(make_pair):
    pair, position = make_pair(), len(PROMPT) + 1
    plain, tap = decode(pair.reference, steps=4), RoutingTap(RouteSwap(position, 0))
    session = pair.reference.session(len(PROMPT) + 4, tap)
    logits = [session.feed(PROMPT)]
    for t in range(4):
        logits.append(session.feed([int(plain[t].argmax())]))
    swapped = torch.stack(logits)
    assert tap.swapped == 1
    assert torch.equal(swapped[:2], plain[:2]) and not torch.allclose(swapped[2], plain[2])


def test_run_eval_records_a_crashing_path(make_pair, progress):
    def crash(max_len):
        raise RuntimeError("boom")

    result = run_eval("sampling", make_pair(DecodePath("broken", crash)), progress)
    assert result.status == Status.ERROR and result.reason == "RuntimeError: boom"
    assert "paths: broken vs reference" in result.notes


def test_run_eval_reports_what_the_candidate_ran_during_it(make_pair, tiny_model, progress):
    """The "what ran" table counts the candidate dispatcher's calls during this eval only (not before it): the
    contracted CPU kernel (the CPU example's AttnRes) by its specialized calls, each fallback by its reason."""
    candidate = backend_path(tiny_model, "latency_specialized", contracts_dir=CPU_EXAMPLE_CONTRACTS)
    decode(candidate)  # calls before the eval are not the eval's
    once = candidate.dispatch_counts()["attn_res"]
    assert once["specialized"] > 0 and once["fallbacks"]

    def run(config, paths, progress):
        decode(paths.candidate)
        return EvalResult(name="decode", status=Status.PASSED)

    result = run_eval("decode", make_pair(candidate), progress, gate=EvalGate("decode", run, SamplingConfig, "3 steps"))
    (table,) = [t for t in result.tables if t.title.startswith("what ran")]
    rows = {(row[0], row[1]): row[2:] for row in table.rows}
    fallbacks = ", ".join(f"{reason}: {n}" for reason, n in sorted(once["fallbacks"].items()))
    assert rows["latency_specialized", "attn_res"] == [once["specialized"], once["standard"], fallbacks]
    assert all(path == "latency_specialized" for path, _ in rows)  # the reference path is not counted
    assert run_eval("decode", make_pair(DecodePath("no dispatcher", candidate.make_engine)), progress,
                    gate=EvalGate("decode", run, SamplingConfig, "3 steps")).tables == []


def test_first_layers_keeps_every_dimension():
    k3 = preset("k3")
    cut = first_layers(k3, 4)
    assert cut.num_hidden_layers == 4 and cut.mla_layer_ids == [3] and cut.linear_attn_config.kda_layers == [1, 2, 3]
    same = {"num_hidden_layers", "linear_attn_config"}
    assert cut.model_dump(exclude=same) == k3.model_dump(exclude=same)
    assert first_layers(k3, 93) == k3
    with pytest.raises(ConfigError, match="--layers: 0 outside 1..93"):
        first_layers(k3, 0)


def test_k3_shapes_are_refused_on_cpu():
    with pytest.raises(ConfigError, match="need a GPU"):
        load_pair("auto", preset_name="k3", device="cpu")


def test_preset_weights_are_the_checkpoints(tiny_model, tiny_cfg):
    """The evals' in-memory preset model has exactly the weights `ckpt make` writes for the seed."""
    drawn = random_model(tiny_cfg, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    for (name, p), (_, q) in zip(drawn.named_parameters(), tiny_model.named_parameters()):
        assert torch.equal(p, q), name


def test_cpu_evals_run_single_threaded_and_restore():
    before = torch.get_num_threads()
    with single_threaded_on_cpu(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_a_rank_subject_has_rank_layers_and_the_whole_vocabulary(tiny_cfg):
    """tp=2: the layers (and so the caches and the kernels' shapes) are rank 0's of TP2, equal to the slices of the
    whole model's weights; the embedding and the logits span the vocabulary; reference and standard paths agree."""
    whole = random_model(tiny_cfg, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    rank = random_model(tiny_cfg, seed=0, device=torch.device("cpu"), dtype=torch.float32, tp=2)
    assert rank.tp.size == 2 and all(layer.self_attn.tp.size == 2 for layer in rank.layers)
    assert torch.equal(rank.vocab.lm_head, whole.vocab.lm_head)
    in_proj = [m.in_proj for m in rank.modules() if hasattr(m, "in_proj")]
    assert in_proj and all(p.shape[0] < q.in_proj.shape[0] for p, q in
                           zip(in_proj, [m for m in whole.modules() if hasattr(m, "in_proj")]))
    pair = load_pair("auto", preset_name="tiny", device="cpu", tp=2)
    assert pair.model.tp.size == 2 and pair.model.vocab.lm_head.shape[0] == tiny_cfg.vocab_size
