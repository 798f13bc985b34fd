"""The K3 MoE router in one CuTe DSL launch (sm_90): logits, sigmoid, biased top-k, renormalized weights.
Entry points: `moe_route_cute`, the signature of the reference (model/kimi_k3/ops/moe_route.py), and
`moe_route_local_cute`, a TP rank's local top-k candidates in model/kimi_k3/ops/moe_route_tp.py's format.

    >>> ids, weights = moe_route_cute(x, gate_w, bias, 16, True, 1.0)   # x [T, 7168] bf16, gate_w [896, 7168] bf16,
    ...                                                                 # bias [896] fp32 -> [T, 16] int64, fp32
    >>> cand = moe_route_local_cute(x, w_local, bias_local, 16, first_id)  # w_local [E / tp, 7168], bias_local
    ...                                                                    # [E / tp] -> [T, 16, 3] fp32

Envelope: T <= 64 tokens (T = 0 returns empty outputs without a launch); any E experts (a lane owns ceil(E / 32),
padded; kernel.py); top_k 1..32 (and <= E); K a multiple of the GEMV's k-step (linear's rule: 32, 128 on its gemv
path); gate_w contiguous, x with unit column stride and a row stride that is a multiple of 8 elements, both 16-byte
aligned; bias fp32 contiguous; all on one CUDA device. Anything else raises ValueError before anything is
launched. Calls on one device share the arrival counters, so two routers must not run at once on two streams
of one device (module doc of kernel.py).
"""

from __future__ import annotations

import functools

import torch

from kernels.cute import CompileCache, current_cute_arch, require_dsl

# the GPU, SM-count and activation-layout checks are linear's: its GEMV runs
from ..linear import _num_sms, available, check_activation_layout, config_for
from ..linear.kernel import MAX_TOKENS
from .kernel import (
    CANDIDATE_FIELDS,
    DSL,
    MAX_TOP_K,
    SHORTCUTS,
    SYNC_WORDS,
    RouteConfig,
    compile_kernel,
    compile_report,
    launch_args,
)

__all__ = ["RouteConfig", "available", "check_args", "compile", "compile_keys", "moe_route_cute",
           "moe_route_local_cute", "prepare", "route_config", "supports"]
# Token counts the compile gate builds for: the GEMV's band edges (linear's) and the selection's (one selecting
# CTA per `warps` tokens).
COMPILE_TOKENS = (1, 2, 8, 9, 16, 32, 64)
MAX_T = MAX_TOKENS["mma"]

_CACHE = CompileCache("moe_route", module=f"{__name__}.kernel")
_SYNC: dict[int, torch.Tensor] = {}  # per device: the kernel's arrival counters (each config leaves its own ready)


def check_args(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[int, int, int]:
    """Validate a call; return (T, E, K). Raises ValueError, device last, so that every other check runs on CPU
    tensors."""
    if not all(isinstance(t, torch.Tensor) for t in (x, gate_w, bias)):
        raise ValueError("x, gate_w and bias must be tensors")
    if x.dtype != torch.bfloat16 or gate_w.dtype != torch.bfloat16 or bias.dtype != torch.float32:
        raise ValueError(f"x and gate_w must be bf16 and bias fp32, got {x.dtype}, {gate_w.dtype}, {bias.dtype}")
    if x.dim() != 2 or gate_w.dim() != 2 or bias.dim() != 1:
        raise ValueError(f"x must be [T, K], gate_w [E, K], bias [E], got {tuple(x.shape)}, {tuple(gate_w.shape)}, "
                         f"{tuple(bias.shape)}")
    (t, k), (e, kw) = x.shape, gate_w.shape
    if k != kw or bias.shape[0] != e:
        raise ValueError(f"x [T, {k}], gate_w [{e}, {kw}] and bias [{bias.shape[0]}] disagree")
    if t > MAX_T:
        raise ValueError(f"T={t} tokens: at most {MAX_T}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(MAX_TOP_K, e):
        raise ValueError(f"top_k={top_k!r}: an int in 1..{min(MAX_TOP_K, e)}")
    if not gate_w.is_contiguous() or not bias.is_contiguous():
        raise ValueError("gate_w and bias must be contiguous")
    check_activation_layout(x, gate_w, "gate_w")
    if e * k >= 2**31 or (t - 1) * x.stride(0) + k >= 2**31:
        raise ValueError("an index of x or gate_w would overflow int32")
    if not all(a.is_cuda for a in (x, gate_w, bias)) or len({a.device for a in (x, gate_w, bias)}) != 1:
        raise ValueError("x, gate_w and bias must be CUDA tensors on one device")
    return t, e, k


def supports(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int) -> bool:
    """Whether the kernel can take this call here: the DSL and an sm_90 GPU (`available`), and the arguments
    inside the envelope (`check_args`, the GEMV's K rule). For callers with a torch fallback (moe_route_tp)."""
    if not available()[0]:
        return False
    try:
        t, e, k = check_args(x, gate_w, bias, top_k)
        route_config(max(t, 1), e, k, top_k)
    except ValueError:
        return False
    return True


@functools.cache
def route_config(t: int, e: int, k: int, top_k: int, num_sms: int = 132, output: str = "weights",
                 shortcuts: bool = True) -> RouteConfig:
    """The config a call uses: linear's GEMV config for [E, K] with fp32 out (its tuned table, else its
    heuristic), E, k and the output form. The router's ("weights") takes every shortcut after the last arrival
    (kernel.py's module doc; -11.8 % at T = 1 on an H100, NOTES.md session 32); `shortcuts=False` gives the kernel
    without them, as the local form always runs. Raises ValueError where K does not fit the GEMV."""
    flags = dict.fromkeys(SHORTCUTS, shortcuts and output == "weights")
    cfg = RouteConfig(config_for(t, e, k, torch.float32, num_sms), experts=e, top_k=top_k, output=output, **flags)
    cfg.check(t, k)
    return cfg


def _compiled(cfg: RouteConfig, t: int, k: int):
    return _CACHE.get((cfg, t, k, current_cute_arch()), lambda: compile_kernel(cfg, t, k))


def prepare(t: int, e: int, k: int, top_k: int, num_sms: int | None = None, output: str = "weights") -> RouteConfig:
    """Compile (once per process) the kernel a call of this shape runs, without launching it, and return its
    config: for warming up outside CUDA-graph capture and timed regions."""
    cfg = route_config(t, e, k, top_k, num_sms or _num_sms(torch.cuda.current_device()), output)
    _compiled(cfg, t, k)
    return cfg


def _sync(device: torch.device) -> torch.Tensor:
    if device.index not in _SYNC:
        _SYNC[device.index] = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
    return _SYNC[device.index]


def moe_route_cute(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                   scaling: float, *, config: RouteConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's math in one launch: (expert ids [T, top_k] int64 in decreasing key order, ties to the lower
    id; weights [T, top_k] fp32, the un-biased sigmoid scores, renormalized when asked, times scaling). `config`
    overrides route_config's (probe.py times the kernel's stages with it; a stage short of "select" leaves the
    outputs unwritten)."""
    require_dsl(DSL.error)
    t, e, k = check_args(x, gate_w, bias, top_k)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    if t > 0:
        cfg = config or route_config(t, e, k, top_k, _num_sms(x.device.index))
        _launch(cfg, x, gate_w, bias, ids, weights, bool(renormalize), float(scaling), 0)
    return ids, weights


def moe_route_local_cute(x: torch.Tensor, gate_w_local: torch.Tensor, bias_local: torch.Tensor, top_k: int,
                         first_id: int, *, config: RouteConfig | None = None) -> torch.Tensor:
    """A TP rank's local top-k in one launch, as model/kimi_k3/ops/moe_route_tp.py's `local_candidates` returns
    it: [T, top_k, 3] fp32 of (choice key sigmoid(x . w) + bias, un-biased score, global id first_id + local id),
    in decreasing key order, ties to the lower id. gate_w_local [E_local, K] and bias_local [E_local] are the
    rank's rows (any E_local >= top_k); the same envelope as moe_route_cute otherwise."""
    require_dsl(DSL.error)
    t, e, k = check_args(x, gate_w_local, bias_local, top_k)
    if not (0 <= first_id and first_id + e <= 2**24):
        raise ValueError(f"first_id={first_id}: global ids must stay in 0..2^24 (exact in fp32)")
    candidates = torch.empty(t, top_k, CANDIDATE_FIELDS, dtype=torch.float32, device=x.device)
    if t > 0:
        cfg = config or route_config(t, e, k, top_k, _num_sms(x.device.index), "candidates")
        _launch(cfg, x, gate_w_local, bias_local, None, candidates, False, 1.0, first_id)
    return candidates


def _launch(cfg: RouteConfig, x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor | None,
            out: torch.Tensor, renormalize: bool, scaling: float, first_id: int) -> None:
    """One launch of cfg's kernel on checked arguments (T >= 1), with a fresh logits workspace of
    cfg.padded_experts columns (the padding columns are never written and never read into the result)."""
    t, k = x.shape
    cfg.check(t, k)
    logits = torch.empty(t, cfg.padded_experts, dtype=torch.float32, device=x.device)
    _compiled(cfg, t, k)(*launch_args(
        x.data_ptr(), gate_w.data_ptr(), bias.data_ptr(), logits.data_ptr(), 0 if ids is None else ids.data_ptr(),
        out.data_ptr(), _sync(x.device).data_ptr(), x.stride(0) if t > 1 else k, renormalize, scaling, first_id,
        torch.cuda.current_stream(x.device).cuda_stream))


def compile_keys(contract) -> list[tuple[RouteConfig, int, int]]:
    """The gate's compile protocol: the (config, T, K) the entry point compiles at every experts / top_k / hidden
    the contract admits, for the token counts of COMPILE_TOKENS inside its batch range (times 1 + spec tokens)."""
    spec = 1 + contract.spec_tokens.max
    tokens = [t for t in COMPILE_TOKENS if contract.batch.min <= t <= min(contract.batch.max * spec, MAX_T)]
    keys = {(route_config(t, e, k, top_k), t, k) for t in tokens for e in contract.shapes["experts"]
            for top_k in contract.shapes["top_k"] for k in contract.shapes["hidden"]}
    return sorted(keys, key=lambda key: (key[2], key[1], repr(key[0])))


def compile(key: tuple[RouteConfig, int, int], target: str):  # noqa: A001 - the name the gate's protocol asks for
    """Compile one (config, T, K) for a target ('sm_90a', 'sm_100a') without a GPU: a kernels.cute.CompileReport."""
    cfg, t, k = key
    return compile_report(cfg, t, k, arch=target)
