"""The evals gate on CPU: the CPU example's attn_res kernel runs in the sandbox's child, the statistics here; the
accuracy eval on the trained mini-K3 where the kernel's envelope covers it."""

from pathlib import Path

import pytest
import yaml

from gates.checks import evals
from gates.core.status import Status
from gates.evals import accuracy
from gates.evals.long_context import LongContextConfig
from gates.evals.sampling import SamplingConfig
from gates.evals.structured import StructuredConfig
from kernels.contract import load_contract
from tests.adversarial.broken_decode import BROKEN
from tests.gates.fixtures.helpers import CPU_EXAMPLE as ATTN_RES
from tests.gates.fixtures.helpers import run_gate

SMALL = {
    "sampling": SamplingConfig(cpu=SamplingConfig().cpu.model_copy(update={"positions": 4, "samples": 2048})),
    "structured": StructuredConfig(cpu=StructuredConfig().cpu.model_copy(update={"schemas": ("enum",)})),
    "long_context": LongContextConfig(cpu=LongContextConfig().cpu.model_copy(
        update={"lengths": (128, 320), "decode_steps": 3, "prefill_chunk": 128})),
}


# the accuracy eval's CPU budget cut to one short bucket a family (the items drawn differ from the full budget's)
ACCURACY_CUTS = {"recall_lengths": (64,), "recall_per_length": 2, "json_prompts": 2, "json_max_tokens": 24,
                 "short_prompts": 2, "draws": 64, "recency_lengths": (128,), "recency_per_length": 2,
                 "recency_keys": 3}
FULL_ACCURACY = evals.accuracy_config
needs_checkpoint = pytest.mark.skipif(accuracy.default_ckpt() is None,
                                      reason=f"no trained checkpoint at {accuracy.TRAINED_CKPT}")


@pytest.fixture(autouse=True)
def small_budgets(monkeypatch):
    monkeypatch.setattr(evals, "configs", lambda device: SMALL)

    def small(device, ckpt):
        config = FULL_ACCURACY(device, ckpt)
        return config.model_copy(update={"cpu": config.cpu.model_copy(update=ACCURACY_CUTS)})

    monkeypatch.setattr(evals, "accuracy_config", small)


def kda_contract(tmp_path: Path, implementation: str, heads: list[int], head_dim: list[int]) -> Path:
    """A kda_decode contract validated on the CPU at TP1 in fp32 for these local shapes: the tiny preset's (4 heads
    of 32) and, with 6 of 128, the trained mini-K3's."""
    data = {"schema_version": 1, "op": "kda_decode", "description": "a KDA decode step judged on the CPU",
            "implementation": implementation, "reference": "model.kimi_k3.ops.kda_decode:kda_decode",
            "standard": "model.kimi_k3.ops.kda_decode_standard:kda_decode_standard", "backend": "torch",
            "replaces": ["kda_decode"], "hardware": {"validated": [{"arch": "cpu", "devices": ["cpu"]}]},
            "tp_sizes": [1], "batch": {"min": 1, "max": 64}, "spec_tokens": {"min": 0, "max": 7},
            "dtypes": {"activations": "fp32", "weights": "fp32", "ssm_state": "fp32"},
            "shapes": {"heads": heads, "head_dim": head_dim}, "fallback": "standard",
            "tolerance": {"atol": 1e-5, "rtol": 1e-5, "max_rel_l2": 1e-5},
            "benchmark": {"points": [{"batch": 1}], "required_speedup": 1.0}, "owners": ["gates-tests"]}
    path = tmp_path / "kda_decode.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_kernel_runs_only_in_the_sandbox(monkeypatch):
    """Broken in this process, the kernel still passes: every call the gate counted ran in the child."""
    import model.kimi_k3.specialized.attn_res_fused as fused

    contract = load_contract(ATTN_RES)
    name = contract.implementation.split(":")[1]
    monkeypatch.setattr(fused, name, lambda *a, **k: pytest.fail("the kernel ran in the gate's process"))
    result = run_gate(evals.GATE, contract, ATTN_RES)
    assert result.status is Status.PASSED, result.reason
    assert result.details["kernel_calls"]["specialized"] > 0
    evals_run = result.details["evals"]
    if accuracy.default_ckpt() is None:
        assert evals_run.pop(accuracy.NAME)["applies"] is False
    else:  # the mini-K3's hidden size is in the example's envelope: its accuracy eval ran the kernel in the child
        assert evals_run[accuracy.NAME]["applies"] and evals_run[accuracy.NAME]["kernel_calls"]["specialized"] > 0
    assert {n: r["status"] for n, r in evals_run.items()} == dict.fromkeys([*SMALL, accuracy.NAME], "PASSED")


@needs_checkpoint
def test_a_subtly_wrong_kernel_fails_on_accuracy(tmp_path, monkeypatch):
    """The KDA decay scaled by 1.01: at the full CPU budget's items the trained checkpoint's windowed count sees it
    in the gate (candidate in the child; +3.2e-4 nats against a 1e-5 floor), as `python -m gates.evals.accuracy`
    does in one process. (The cut budget's other window items moved it by -1.5e-6, a pass: train/NOTES.md.)"""
    monkeypatch.setattr(evals, "accuracy_config", FULL_ACCURACY)
    path = kda_contract(tmp_path, BROKEN["decay_x1.01"][1], heads=[4, 6], head_dim=[32, 128])
    result = run_gate(evals.GATE, load_contract(path), path)
    scored = result.details["evals"][accuracy.NAME]
    assert scored["status"] == "FAILED_EVAL" and scored["applies"], scored.get("reason")
    assert any(c["name"].startswith("window_nll") for c in scored["checks"] if not c["passed"])
    assert result.status is Status.FAILED_EVAL and "accuracy: FAILED_EVAL" in result.reason


@needs_checkpoint
def test_accuracy_does_not_judge_a_kernel_the_checkpoint_never_runs(tmp_path):
    """A kernel contracted for the tiny preset's KDA heads only: the eval model chooses it, the checkpoint (6 heads
    of 128) never does, so its accuracy row says so and the gate's verdict is the other evals'."""
    path = kda_contract(tmp_path, "model.kimi_k3.ops.kda_decode:kda_decode", heads=[4], head_dim=[32])
    result = run_gate(evals.GATE, load_contract(path), path)
    scored = result.details["evals"][accuracy.NAME]
    assert (scored["status"], scored["applies"]) == ("NOT_RUN", False)
    assert "outside this kernel's envelope" in scored["reason"]
    assert result.status is Status.PASSED, result.reason


def test_a_candidate_that_tampers_is_an_error():
    contract = load_contract(ATTN_RES).model_copy(
        update={"implementation": "tests.adversarial.patches_timer:kda_decode"})
    result = run_gate(evals.GATE, contract, ATTN_RES)
    assert result.status is Status.ERROR and "replaced time.perf_counter" in result.reason


def test_the_eval_model_reaches_the_kernels_layers_and_cache():
    """A KDA or projection kernel: K3's first GPU_LAYERS layers. An op of the MLA cache: through K3's first MLA
    layer (layer 3), and an fp8 cache's op over an fp8 cache. On the CPU the tiny preset, whose MLA layers come
    early."""
    kda, _ = evals.eval_subject(load_contract(Path("contracts/kda_decode.yaml")), gpu=True)
    mla, mla_cache = evals.eval_subject(load_contract(Path("contracts/mla_decode.yaml")), gpu=True)
    fp8, fp8_cache = evals.eval_subject(load_contract(Path("contracts/mla_decode_fp8.yaml")), gpu=True)
    assert kda["layers"] == evals.GPU_LAYERS and kda["preset_name"] == "k3" and kda["tp"] == 8  # serving TP, not 1
    assert mla["layers"] == fp8["layers"] == 4 and (mla_cache, fp8_cache) == ("auto", "fp8")
    cpu, cpu_cache = evals.eval_subject(load_contract(Path("contracts/mla_decode_fp8.yaml")), gpu=False)
    assert cpu["preset_name"] == "tiny" and cpu["layers"] is None and cpu_cache == "fp8"


@pytest.mark.gpu
@needs_checkpoint
def test_on_the_gpu_the_kda_kernel_is_judged_on_the_trained_checkpoint(monkeypatch):
    """The contracted KDA decode kernel (6 local heads of 128 at TP1 are in its envelope) runs the accuracy eval in
    the sandbox's child in bf16, beside the reference and the standard; the K3-shape evals are left out here (their
    model is loaded, no eval runs on it) and the accuracy budget is cut to one short bucket a family."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setattr(evals, "configs", lambda device: {})

    def small(device, ckpt):
        config = FULL_ACCURACY(device, ckpt)
        cuts = {**ACCURACY_CUTS, "recall_pairs": 8, "window_prompts": 4, "window_length": 256}
        return config.model_copy(update={"gpu": config.gpu.model_copy(update=cuts)})

    monkeypatch.setattr(evals, "accuracy_config", small)
    path = Path("contracts/kda_decode.yaml")
    result = run_gate(evals.GATE, load_contract(path), path)
    scored = result.details["evals"][accuracy.NAME]
    assert scored["applies"] and scored["kernel_calls"]["specialized"] > 0, scored
    assert scored["status"] == "PASSED", scored.get("reason")
    assert any("standard's own distance" in n for n in scored["notes"])
