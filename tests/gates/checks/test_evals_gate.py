"""The evals gate on CPU: the CPU example's attn_res kernel runs in the sandbox's child, the statistics here."""

from pathlib import Path

import pytest

from gates.checks import evals
from gates.core.status import Status
from gates.evals.long_context import LongContextConfig
from gates.evals.sampling import SamplingConfig
from gates.evals.structured import StructuredConfig
from kernels.contract import load_contract
from tests.gates.fixtures.helpers import CPU_EXAMPLE as ATTN_RES
from tests.gates.fixtures.helpers import run_gate

SMALL = {
    "sampling": SamplingConfig(cpu=SamplingConfig().cpu.model_copy(update={"positions": 4, "samples": 2048})),
    "structured": StructuredConfig(cpu=StructuredConfig().cpu.model_copy(update={"schemas": ("enum",)})),
    "long_context": LongContextConfig(cpu=LongContextConfig().cpu.model_copy(
        update={"lengths": (128, 320), "decode_steps": 3, "prefill_chunk": 128})),
}


@pytest.fixture(autouse=True)
def small_budgets(monkeypatch):
    monkeypatch.setattr(evals, "configs", lambda device: SMALL)


def test_the_kernel_runs_only_in_the_sandbox(monkeypatch):
    """Broken in this process, the kernel still passes: every call the gate counted ran in the child."""
    import model.kimi_k3.specialized.attn_res_fused as fused

    contract = load_contract(ATTN_RES)
    name = contract.implementation.split(":")[1]
    monkeypatch.setattr(fused, name, lambda *a, **k: pytest.fail("the kernel ran in the gate's process"))
    result = run_gate(evals.GATE, contract, ATTN_RES)
    assert result.status is Status.PASSED, result.reason
    assert result.details["kernel_calls"]["specialized"] > 0
    assert {n: r["status"] for n, r in result.details["evals"].items()} == dict.fromkeys(SMALL, "PASSED")


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
    assert kda["layers"] == evals.GPU_LAYERS and kda["preset_name"] == "k3" and kda["tp"] == 1
    assert mla["layers"] == fp8["layers"] == 4 and (mla_cache, fp8_cache) == ("auto", "fp8")
    cpu, cpu_cache = evals.eval_subject(load_contract(Path("contracts/mla_decode_fp8.yaml")), gpu=False)
    assert cpu["preset_name"] == "tiny" and cpu["layers"] is None and cpu_cache == "fp8"
