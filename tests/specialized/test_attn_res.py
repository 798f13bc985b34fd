"""attn_res's CuTe DSL kernel (model/kimi_k3/specialized/attn_res/).

CPU: the config heuristic, the argument checks (one line each, naming what is wrong), the compile for sm_90a without
spills, with the loads the design promises (every source's chunks in flight at once, then read again for the mix).
GPU: the gate problem's inputs (every distribution, m = 1..9 sources, T = 1..64, the verify step's 8 positions a
sequence) against the reference in fp32 within one bf16 rounding, repeated launches bit for bit, T = 0, and a CUDA
graph replay.
"""

from __future__ import annotations

import pytest
import torch

from gates.problems import sample
from kernels.cute import cutlass_available, ptx_instruction_counts
from model.kimi_k3.ops.attn_res import attn_res
from model.kimi_k3.specialized.attn_res import AttnResConfig, check_args, config_for
from model.kimi_k3.specialized.attn_res.kernel import MAX_SOURCES, VEC

D = 7168  # K3's hidden size
EPS = 1e-5


def inputs(m: int, t: int, dist: str = "normal", seed: int = 0, d: int = D, device: str = "cpu"):
    """m sources [t, d] of `dist` and weights that make the scores of order one (the gate problem's draw)."""
    gen = torch.Generator().manual_seed(seed)
    sources = [sample((t, d), dist, gen, torch.bfloat16).to(device) for _ in range(m)]
    norm_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)
    proj_w = (torch.randn(1, d, generator=gen) * d**-0.5).to(torch.bfloat16).to(device)
    return sources, norm_w, proj_w


# --- CPU ---------------------------------------------------------------------------------------------------------

def test_config_heuristic():
    cfg = config_for(D)
    assert cfg == AttnResConfig(chunks_per_thread=2) and cfg.threads(D) == 448
    assert config_for(4096).threads(4096) == 512 and config_for(256).threads(256) == 32
    with pytest.raises(ValueError, match="hidden 128: no whole-warp CTA"):
        AttnResConfig.for_shape(128)
    with pytest.raises(ValueError, match="sources 10"):
        cfg.check(MAX_SOURCES + 1, D)


@pytest.mark.parametrize("case, message", [
    (lambda s, n, p: ([], n, p), "0 sources: 1..9"),
    (lambda s, n, p: (s * 5, n, p), "10 sources: 1..9"),
    (lambda s, n, p: ([s[0].float(), s[1]], n, p), "must be bf16"),
    (lambda s, n, p: ([s[0], s[1][:, :4096]], n, p), "must share one shape"),
    (lambda s, n, p: (s, n[:4096], p), "norm_w [D] and proj_w [1, D]"),
    (lambda s, n, p: ([s[0].t().contiguous().t(), s[1]], n, p), "must be contiguous"),
    (lambda s, n, p: ([t[:, :128].contiguous() for t in s], n[:128], p[:, :128]), "hidden 128"),
    (lambda s, n, p: (s, n, p), "must be CUDA tensors"),
])
def test_check_args_refuses(case, message):
    sources, norm_w, proj_w = inputs(2, 3)
    with pytest.raises(ValueError) as err:
        check_args(*case(sources, norm_w, proj_w))
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def _report(m: int, d: int = D):
    from model.kimi_k3.specialized.attn_res.kernel import compile_report

    return compile_report(config_for(d), m, d)


@pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL not installed")
@pytest.mark.parametrize("m", [1, 2, 9])
def test_compiles_for_sm90a_without_spills(m):
    """One kernel; no spills at any m (m = 9 sources in fp32 would not fit the register file: they stay packed);
    every source's chunks loaded by 16-byte loads before the scores, the weights once, the sources once more for the
    mix, the mix stored by 16-byte stores; two barriers."""
    c = config_for(D).chunks_per_thread
    assert memory_traffic(_report(m), m) == {"ld16": c * (2 * m + 2), "st16": c, "bar": 2, "local": 0}
    assert VEC * c * config_for(D).threads(D) == D


def memory_traffic(report, m: int) -> dict[str, int]:
    """The one kernel's 16-byte global loads and stores, barriers and local-memory accesses in its PTX, after
    checking it spills nothing (both attn_res kernels' compile tests)."""
    (k,) = report.kernels
    print(f"m={m}: {k.registers} registers, {k.spill_bytes} B spills")
    assert k.spill_bytes == 0 and k.stack_frame_bytes == 0 and k.registers <= 128
    return ptx_instruction_counts(report.ptx, {
        "ld16": r"\bld\.global(?:\.\w+)*\.v4\.b32\b", "st16": r"\bst\.global(?:\.\w+)*\.v4\.b32\b",
        "bar": r"\bbar\.sync\b", "local": r"\b(?:ld|st)\.local\b"})


# --- GPU ---------------------------------------------------------------------------------------------------------

def _kernel():
    from model.kimi_k3.specialized import attn_res

    ok, why = attn_res.available()
    if not ok:
        pytest.skip(why)
    return attn_res.attn_res_cute


def check_close(got: torch.Tensor, args: tuple) -> None:
    """Within one bf16 rounding of the reference's mix kept in fp32 (the kernel sums in another order before it
    rounds), plus fp32 reordering noise on the sources' scale where the mix cancels."""
    sources, norm_w, proj_w = args
    exact = attn_res([s.float() for s in sources], norm_w, proj_w, EPS)
    scale = max(float(s.float().abs().max()) for s in sources)
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-5 * scale + 1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed", "large", "mixed"])
@pytest.mark.parametrize("m", [1, 2, 5, 9])
@pytest.mark.parametrize("t", [1, 7, 64])
def test_matches_reference(t, m, dist):
    kernel = _kernel()
    sources, norm_w, proj_w = inputs(m, t, dist, seed=31 * t + m, device="cuda")
    got = kernel(sources, norm_w, proj_w, EPS)
    assert got.dtype == torch.bfloat16 and got.shape == (t, D)
    check_close(got, (sources, norm_w, proj_w))
    assert torch.equal(got, kernel(sources, norm_w, proj_w, EPS))  # deterministic


@pytest.mark.gpu
def test_verify_step_tokens_and_zero_tokens():
    """A verify step scores every draft position (64 sequences x 8 positions = 512 tokens); T = 0 launches nothing."""
    kernel = _kernel()
    sources, norm_w, proj_w = inputs(9, 512, seed=5, device="cuda")
    check_close(kernel(sources, norm_w, proj_w, EPS), (sources, norm_w, proj_w))
    empty = [s[:0] for s in sources]
    assert kernel(empty, norm_w, proj_w, EPS).shape == (0, D)


@pytest.mark.gpu
def test_graph_replay_reads_the_sources_at_replay_time():
    kernel = _kernel()
    sources, norm_w, proj_w = inputs(4, 3, seed=9, device="cuda")
    kernel(sources, norm_w, proj_w, EPS)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(sources, norm_w, proj_w, EPS)
    fresh, _, _ = inputs(4, 3, seed=10, device="cuda")
    for s, f in zip(sources, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernel(sources, norm_w, proj_w, EPS))
    check_close(out, (sources, norm_w, proj_w))
