"""The dependency-chain probe: a lower bound, measured, for any one-kernel KDA decode step.

One Triton kernel with the fused kernel's grid and memory traffic but almost none of its arithmetic: each
program (head, share of the state rows, sequence) reads the slot index, then the state rows and conv windows
at that slot, while the slot-independent f_a and f_b loads fly; it writes the state rows back in place and the
output rows. Its result is not the KDA step: it only keeps every load live (each value feeds what is stored) so
the timed work is the chain slot -> state -> stores with the same bytes in flight. Timed with the gate's method
(explore --probe), it says how much of the kernel's time any kernel doing this step must spend.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR = None
except Exception as _e:  # no Triton (CPU machines): the module stays importable
    triton = tl = None
    _IMPORT_ERROR = f"{type(_e).__name__}: {_e}"


if _IMPORT_ERROR is None:

    @triton.jit
    def _chain_tile(proj, conv, state, slots, fb, out, proj_stride, h, b, row0, H: tl.constexpr, K: tl.constexpr,
                    R: tl.constexpr, WC: tl.constexpr, ROWS: tl.constexpr):
        """Rows row0 .. row0 + ROWS of head h of sequence b: the loads and stores of the step, almost no math."""
        P = H * K
        cols = tl.arange(0, K)
        rows = row0 + tl.arange(0, ROWS)
        slot = tl.load(slots + b).to(tl.int64)
        # slot-independent: f_a row, this head's f_b rows -> one value per state column
        fa = tl.load(proj + b * proj_stride + 4 * P + tl.arange(0, R)).to(tl.float32)
        fbt = tl.load(fb + (h * K + cols)[:, None] * R + tl.arange(0, R)[None, :]).to(tl.float32)
        decay = tl.sum(fbt * fa[None, :], axis=1)
        # slot-dependent: q and k windows of the head (all columns), v windows of these rows, the state rows
        win = conv + slot * (3 * P * WC)
        taps = tl.arange(0, WC)
        qk = (tl.sum(tl.load(win + (h * K + cols)[:, None] * WC + taps[None, :]).to(tl.float32), axis=1)
              + tl.sum(tl.load(win + (P + h * K + cols)[:, None] * WC + taps[None, :]).to(tl.float32), axis=1))
        v = tl.sum(tl.load(win + (2 * P + h * K + rows)[:, None] * WC + taps[None, :]).to(tl.float32), axis=1)
        tile = state + ((slot * H + h) * K + rows)[:, None] * K + cols[None, :]
        s = tl.load(tile) * (decay + qk)[None, :] + v[:, None]
        tl.store(tile, s)
        tl.store(out + b * P + h * K + rows, tl.sum(s, axis=1).to(tl.bfloat16))

    @triton.jit
    def _chain_kernel(proj, conv, state, slots, fb, out, proj_stride, H: tl.constexpr, K: tl.constexpr,
                      R: tl.constexpr, WC: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr):
        """The fused kernel's grid: a program per (head, share of the rows) and sequence."""
        pid = tl.program_id(0)
        _chain_tile(proj, conv, state, slots, fb, out, proj_stride, pid // SPLIT, tl.program_id(1),
                    (pid % SPLIT) * ROWS, H, K, R, WC, ROWS)

    @triton.jit
    def _chain_kernel_persistent(proj, conv, state, slots, fb, out, proj_stride, batch, H: tl.constexpr,
                                 K: tl.constexpr, R: tl.constexpr, WC: tl.constexpr, STAGES: tl.constexpr):
        """Another data flow: a fixed grid whose programs walk the (sequence, head) tiles in turn, Triton's
        pipeliner putting the next tiles' loads in flight (STAGES deep) while this one's stores drain."""
        nprog = tl.num_programs(0)
        for t in tl.range(tl.program_id(0), batch * H, nprog, num_stages=STAGES):
            _chain_tile(proj, conv, state, slots, fb, out, proj_stride, t % H, t // H, 0, H, K, R, WC, K)


def available() -> tuple[bool, str]:
    if _IMPORT_ERROR is not None:
        return False, f"Triton unavailable: {_IMPORT_ERROR}"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, "ok"


def chain_probe(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, w,
                *, v_split: int | None = None, num_warps: int = 8, persistent: int = 0,
                stages: int = 2) -> torch.Tensor:
    """kda_decode's signature; moves the step's bytes in its dependency order (see the module docstring).
    Overwrites the state rows at `slots` with values that are not the KDA update. v_split: programs per
    (head, sequence), by default the fused kernel's choice. persistent > 0: that many programs per SM instead,
    each walking whole (sequence, head) tiles with `stages` of them in flight."""
    from model.kimi_k3.specialized.kda_decode.kernel import default_v_split

    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"Triton unavailable: {_IMPORT_ERROR}")
    num_slots, heads, head_dim, _ = ssm_state.shape
    batch, rank = proj.shape[0], w.f_b.shape[1]
    v_split = v_split or default_v_split(heads, batch)
    out = torch.empty(batch, heads * head_dim, dtype=proj.dtype, device=proj.device)
    shape = dict(H=heads, K=head_dim, R=rank, WC=conv_state.shape[-1])
    if persistent:
        programs = min(batch * heads, persistent * torch.cuda.get_device_properties(proj.device).multi_processor_count)
        _chain_kernel_persistent[(programs,)](proj, conv_state, ssm_state, slots, w.f_b, out, proj.stride(0), batch,
                                              STAGES=stages, num_warps=num_warps, **shape)
        return out
    _chain_kernel[(heads * v_split, batch)](proj, conv_state, ssm_state, slots, w.f_b, out, proj.stride(0),
                                            ROWS=head_dim // v_split, SPLIT=v_split, num_warps=num_warps, **shape)
    return out


def state_scale(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, w):
    """kda_decode's signature; the step's state bytes alone, as one contiguous in-place scale of as many slots
    (torch's elementwise kernel): the copy bandwidth this step's state traffic could reach in the same timing."""
    ssm_state[:len(slots)].mul_(1.0)
    return None
