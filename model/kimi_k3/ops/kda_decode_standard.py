"""KDA decode step, STANDARD implementation: what a strong stock serving engine runs on GPU.

Composed from the best fused kernels existing libraries ship, with the reference's semantics
(`model.kimi_k3.ops.kda_decode.kda_decode`: same signature, layouts, rounding points):

1. FLA `causal_conv1d_update` (SiLU) on the q|k|v columns. FLA's update is batch-indexed, so the
   slots' windows are gathered into a [B, 3P, Wc] buffer first and scattered back after.
2. q, k, v split into contiguous [B, 1, H, K] tensors (one copy), beta logits made contiguous.
3. The f_b GEMM (cuBLAS through torch): r = f_a @ f_b^T, bf16 out.
4. FLA `fused_recurrent_kda_fwd` (the kernel behind `fused_recurrent_kda`; the public wrapper does not
   forward `ssm_state_indices` / in-place state) with the gate, the q/k L2 norm and beta's sigmoid in
   the kernel, `lower_bound`, `A_log`, `dt_bias`, `ssm_state_indices=slots`, in-place final state,
   `state_v_first=True` (state [H, V, K]).
5. FLA's fused gated RMSNorm (`layer_norm_gated_fwd`, is_rms_norm, sigmoid activation) on o with the
   output gate (made contiguous first).

GPU only (FLA's kernels are Triton); `standard_available()` says whether it can run here. Everything is
capturable in a CUDA graph once warmed up (Triton autotuning happens on the first calls).
"""

from __future__ import annotations

import torch

from .kda import KDAColumns, KDAWeights

_FLA = None
_FLA_ERROR: str | None = None


def _load_fla():
    global _FLA, _FLA_ERROR
    if _FLA is None and _FLA_ERROR is None:
        try:
            from fla.modules.causal_conv1d import causal_conv1d_update
            from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

            _FLA = (causal_conv1d_update, fused_recurrent_kda_fwd, layer_norm_gated_fwd)
        except Exception as e:  # ImportError without triton/fla, or a broken install
            _FLA_ERROR = f"fla-core not importable: {type(e).__name__}: {e}"
    return _FLA


def standard_available() -> tuple[bool, str]:
    """(True, 'ok') when the standard composition can run here, else (False, reason)."""
    if not torch.cuda.is_available():
        return False, ("no CUDA device: the standard KDA decode is built from FLA's Triton GPU kernels "
                       "(use the reference on CPU)")
    if _load_fla() is None:
        return False, _FLA_ERROR
    return True, "ok"


def kda_decode_standard(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                        w: KDAWeights) -> torch.Tensor:
    """Same signature and semantics as `kda_decode.kda_decode`; caches updated in place. Returns [B, P].

    Slots may be int32 or int64, as the kernel takes them (serving engines keep state indices in int32)."""
    ok, why = standard_available()
    if not ok:
        raise RuntimeError(f"kda_decode_standard unavailable: {why}")
    if not proj.is_cuda:
        raise RuntimeError("kda_decode_standard needs CUDA tensors")
    causal_conv1d_update, fused_recurrent_kda_fwd, layer_norm_gated_fwd = _FLA
    cols = KDAColumns.of(ssm_state, w)
    b, h, k, p = proj.shape[0], cols.heads, cols.head_dim, cols.p

    # 1. short conv on q|k|v, windows gathered from / scattered to their slots
    window = conv_state.index_select(0, slots)  # [B, 3P, Wc]
    y, _ = causal_conv1d_update(proj[:, cols.qkv], window, weight=w.conv_weight, activation="silu")
    conv_state.index_copy_(0, slots.long(), window)  # index_copy_ takes int64 indices only

    # 2. contiguous q, k, v [B, 1, H, K] and beta logits [B, 1, H]
    qkv = y.view(b, 3, h, k).transpose(0, 1).contiguous()
    q, k_, v = (qkv[i].unsqueeze(1) for i in range(3))
    beta = proj[:, cols.beta].contiguous().unsqueeze(1)

    # 3. f_b GEMM, bf16 out
    r = torch.matmul(proj[:, cols.f_a], w.f_b.t())

    # 4. recurrence, state updated in place in its slots
    o = torch.empty(b, 1, h, k, dtype=proj.dtype, device=proj.device)
    fused_recurrent_kda_fwd(
        q=q, k=k_, v=v, g=r.view(b, 1, h, k), beta=beta, A_log=w.A_log, dt_bias=w.dt_bias,
        initial_state=ssm_state, scale=k ** -0.5, output_final_state=False, inplace_final_state=True,
        state_v_first=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=w.lower_bound, out=o)

    # 5. gated RMSNorm, sigmoid gate
    gate = proj[:, cols.gate].reshape(b * h, k)
    out, *_ = layer_norm_gated_fwd(x=o.view(b * h, k), g=gate, weight=w.o_norm, bias=None, activation="sigmoid",
                                   eps=w.norm_eps, is_rms_norm=True)
    return out.view(b, p)
