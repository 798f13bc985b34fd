"""Block Attention Residuals mix (`attn_res`), STANDARD implementation.

Same signature and semantics as the reference `model.kimi_k3.attn_res.attn_res(sources, norm_w, proj_w, eps)`:
scores l_i = <s_i / rms(s_i), norm_w * proj_w> for the m sources s_i [T, D], softmax over the m sources, the
un-normalized sources mixed with those weights in fp32, the result in the sources' dtype.

The standard is a torch composition: ONE stack of the sources (an [m, T, D] copy in their dtype: m*T*D*2 bytes
for bf16, 129 KB at m=9, T=1 and 8.3 MB at T=64, D=7168), its fp32 copy (twice that), torch's fused `rms_norm`
with the weight norm_w*proj_w (fp32, exact: a product of two bf16 values) and a sum for the scores, a softmax
over the sources and a weighted sum in fp32: about nine kernels. Nothing in it syncs the host;
it is capturable in a CUDA graph and runs on CPU too.

Why not flash-attn-res (0.1.12, the Triton AttnRes kernels). Its decode-time mix is
`flash_attn_res.ops.phase_1.phase_1_batched_attention_triton_op(block_representations [m, B, T, D],
pseudo_queries [Q, D], eps)` -> `phase_1_batched_attention_forward_kernel`, which computes exactly this mix
(rsqrt(sum(v^2)/D + eps) * <v, q>, softmax over the m sources, the normalized weighted sum), but:
1. it indexes the hidden dimension with `tl.arange(0, HIDDEN_DIM)` with HIDDEN_DIM = D, and Triton requires a
   power-of-two arange extent: K3's D = 7168 = 7 * 2**10 does not compile;
2. each program holds the whole [next_pow2(m), D] tile of one token in registers (fp32), 16 x 8192 values
   for m = 9 after padding D, which spills on any GPU;
3. it stores the mix as bfloat16 unconditionally (`.to(tl.bfloat16)`), so sources in another dtype lose
   precision.
`attn_res_flash_padded` below works around 1 (zero-pads D to the next power of two, scales eps by D/Dp and the
query by sqrt(D/Dp) so the scores are unchanged, at the cost of a padded [m, 1, T, Dp] copy of the sources); it
is kept only so the probe can time the library kernel (`probe_standards --flash-attn-res`), not used as the
standard.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F


def standard_available() -> tuple[bool, str]:
    return True, "ok (torch composition: runs on any device)"


def standard_label() -> str:
    return "torch composition: one stack, fp32 math (fused rms_norm for the scores, softmax, weighted sum)"


def attn_res_standard(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """Same signature and semantics as `attn_res.attn_res` -> [T, D] in the sources' dtype."""
    s = torch.stack(sources).float()  # [m, T, D]
    w = norm_w.float() * proj_w.reshape(-1)  # fp32 (bf16 x bf16 is exact in fp32)
    logits = F.rms_norm(s, (s.shape[-1],), weight=w, eps=eps).sum(-1)  # [m, T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * s).sum(0).to(sources[0].dtype)


def flash_attn_res_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device (flash-attn-res is Triton)"
    try:
        importlib.import_module("flash_attn_res.ops.phase_1")
    except Exception as e:  # noqa: BLE001
        return False, f"flash-attn-res not importable: {type(e).__name__}: {e}"
    return True, "ok"


def attn_res_flash_padded(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """flash-attn-res's phase-1 kernel on sources zero-padded to a power-of-two D (see the module docstring).
    bf16 output by construction; for timing the library kernel, not the standard."""
    from flash_attn_res.ops.phase_1 import phase_1_batched_attention_triton_op

    m = len(sources)
    t, d = sources[0].shape
    dp = 1 << (d - 1).bit_length()
    buf = sources[0].new_zeros(m, 1, t, dp)
    buf[:, 0, :, :d] = torch.stack(sources)
    q = torch.zeros(1, dp, dtype=torch.float32, device=buf.device)
    q[0, :d] = norm_w.float() * proj_w.float().reshape(-1) * math.sqrt(d / dp)
    out, _lse = phase_1_batched_attention_triton_op(buf, q, eps * d / dp)
    return out[0, 0, :, :d].to(sources[0].dtype)
