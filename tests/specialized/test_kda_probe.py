"""The dependency-chain probe (model/kimi_k3/specialized/kda_decode/probe.py) reads and writes what it claims:
its stores equal the same formula in torch, only the slots' state rows change, and every v_split (and the persistent
grid) covers every row. A probe that skipped a load or a store would time less than the step moves and understate
the bound."""

from __future__ import annotations

import pytest
import torch

from gates.problems.kda_decode import make_case
from model.kimi_k3.specialized.kda_decode.probe import available, chain_probe

PROBE_OK, PROBE_WHY = available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not PROBE_OK, reason=f"probe needs Triton and a GPU: {PROBE_WHY}")]


def probe_in_torch(case, slots):
    """The probe's stores computed in torch: new state rows [B, H, K, K] and out [B, P]."""
    cols, w = case.cols, case.w
    h, k = cols.heads, cols.head_dim
    fa = case.proj[:, cols.f_a].float()  # [B, R]
    decay = (fa @ w.f_b.float().T).view(-1, h, k)  # [B, H, K]
    win = case.conv_state[slots].float().sum(-1).view(-1, 3, h, k)  # [B, 3, H, K]
    s = case.ssm_state[slots] * (decay + win[:, 0] + win[:, 1])[:, :, None, :] + win[:, 2][..., None]
    return s, s.sum(-1).reshape(len(slots), -1).to(torch.bfloat16)


@pytest.mark.parametrize("heads,batch,flow", [(12, 1, {"v_split": 4}), (12, 4, {"v_split": 2}), (6, 3, {"v_split": 1}),
                                              (12, 2, {"v_split": 8}), (12, 64, {"persistent": 1, "stages": 2}),
                                              (6, 5, {"persistent": 2, "stages": 1})])
def test_probe_stores_what_it_loaded(heads, batch, flow):
    case = make_case(heads, batch, device="cuda", seed=batch)
    slots = case.slots
    want_state, want_out = probe_in_torch(case, slots)
    before = case.ssm_state.clone()
    out = chain_probe(*case.args(), **flow)
    torch.cuda.synchronize()
    torch.testing.assert_close(case.ssm_state[slots], want_state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    others = torch.ones(case.ssm_state.shape[0], dtype=torch.bool, device="cuda")
    others[slots] = False
    assert torch.equal(case.ssm_state[others], before[others]), "the probe wrote outside the slots' rows"
