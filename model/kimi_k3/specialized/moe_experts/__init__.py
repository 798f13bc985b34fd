"""K3's MXFP4 routed experts at decode batch sizes in CuTe DSL (sm_90). Entry point: `moe_experts_cute`, the signature
of the reference (model/kimi_k3/ops/moe_experts.py).

    >>> y = moe_experts_cute(z, ids, weights, w13, w2, beta, beta_lin)
    ... # z [T, L] bf16, ids [T, k] int64, weights [T, k] fp32, w13 = (packed uint8 [E, 2I, L/2], scale uint8
    ... # [E, 2I, L/32]), w2 = (packed uint8 [E, L, I/2], scale uint8 [E, L, I/32]) -> y [T, L] fp32

Envelope: T <= 16 tokens (T = 0 returns an empty y without a launch); MXFP4 weights only (the (packed, scale) pairs
of mxfp4.quantize; dense experts take the reference); L a multiple of 512; I a multiple of 128 (and of the `up` CTA's
rows, 8); top_k 1..32; every tensor contiguous, z and the weights' parts 16-byte aligned; all on one CUDA device.
Anything else raises ValueError before anything is launched. The ids must lie in [0, E): they are read on the device
(no host synchronisation), where an id outside is clamped into range rather than checked.
"""

from __future__ import annotations

import functools

import torch

from kernels.cute import CompileCache, current_cute_arch, require_dsl

from ..linear import _num_sms, available
from .kernel import (
    DSL,
    GROUP,
    MAX_TOKENS,
    MAX_TOP_K,
    ExpertsConfig,
    compile_kernel,
    compile_report,
    launch_args,
)

__all__ = ["ExpertsConfig", "available", "check_args", "compile", "compile_keys", "config_for", "moe_experts_cute",
           "prepare"]
# Token counts the compile gate builds for: the range's ends (T is a runtime argument; the heuristic's config is the
# same at every T today, so both give one key per intermediate dim).
COMPILE_TOKENS = (1, 16)  # clipped to the contract's batch range by compile_keys
# Rank-local intermediate dim of K3's routed experts per TP size (3072 / 8; 3072 / 16 = 192 zero-padded to 256).
INTERMEDIATE = {8: 384, 16: 256}

_CACHE = CompileCache("moe_experts", module=f"{__name__}.kernel")
_INT32_LIMIT = 2**31


def _is_pair(w) -> bool:
    return isinstance(w, (tuple, list)) and len(w) == 2 and all(isinstance(t, torch.Tensor) for t in w)


def check_args(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2) -> tuple[int, int, int, int, int]:
    """Validate a call; return (T, k, E, L, I). Raises ValueError with one line, device last, so that every other
    check runs on CPU tensors."""
    if not all(isinstance(t, torch.Tensor) for t in (z, ids, weights)):
        raise ValueError("z, ids and weights must be tensors")
    if not _is_pair(w13) or not _is_pair(w2):
        raise ValueError("w13 and w2 must be MXFP4 (packed, scale) pairs of tensors (dense experts: use the reference)")
    (p13, s13), (p2, s2) = w13, w2
    if z.dtype != torch.bfloat16 or ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ValueError(f"z must be bf16, ids int64 and weights fp32, got {z.dtype}, {ids.dtype}, {weights.dtype}")
    if any(t.dtype != torch.uint8 for t in (p13, s13, p2, s2)):
        raise ValueError("the packed weights and scales must be uint8")
    if z.dim() != 2 or ids.dim() != 2 or weights.dim() != 2 or any(t.dim() != 3 for t in (p13, s13, p2, s2)):
        raise ValueError(f"z must be [T, L], ids and weights [T, k], weights' parts [E, rows, cols]; got "
                         f"{tuple(z.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}")
    t, latent = z.shape
    k = ids.shape[1]
    e, two_i = p13.shape[0], p13.shape[1]
    inter = two_i // 2
    if tuple(ids.shape) != (t, k) or tuple(weights.shape) != (t, k):
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T={t}, k]")
    if t > MAX_TOKENS:
        raise ValueError(f"T={t} tokens: at most {MAX_TOKENS}")
    if not 1 <= k <= MAX_TOP_K:
        raise ValueError(f"top_k={k}: 1..{MAX_TOP_K}")
    if two_i % 2:
        raise ValueError(f"w13 has {two_i} rows: w1 over w3 needs an even count")
    expect = {"w13 packed": (p13, (e, 2 * inter, latent // 2)), "w13 scale": (s13, (e, 2 * inter, latent // GROUP)),
              "w2 packed": (p2, (e, latent, inter // 2)), "w2 scale": (s2, (e, latent, inter // GROUP))}
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} for E={e}, L={latent}, I={inter}, got {list(tensor.shape)}")
    try:
        ExpertsConfig().check(latent, inter, k)
    except ValueError as err:
        raise ValueError(f"dims outside the kernel's tiling: {err}") from None
    if not all(x.is_contiguous() for x in (z, ids, weights, p13, s13, p2, s2)):
        raise ValueError("z, ids, weights and the weights' parts must be contiguous")
    if any(x.data_ptr() % 16 for x in (z, p13, s13, p2, s2)):
        raise ValueError("z and the weights' parts must be 16-byte aligned")
    if p13.numel() // 4 >= _INT32_LIMIT or p2.numel() // 4 >= _INT32_LIMIT or s13.numel() >= _INT32_LIMIT:
        raise ValueError("an index into the expert weights would overflow int32")
    tensors = (z, ids, weights, p13, s13, p2, s2)
    if not all(x.is_cuda for x in tensors) or len({x.device for x in tensors}) != 1:
        raise ValueError("z, ids, weights, w13 and w2 must be CUDA tensors on one device")
    return t, k, e, latent, inter


@functools.cache
def config_for(tokens: int, inter: int, num_sms: int = 132) -> ExpertsConfig:
    """The config moe_experts_cute uses for T tokens and intermediate dim I: ExpertsConfig.for_shape (no measured
    table yet); memoized, since it runs on every call."""
    return ExpertsConfig.for_shape(tokens, inter, num_sms)


def _compiled(cfg: ExpertsConfig, e: int, latent: int, inter: int, k: int):
    return _CACHE.get((cfg, e, latent, inter, k, current_cute_arch()),
                      lambda: compile_kernel(cfg, e, latent, inter, k))


def prepare(tokens: int, e: int, latent: int, inter: int, k: int, num_sms: int | None = None) -> ExpertsConfig:
    """Compile (once per process) the kernels a call of this shape runs, without launching, and return the config:
    for warming up outside CUDA-graph capture and timed regions."""
    cfg = config_for(tokens, inter, num_sms or _num_sms(torch.cuda.current_device()))
    _compiled(cfg, e, latent, inter, k)
    return cfg


def moe_experts_cute(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w2, beta: float,
                     beta_lin: float, *, config: ExpertsConfig | None = None) -> torch.Tensor:
    """The reference's result, y [T, L] fp32, in two launches on the current stream (kernel.py's module doc);
    deterministic. `config` overrides the heuristic (for tuning). Raises ValueError before launching anything on
    input outside the envelope (module doc)."""
    require_dsl(DSL.error)
    t, k, e, latent, inter = check_args(z, ids, weights, w13, w2)
    y = torch.empty(t, latent, dtype=torch.float32, device=z.device)
    if t == 0:
        return y
    cfg = config or config_for(t, inter, _num_sms(z.device.index))
    if config is not None:
        config.check(latent, inter, k)
    h = torch.empty(t * k, inter, dtype=torch.bfloat16, device=z.device)  # SiTU's output per (token, slot)
    (p13, s13), (p2, s2) = w13, w2
    _compiled(cfg, e, latent, inter, k)(*launch_args(
        z.data_ptr(), ids.data_ptr(), weights.data_ptr(), p13.data_ptr(), s13.data_ptr(), p2.data_ptr(),
        s2.data_ptr(), h.data_ptr(), y.data_ptr(), t, float(beta), float(beta_lin),
        torch.cuda.current_stream(z.device).cuda_stream))
    return y


def compile_keys(contract) -> list[tuple[ExpertsConfig, int, int, int, int]]:
    """The gate's compile protocol: the (config, E, L, I, k) the entry point compiles at every experts / top_k /
    latent_dim the contract admits, I from its TP sizes, for the token counts of COMPILE_TOKENS inside its batch
    range (times 1 + spec tokens). T itself is a runtime argument: it only picks the config."""
    spec = 1 + contract.spec_tokens.max
    tokens = [t for t in COMPILE_TOKENS if contract.batch.min <= t <= min(contract.batch.max * spec, MAX_TOKENS)]
    inters = sorted({INTERMEDIATE[tp] for tp in contract.tp_sizes})
    keys = {(config_for(t, i), e, latent, i, k) for t in tokens for i in inters for e in contract.shapes["experts"]
            for k in contract.shapes["top_k"] for latent in contract.shapes["latent_dim"]}
    return sorted(keys, key=lambda key: (key[3], repr(key[0])))


def compile(key: tuple[ExpertsConfig, int, int, int, int], target: str):  # noqa: A001 - the gate's protocol's name
    """Compile one (config, E, L, I, k) for a target ('sm_90a', 'sm_100a') without a GPU: a CompileReport."""
    cfg, e, latent, inter, k = key
    return compile_report(cfg, e, latent, inter, k, arch=target)
