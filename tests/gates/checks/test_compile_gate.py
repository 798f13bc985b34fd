"""The compile gate: CuTe DSL kernels compile for every target arch on a CPU machine, within resource bounds."""

import importlib.util

import pytest

from gates.checks import compile as compile_gate
from gates.core.status import Status
from kernels.contract import Resources
from tests.gates.fixtures.helpers import kda_contract, run_gate

needs_cutlass = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                   reason="nvidia-cutlass-dsl not installed "
                                          "(pip install 'nvidia-cutlass-dsl[cu13]==4.8.1')")
FIXTURES = "tests.gates.fixtures"


H200 = {"arch": "sm_90", "devices": ["NVIDIA H200"]}


def cute_contract(implementation: str, archs: list[dict], blocks=(128, 256)):
    return kda_contract(op="reverse_scale", backend="cutedsl", implementation=implementation,
                        shapes={"block": list(blocks)}, benchmark={"points": [{"batch": 1}], "required_speedup": 1.0},
                        hardware={"declared": archs})


@needs_cutlass
def test_every_key_compiles_for_every_arch_with_its_resources(monkeypatch):
    # two processes per arch for three keys (keys 0 and 2 in one, 1 in the other): results still in key order
    monkeypatch.setattr(compile_gate.os, "cpu_count", lambda: 2)
    contract = cute_contract(f"{FIXTURES}.cute_reverse_scale:reverse_scale",
                             [H200, {"arch": "sm_100", "devices": ["NVIDIA GB300"]}], blocks=(128, 256, 512))
    result = run_gate(compile_gate.GATE, contract)
    assert result.status is Status.PASSED, result.reason
    compiles = result.details["compiles"]
    assert [(c["key"], c["arch"], c["target"]) for c in compiles] == [
        (f"('bf16', {b})", a, f"{a}a") for a in ("sm_90", "sm_100") for b in (128, 256, 512)]
    kernels = [k for c in compiles for k in c["kernels"]]
    assert len(kernels) == 6
    assert all(0 < k["registers"] <= 255 and k["shared_bytes"] >= 2 * 128 and k["spill_bytes"] == 0 for k in kernels)


@needs_cutlass
def test_a_kernel_that_does_not_compile_fails_the_gate():
    result = run_gate(compile_gate.GATE, cute_contract(f"{FIXTURES}.cute_broken:scale", [H200]))
    assert result.status is Status.FAILED_COMPILE
    assert "'bf16' on sm_90: ValueError: Type mismatch, store Float32" in result.reason


def test_resource_bounds():
    kernel = {"kernel": "k0", "registers": 168, "spill_bytes": 0, "stack_frame_bytes": 0, "shared_bytes": 99_000}
    compiles = [{"key": "k", "arch": "sm_90", "kernels": [kernel]}, {"key": "k", "arch": "sm_100", "error": "boom"}]
    bounds = Resources(max_registers=128, max_spill_bytes=0, max_shared_bytes=100_000)
    assert compile_gate.resource_violations(compiles, bounds) == ["k on sm_90: k0: registers 168 > max_registers 128"]


def test_torch_backend_has_nothing_to_compile():
    result = run_gate(compile_gate.GATE, kda_contract())
    assert result.status is Status.NOT_RUN and result.reason == "torch backend: nothing to compile"


def test_a_module_without_the_compile_protocol_is_an_error():
    result = run_gate(compile_gate.GATE, kda_contract(backend="triton", hardware={"declared": [H200]}))
    assert result.status is Status.ERROR
    assert result.reason == "tests.gates.fixtures.kda_candidate defines no compile_keys or compile()"
