"""Every implementation of every op that takes cache slots or block tables takes them as int32 or int64 (serving
engines keep state indices and block tables in int32) and gives the same result: the references on CPU, the GPU
standards on the H200."""

from __future__ import annotations

import pytest
import torch

from gates.problems.kda_decode import make_case
from model.kimi_k3.ops.registry import OPS

SLOT_DTYPES = (torch.int32, torch.int64)


def _kda_run(fn, dtype, device):
    case = make_case(12 if device == "cuda" else 2, 3, device=device, seed=5, slot_dtype=dtype,
                     head_dim=128 if device == "cuda" else 16, rank=128 if device == "cuda" else 16)
    out = fn(*case.args())
    return out, case.conv_state, case.ssm_state


def _mla_args(dtype, device, heads=4, lora=32, rope=8, nope=16, v=16, pages=6, page_size=4):
    gen = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    batch = 3
    table = torch.tensor([[4, 1], [0, 5], [2, 3]], dtype=dtype, device=device)  # [B, max_blocks] of 4-row pages
    return (r(batch, heads, nope), r(batch, heads, rope), r(pages, page_size, lora + rope), table,
            torch.tensor([7, 3, 5], dtype=dtype, device=device), r(heads, nope, lora), r(heads, v, lora), 0.1)


def _kda_verify_args(dtype):
    case = make_case(2, 2, seed=7, slot_dtype=dtype, head_dim=16, rank=16)
    proj = torch.stack([case.proj, case.proj.flip(0)], dim=1)  # [B, 1 + K, W], K = 1
    spec_conv = case.conv_state.new_zeros(case.conv_state.shape[0], 2, *case.conv_state.shape[1:])
    spec_ssm = case.ssm_state.new_zeros(case.ssm_state.shape[0], 2, *case.ssm_state.shape[1:])
    return proj, case.conv_state, case.ssm_state, case.slots, case.w, spec_conv, spec_ssm


def test_kda_decode_reference():
    (o32, c32, s32), (o64, c64, s64) = (_kda_run(OPS["kda_decode"].reference, d, "cpu") for d in SLOT_DTYPES)
    assert torch.equal(o32, o64) and torch.equal(c32, c64) and torch.equal(s32, s64)


def test_kda_verify_reference():
    outs = [OPS["kda_verify"].reference(*_kda_verify_args(d)) for d in SLOT_DTYPES]
    assert torch.equal(*outs)


def test_mla_decode_reference():
    outs = [OPS["mla_decode"].reference(*_mla_args(d, "cpu")) for d in SLOT_DTYPES]
    assert torch.equal(*outs)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["kda_decode", "mla_decode"])
def test_gpu_standards_take_both_slot_dtypes(op):
    std = OPS[op].standard(gpu=True)
    if op == "kda_decode":
        results = [_kda_run(std, d, "cuda") for d in SLOT_DTYPES]
        for a, b in zip(*results):
            assert torch.equal(a, b)
    else:
        outs = [std(*_mla_args(d, "cuda")) for d in SLOT_DTYPES]
        assert torch.equal(*outs)
