"""KDA reference math: the chunked prefill form, the token recurrence and the decode step agree."""

import pytest
import torch

from model.kimi_k3.ops import kda
from model.kimi_k3.ops.kda_decode import kda_decode


def inputs(t, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = kda.l2_normalize(torch.randn(t, h, d, generator=g)) * d**-0.5
    k = kda.l2_normalize(torch.randn(t, h, d, generator=g))
    v = torch.randn(t, h, d, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(t, h, d, generator=g) * 3)  # log-decays across (-5, 0)
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    s0 = torch.randn(h, d, d, generator=g)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("t,chunk", [(1, 64), (37, 16), (64, 64), (150, 64), (130, 32)])
def test_chunked_equals_recurrent(t, chunk):
    q, k, v, g, beta, s0 = inputs(t, 3, 16)
    o_rec, s_rec = kda.recurrent(q, k, v, g, beta, s0)
    o_chunk, s_chunk = kda.chunked(q, k, v, g, beta, s0, chunk)
    torch.testing.assert_close(o_chunk, o_rec, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_rec, atol=2e-5, rtol=1e-5)


def test_recurrence_matches_its_definition():
    """One hand-written step: S <- S diag(e^g); u = beta (v - S k); S <- S + u k^T; o = S q."""
    q, k, v, g, beta, s0 = inputs(1, 1, 4)
    s = s0[0] * torch.exp(g[0, 0])
    u = beta[0, 0] * (v[0, 0] - s @ k[0, 0])
    s = s + torch.outer(u, k[0, 0])
    o, s_new = kda.recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(o[0, 0], s @ q[0, 0])
    torch.testing.assert_close(s_new[0], s)


def test_decay_gate_is_safe():
    r = torch.randn(5, 2, 8) * 50
    g = kda.decay_gate(r, torch.tensor([0.0, 2.0]), torch.zeros(16), -5.0)
    assert torch.all(g <= 0) and torch.all(g >= -5.0)  # saturates at the bounds, never past them
    mid = kda.decay_gate(torch.zeros(1, 1, 2), torch.zeros(1), torch.zeros(2), -5.0)
    torch.testing.assert_close(mid, torch.full((1, 1, 2), -2.5))


def layer_weights(h, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    p = h * d
    return kda.KDAWeights(
        conv_weight=torch.randn(3 * p, 4, generator=g) * 0.5,
        f_b=torch.randn(p, d, generator=g) / d**0.5,
        A_log=torch.log(torch.rand(h, generator=g) * 15 + 1),
        dt_bias=torch.randn(p, generator=g),
        o_norm=1 + 0.1 * torch.randn(d, generator=g),
        lower_bound=-5.0,
        norm_eps=1e-5,
    )


def test_decode_steps_equal_prefill():
    """Token-by-token decode steps (conv window shifts, recurrent state) equal one chunked prefill."""
    h, d, t = 2, 16, 20
    w = layer_weights(h, d)
    cols = kda.KDAColumns(h, d, d)
    proj = torch.randn(t, cols.width, generator=torch.Generator().manual_seed(2))
    out_prefill, window, state = kda.kda_prefill(proj, torch.zeros(3 * h * d, 4), torch.zeros(h, d, d), w, chunk=8)

    conv_state = torch.zeros(3, 3 * h * d, 4)  # three slots; the sequence lives in slot 2
    ssm_state = torch.zeros(3, h, d, d)
    slot = torch.tensor([2])
    out_decode = torch.cat([kda_decode(proj[i:i + 1], conv_state, ssm_state, slot, w) for i in range(t)])
    torch.testing.assert_close(out_decode, out_prefill, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_state[2], window)
    torch.testing.assert_close(ssm_state[2], state, atol=1e-5, rtol=1e-5)
    assert conv_state[:2].abs().sum() == 0 and ssm_state[:2].abs().sum() == 0  # other slots untouched


def test_conv_uses_newest_tap_last():
    x = torch.tensor([[1.0], [2.0], [3.0]])
    weight = torch.tensor([[0.0, 0.0, 0.0, 1.0]])  # only the current token
    y, window = kda.conv_prefill(x, torch.zeros(1, 4), weight)
    torch.testing.assert_close(y, torch.nn.functional.silu(x))
    assert window.tolist() == [[0.0, 1.0, 2.0, 3.0]]
