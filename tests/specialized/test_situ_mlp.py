"""situ_mlp's specialized path (model/kimi_k3/specialized/situ_mlp/): the SiTU launch between two GEMMs.

CPU: the config heuristic, the argument checks (one line each, naming what is wrong), the SiTU kernel's compile for
sm_90a without spills, with the loads the design promises (the gate's and the up projection's chunk, 16 bytes each,
one 16-byte store). GPU: SiTU against the reference's fp32 arithmetic within one bf16 rounding; the whole MLP against
the reference at one token (the GEMV), a batch and a verify step's tokens (cuBLAS) within bf16 tolerance, for the
shared experts at TP8 / TP16 and dense layer 0 at TP8; repeated calls bit for bit; T = 0; a CUDA graph replay.
"""

from __future__ import annotations

import pytest
import torch

from gates.problems import sample
from kernels.cute import cutlass_available, ptx_instruction_counts
from model.kimi_k3.ops.situ_mlp import situ, situ_mlp
from model.kimi_k3.specialized.situ_mlp import SituConfig, check_args, config_for
from model.kimi_k3.specialized.situ_mlp.kernel import VEC

D = 7168  # K3's hidden size
BETA, BETA_LIN = 4.0, 25.0  # K3's activation_situ_beta, activation_situ_linear_beta
SHARED_TP8, SHARED_TP16, DENSE_TP8 = 768, 384, 4224  # rank-local intermediate sizes


def inputs(t: int, i: int, dist: str = "normal", seed: int = 0, device: str = "cpu"):
    """x [t, D] of `dist`, weights drawn like trained ones (std 1/sqrt(fan-in))."""
    gen = torch.Generator().manual_seed(seed)
    x = sample((t, D), dist, gen, torch.bfloat16).to(device)
    gate_up = (torch.randn(2 * i, D, generator=gen) * D**-0.5).to(torch.bfloat16).to(device)
    down = (torch.randn(D, i, generator=gen) * i**-0.5).to(torch.bfloat16).to(device)
    return x, gate_up, down


# --- CPU ---------------------------------------------------------------------------------------------------------

def test_config_heuristic():
    """One CTA a token of whole warps covering I / 8 chunks, up to 256 threads; more CTAs a token beyond."""
    assert config_for(SHARED_TP8) == SituConfig(96) and SituConfig(96).ctas_per_token(SHARED_TP8) == 1
    assert config_for(SHARED_TP16) == SituConfig(64)
    assert config_for(DENSE_TP8) == SituConfig(256) and SituConfig(256).ctas_per_token(DENSE_TP8) == 3
    with pytest.raises(ValueError, match="intermediate 12"):
        SituConfig(32).check(12)
    with pytest.raises(ValueError, match="threads 48"):
        SituConfig(48).check(768)


@pytest.mark.parametrize("case, message", [
    (lambda x, g, d: (x.float(), g, d), "must be bf16"),
    (lambda x, g, d: (x, g[:100], d), "gate_up must be [2I, D]"),
    (lambda x, g, d: (x[:, :4096], g, d), "gate_up must be [2I, D]"),
    (lambda x, g, d: (x, g[:48], d[:, :24]), "I=24 must be a positive multiple of 32"),
    (lambda x, g, d: (x.t().contiguous().t(), g, d), "must be contiguous"),
    (lambda x, g, d: (x, g, d), "must be CUDA tensors"),
])
def test_check_args_refuses(case, message):
    x, gate_up, down = inputs(3, 64)
    with pytest.raises(ValueError) as err:
        check_args(*case(x, gate_up, down))
    assert message in str(err.value), str(err.value)


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
@pytest.mark.parametrize("i", [SHARED_TP8, SHARED_TP16, DENSE_TP8])
def test_situ_compiles_for_sm90a_without_spills(i):
    from model.kimi_k3.specialized.situ_mlp import compile_report

    (k,) = compile_report(config_for(i), i).kernels
    assert k.spill_bytes == 0 and k.stack_frame_bytes == 0 and k.registers <= 64, k
    counts = ptx_instruction_counts(compile_report(config_for(i), i).ptx, {
        "ld16": r"\bld\.global(?:\.\w+)*\.v4\.b32\b", "st16": r"\bst\.global(?:\.\w+)*\.v4\.b32\b",
        "local": r"\b(?:ld|st)\.local\b", "bar": r"\bbar\.sync\b"})
    assert counts == {"ld16": 2, "st16": 1, "local": 0, "bar": 0}, counts
    assert i % VEC == 0


# --- GPU ---------------------------------------------------------------------------------------------------------

def _module():
    from model.kimi_k3.specialized import situ_mlp as module

    ok, why = module.available()
    if not ok:
        pytest.skip(why)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed", "large", "mixed"])
@pytest.mark.parametrize("t", [1, 5, 512])
def test_situ_matches_the_reference_arithmetic(t, dist):
    """Within one bf16 rounding of the reference's SiTU kept in fp32 (tanh and exp to a few fp32 ulps)."""
    module = _module()
    gen = torch.Generator().manual_seed(7 * t)
    g = sample((t, 2 * SHARED_TP8), dist, gen, torch.bfloat16).cuda()
    got = module.situ(g, BETA, BETA_LIN)
    a, b = g.float().chunk(2, dim=-1)
    want = BETA * torch.tanh(a / BETA) * torch.sigmoid(a) * (BETA_LIN * torch.tanh(b / BETA_LIN))
    assert got.dtype == torch.bfloat16 and got.shape == (t, SHARED_TP8)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(got, situ(*g.chunk(2, dim=-1), BETA, BETA_LIN), rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("i", [SHARED_TP8, SHARED_TP16, DENSE_TP8])
@pytest.mark.parametrize("t", [1, 4, 64, 512])
def test_matches_reference(t, i):
    """The reference accumulates both products in fp32 and rounds each to bf16, as the GEMMs here do."""
    module = _module()
    x, gate_up, down = inputs(t, i, seed=t + i, device="cuda")
    got = module.situ_mlp_cute(x, gate_up, down, BETA, BETA_LIN)
    want = situ_mlp(x, gate_up, down, BETA, BETA_LIN)
    assert got.dtype == torch.bfloat16 and got.shape == (t, D)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < 1e-2, rel
    assert torch.equal(got, module.situ_mlp_cute(x, gate_up, down, BETA, BETA_LIN))  # deterministic


@pytest.mark.gpu
def test_zero_tokens_and_graph_replay():
    module = _module()
    x, gate_up, down = inputs(1, SHARED_TP8, seed=3, device="cuda")
    assert module.situ_mlp_cute(x[:0], gate_up, down, BETA, BETA_LIN).shape == (0, D)
    module.situ_mlp_cute(x, gate_up, down, BETA, BETA_LIN)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module.situ_mlp_cute(x, gate_up, down, BETA, BETA_LIN)
    x.copy_(inputs(1, SHARED_TP8, seed=4, device="cuda")[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, module.situ_mlp_cute(x, gate_up, down, BETA, BETA_LIN))
