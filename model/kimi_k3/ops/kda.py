"""Kimi Delta Attention, the math its ops share (SPEC.md §3): plain PyTorch, fp32 where the model is fp32.

The ops are `kda_decode` (ops/kda_decode.py) and `kda_verify` (ops/kda_verify.py); prefill is `kda_prefill` here.

Layouts shared by every implementation (reference, standard, specialized):
- `proj` [T, W]: the packed input projection, columns q | k | v (each P) | g, the output gate (P) |
  f_a (R) | beta logits (H) | zero pad.  P = H*K local heads times head dim, R the gate's low rank.
- `conv_state` [slots, 3P, Wc] in the activation dtype: the last Wc inputs of q|k|v (oldest first), the
  layout of FLA's `causal_conv1d_update` (Wc = short_conv_kernel_size).
- `ssm_state` [slots, H, V, K] fp32 (V-major, as vLLM stores it).
Activation-dtype rounding happens where the served model rounds after f_b (exactly: `gate_input`), on the
recurrence output and on the gated-norm output; the short conv's output stays fp32 (`conv_prefill` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


@dataclass(frozen=True)
class KDAWeights:
    """The per-layer tensors a KDA decode step reads besides the projection."""

    conv_weight: torch.Tensor  # [3P, Wc] fp32, tap Wc-1 multiplies the newest input
    f_b: torch.Tensor  # [P, R] activation dtype
    A_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [P] fp32
    o_norm: torch.Tensor  # [V] fp32
    lower_bound: float
    norm_eps: float


@dataclass(frozen=True)
class KDAColumns:
    """Column ranges of the packed projection for H local heads of dim K and gate rank R."""

    heads: int
    head_dim: int
    rank: int

    @property
    def p(self) -> int:
        return self.heads * self.head_dim

    @property
    def qkv(self) -> slice:
        return slice(0, 3 * self.p)

    @property
    def gate(self) -> slice:
        return slice(3 * self.p, 4 * self.p)

    @property
    def f_a(self) -> slice:
        return slice(4 * self.p, 4 * self.p + self.rank)

    @property
    def beta(self) -> slice:
        start = 4 * self.p + self.rank
        return slice(start, start + self.heads)

    @property
    def width(self) -> int:
        """Packed width, zero-padded to a multiple of 16 as vLLM packs it."""
        return -(-(4 * self.p + self.rank + self.heads) // 16) * 16

    @classmethod
    def of(cls, ssm_state: torch.Tensor, w: KDAWeights) -> "KDAColumns":
        return cls(heads=ssm_state.shape[1], head_dim=ssm_state.shape[3], rank=w.f_b.shape[1])


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def decay_gate(r: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Safe gate: g = lb * sigmoid(exp(A_log[h]) * (r + dt_bias)), a log-decay in (lb, 0). r: [..., H, K]."""
    h, k = r.shape[-2:]
    z = r.float() + dt_bias.float().view(h, k)
    return lower_bound * torch.sigmoid(torch.exp(A_log.float()).view(h, 1) * z)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per head: RMSNorm(o; weight) * sigmoid(gate), in fp32. o, gate: [..., H, V]."""
    of = o.float()
    normed = of * torch.rsqrt((of * of).mean(-1, keepdim=True) + eps) * weight.float()
    return normed * torch.sigmoid(gate.float())


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One decode token per sequence: shift x [B, C] into its slot's window, return SiLU(conv) [B, C] in fp32.

    Updates `conv_state` [slots, C, Wc] in place. The activation stays fp32 (see `conv_prefill`).
    """
    window = torch.cat([conv_state[slots, :, 1:], x.to(conv_state.dtype).unsqueeze(-1)], dim=-1)
    conv_state[slots] = window
    return F.silu((window.float() * weight.float()).sum(-1))


def conv_prefill(x: torch.Tensor, initial: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's T new tokens x [T, C] after the window `initial` [C, Wc] -> (SiLU(conv) [T, C] fp32, window).

    The activation is not rounded to the activation dtype (FLA's conv kernels store it in bf16 between kernels):
    bf16 of an fp32 sum depends on the summation order where the sum lies near a rounding midpoint, and one such
    flip of a v moves a whole state row by beta * ulp(v) * |k| -- in large-magnitude inputs up to 13 tolerance
    units, so a reference rounded there judges a correct kernel by its own summation order (NOTES.md of the
    fused decode kernel, run 15). In fp32 every order agrees to fp32 rounding."""
    wc = weight.shape[-1]
    seq = torch.cat([initial.float(), x.float().t()], dim=-1)  # [C, Wc + T]
    frames = seq[:, 1:].unfold(-1, wc, 1)  # [C, T, Wc], frame t ends at token t
    return F.silu((frames * weight.float().unsqueeze(1)).sum(-1)).t(), seq[:, -wc:].to(initial.dtype)


def recurrent(q, k, v, g, beta, state):
    """Token-by-token delta rule. q, k, g [T, H, K] (q, k normalized, q scaled); v [T, H, V]; beta [T, H];
    state [H, V, K] fp32. Returns (o [T, H, V] fp32, final state)."""
    s = state.float().clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t]).unsqueeze(1)  # decay along K
        u = beta[t].unsqueeze(-1) * (v[t] - torch.einsum("hvk,hk->hv", s, k[t]))
        s = s + u.unsqueeze(-1) * k[t].unsqueeze(1)
        outs.append(torch.einsum("hvk,hk->hv", s, q[t]))
    return torch.stack(outs), s


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence in chunks (the prefill form). Within a chunk, with G the cumulative log-decay,
    the updates u solve (I + diag(beta) A) U = diag(beta) (V - (K * e^G) S0^T), A_tj = sum_k k_t k_j e^(G_t - G_j)
    for j < t. Only differences G_t - G_j with t >= j are exponentiated, so nothing overflows."""
    s = state.float().clone()
    outs = []
    for start in range(0, q.shape[0], chunk):
        qc, kc, vc, gc, bc = (x[start:start + chunk].float().transpose(0, 1) for x in (q, k, v, g, beta))
        # [H, C, K] except bc [H, C]
        n = qc.shape[1]
        G = gc.cumsum(1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal.unsqueeze(-1), float("-inf"))
        decay = torch.exp(diff)  # [H, C(t), C(j), K], zero above the diagonal
        A = torch.einsum("htk,hjk,htjk->htj", kc, kc, decay).tril(-1)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("htk,hvk->htv", kc * torch.exp(G), s))
        lhs = torch.eye(n, device=q.device) + bc.unsqueeze(-1) * A
        U = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
        attn = torch.einsum("htk,hjk,htjk->htj", qc, kc, decay)
        o = torch.einsum("htk,hvk->htv", qc * torch.exp(G), s) + attn @ U
        outs.append(o.transpose(0, 1))
        G_last = G[:, -1:, :]
        s = s * torch.exp(G_last) + torch.einsum("hjv,hjk->hvk", U, kc * torch.exp(G_last - G))
    return torch.cat(outs), s


def gate_input(proj: torch.Tensor, cols: KDAColumns, w: KDAWeights) -> torch.Tensor:
    """r = f_a f_b^T [T, P] as an fp32-accumulating GEMM with exact accumulation returns it: the exact product
    rounded to fp32, then to the activation dtype. The same on every device. A real GEMM's summation order rounds
    a few r the other way (~40 of 786,432 per step at 96 heads, batch 64), and through exp(A_log) such a flip
    moves a decay's whole state column: a reference computed by one GEMM's order would judge every other order
    wrong there (NOTES.md of the fused decode kernel, run 9)."""
    return (proj[:, cols.f_a].double() @ w.f_b.double().t()).float().to(proj.dtype)


def prepare(proj: torch.Tensor, conv_out: torch.Tensor, cols: KDAColumns, w: KDAWeights):
    """Split the projection into the recurrence's inputs: normalized q (scaled), k, v, log-decay g, beta."""
    t, h, d = proj.shape[0], cols.heads, cols.head_dim
    q, k, v = conv_out.view(t, 3, h, d).unbind(1)
    r = gate_input(proj, cols, w).view(t, h, d)  # f_b GEMM output, activation dtype
    g = decay_gate(r, w.A_log, w.dt_bias, w.lower_bound)
    beta = torch.sigmoid(proj[:, cols.beta].float())
    return l2_normalize(q) * d**-0.5, l2_normalize(k), v.float(), g, beta


def finish(o: torch.Tensor, proj: torch.Tensor, cols: KDAColumns, w: KDAWeights) -> torch.Tensor:
    """Round the recurrence output like the served kernels, then the gated RMSNorm -> [T, P]."""
    t, h, d = proj.shape[0], cols.heads, cols.head_dim
    o = o.to(proj.dtype)
    gate = proj[:, cols.gate].view(t, h, d)
    return gated_rms_norm(o, gate, w.o_norm, w.norm_eps).to(proj.dtype).view(t, h * d)


def kda_prefill(proj: torch.Tensor, conv_window: torch.Tensor, state: torch.Tensor, w: KDAWeights,
                chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's T new tokens from a cached window [3P, Wc] and state [H, V, K] (zeros for a new
    sequence) -> (out [T, P], new window, new state), chunked form."""
    cols = KDAColumns(heads=state.shape[0], head_dim=state.shape[2], rank=w.f_b.shape[1])
    x, window = conv_prefill(proj[:, cols.qkv], conv_window, w.conv_weight)
    q, k, v, g, beta = prepare(proj, x, cols, w)
    o, s = chunked(q, k, v, g, beta, state, chunk)
    return finish(o, proj, cols, w), window, s
