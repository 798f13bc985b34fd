"""The candidate path the evals gate builds in its sandbox sees the contract under judgment as valid on the arch
being judged, and nothing else loosened."""

from __future__ import annotations

import torch

from kernels.contract import load_contract
from model.kimi_k3.dispatch import Target, judged_here

H200 = Target("sm_90", "NVIDIA H200", 8, torch.bfloat16)


def test_the_judged_arch_counts_as_validated_and_nothing_else_changes():
    declared = load_contract("contracts/linear.yaml")
    declared = declared.model_copy(update={"hardware": declared.hardware.model_copy(update={"validated": []})})
    judged = judged_here(declared, H200)
    assert judged.archs_validated == ["sm_90"]
    assert [h.arch for h in judged.hardware.declared] == ["sm_100"]
    assert judged.model_dump(exclude={"hardware"}) == declared.model_dump(exclude={"hardware"})


def test_an_arch_already_validated_is_left_as_it_is():
    validated = load_contract("contracts/kda_decode.yaml")
    assert judged_here(validated, Target("sm_90", "NVIDIA H200", 1, torch.bfloat16)) is validated
