"""K3's weight-absorbed MLA decode attention over the latent cache, the attention core in CuTe DSL (sm_90). Entry point:
`mla_decode_cute`, the signature of the reference (model/kimi_k3/ops/mla_decode.py).

    >>> out = mla_decode_cute(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale)
    ... # q_nope [B, H, N] bf16, q_pe [B, H, R] bf16, kv_cache [pages, P, C + R] bf16 (vLLM's paged cache),
    ... # block_table [B, max_blocks] int32 (or int64), lengths [B] int64, w_uk [H, N, C] bf16, w_uv [H, V, C] bf16
    ... # -> out [B, H, V] fp32; row t of sequence b is kv_cache[block_table[b, t // P], t % P]

The query absorption stays in torch (q_lat = q_nope W_UK with exact products and fp32 sums, as the reference computes
it); the kernel (kernel.py) computes the latent [B, H, C] from the fp32 query [q_lat | q_pe] and the cache in two
launches (split-KV partials, then their log-sum-exp merge, which also absorbs the output: out = latent W_UV^T, exact
products in fp32 FMAs, fp32 sums, W_UV read as stored). The partials' per-tile math runs on tensor cores by default
(MlaConfig.path "mma": 1.2-4.5x the cuBLAS standard on the H200, one op per graph, against the CUDA-core path's
0.6-2.7x); `config=MlaConfig(path="fma")` keeps it on CUDA cores in fp32, exact to ~1e-6 where the mma path's bf16 P
gives ~5e-4 relative (kernel.py, NOTES.md).

Envelope: B 1..64 (B = 0 returns an empty out without a launch); H 1..16; C = 512 (the contract's; the mma mapping
admits other multiples of 128, never run); C + R a multiple of 64; any page size P >= 1 (a runtime argument; a slot per
sequence is P = L with block_table = slots[:, None]) with P (C + R) < 2^31 (the pool itself may be larger), fewer than
2^31 pages and max_blocks x P < 2^31 rows a sequence; bf16 cache and weights, lengths int64, the block table int32 (an
int64 one is converted on the device first: one small launch); the cache, the block table and the lengths contiguous
(the queries and weights may be strided views: the model's are), the cache 16-byte aligned; all on one CUDA device.
Anything else raises ValueError before anything is launched. The block table and the lengths are read on the device
(no host synchronisation): an entry outside [0, pages) is clamped into range and a length clamped into [0, max_blocks
x P] rather than checked; only the entries of a sequence's first ceil(length / P) blocks are read; a length of 0 gives
a zero latent (decode always has >= 1). The split plan depends on B and max_blocks x P only (host values), so a call
can be captured in a CUDA graph and replayed with other tables and lengths.
"""

from __future__ import annotations

import functools

import torch

from kernels.cute import CompileCache, current_cute_arch, require_dsl

from ...ops.mla_decode import check_paged
from ..linear import _num_sms, available
from .kernel import DSL, MAX_HEADS, MlaConfig, compile_kernel, compile_report, launch_args, merge_vsplit, split_plan

__all__ = ["MlaConfig", "absorbed_attention", "attention_core", "available", "check_args", "compile", "compile_keys",
           "config_for", "mla_decode_cute", "prepare", "split_plan"]

MAX_BATCH = 64
_CACHE = CompileCache("mla_decode", module=f"{__name__}.kernel")
_INT32_LIMIT = 2**31


def check_args(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale,
               kv_dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int, int, int]:
    """Validate a call (the cache's elements of `kv_dtype`); return (B, H, N, C, R, V, max_len), max_len = the block
    table's width x P (the most rows a sequence may have). Raises ValueError with one line, device last, so that
    every other check runs on CPU tensors."""
    tensors = (q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("q_nope, q_pe, kv_cache, block_table, lengths, w_uk and w_uv must be tensors")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive Python number, got {scale!r}")
    if any(t.dtype != torch.bfloat16 for t in (q_nope, q_pe, w_uk, w_uv)):
        raise ValueError(f"q_nope, q_pe, w_uk and w_uv must be bf16, got {q_nope.dtype}, {q_pe.dtype}, {w_uk.dtype}, "
                         f"{w_uv.dtype}")
    if kv_cache.dtype != kv_dtype:
        raise ValueError(f"kv_cache must be {kv_dtype}, got {kv_cache.dtype}")
    if lengths.dtype != torch.int64:
        raise ValueError(f"lengths must be int64, got {lengths.dtype}")
    if q_nope.dim() != 3 or q_pe.dim() != 3 or w_uk.dim() != 3 or w_uv.dim() != 3:
        raise ValueError("q_nope, q_pe must be [B, H, *], w_uk [H, N, C], w_uv [H, V, C]")
    check_paged(kv_cache, block_table, lengths)
    b, h, n = q_nope.shape
    r = q_pe.shape[-1]
    c = w_uk.shape[-1]
    v = w_uv.shape[1]
    num_pages, page_size, width = kv_cache.shape
    blocks = block_table.shape[1]
    if tuple(q_pe.shape[:2]) != (b, h) or block_table.shape[0] != b:
        raise ValueError(f"q_pe {tuple(q_pe.shape)}, block_table {tuple(block_table.shape)} must match q_nope's B={b}, "
                         f"H={h}")
    if tuple(w_uk.shape) != (h, n, c) or tuple(w_uv.shape) != (h, v, c):
        raise ValueError(f"w_uk {tuple(w_uk.shape)} must be [H={h}, N={n}, C], w_uv {tuple(w_uv.shape)} [H, V, C={c}]")
    if width != c + r:
        raise ValueError(f"kv_cache entries are {width} wide: C + R = {c} + {r} expected")
    if b > MAX_BATCH:
        raise ValueError(f"B={b} sequences: at most {MAX_BATCH}")
    if h > MAX_HEADS:
        raise ValueError(f"H={h} heads: at most {MAX_HEADS}")
    try:
        MlaConfig().check(h, c, r)
    except ValueError as err:
        raise ValueError(f"dims outside the kernel's mapping: {err}") from None
    if page_size * width >= _INT32_LIMIT:
        raise ValueError(f"a page of kv_cache holds {page_size * width} elements: the kernel's offsets inside a page "
                         "need < 2^31")
    if num_pages >= _INT32_LIMIT or blocks * page_size >= _INT32_LIMIT:
        raise ValueError(f"kv_cache has {num_pages} pages and block_table admits {blocks * page_size} rows a sequence: "
                         "the kernel's page and row numbers need < 2^31")
    # only these reach the kernel by address; the queries and weights go through torch first and may be any views
    # (the model passes q_nope, q_pe split from one projection, W_UK and W_UV sliced from kv_b_proj)
    if not all(t.is_contiguous() for t in (kv_cache, block_table, lengths)):
        raise ValueError("kv_cache, block_table and lengths must be contiguous")
    if kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache must be 16-byte aligned")
    if w_uv.stride(2) != 1 or w_uv.stride(1) != c or w_uv.data_ptr() % 16 or (w_uv.stride(0) * 2) % 16 or \
            w_uv.stride(0) >= _INT32_LIMIT:
        raise ValueError(f"w_uv (strides {tuple(w_uv.stride())}) must have contiguous rows of C={c} from a 16-byte "
                         "aligned base, heads a multiple of 16 bytes apart (kv_b_proj's view is)")
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        raise ValueError("q_nope, q_pe, kv_cache, block_table, lengths, w_uk and w_uv must be CUDA tensors on one "
                         "device")
    return b, h, n, c, r, v, blocks * page_size


@functools.cache
def config_for(heads: int) -> MlaConfig:
    """The config mla_decode_cute uses (no measured table yet: the defaults at every head count)."""
    return MlaConfig()


def _compiled(cfg: MlaConfig, heads: int, latent: int, rope: int):
    code = cfg.code  # the split knobs are runtime arguments: configs that differ only there share one compile
    return _CACHE.get((code, heads, latent, rope, current_cute_arch()),
                      lambda: compile_kernel(code, heads, latent, rope))


def prepare(heads: int, latent: int = 512, rope: int = 64, config: MlaConfig | None = None) -> MlaConfig:
    """Compile (once per process) the kernels a call of this shape runs (with `config`, as mla_decode_cute's
    override, or the heuristic's), without launching, and return the config: for warming up outside CUDA-graph
    capture and timed regions."""
    cfg = config or config_for(heads)
    cfg.check(heads, latent, rope)
    _compiled(cfg, heads, latent, rope)
    return cfg


def mla_decode_cute(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, *,
                    config: MlaConfig | None = None) -> torch.Tensor:
    """The reference's result, out [B, H, V] fp32: torch for the absorptions, two launches for the attention core on
    the current stream (kernel.py's module doc); deterministic. `config` overrides the heuristic (for tuning). Raises
    ValueError before launching anything on input outside the envelope (module doc)."""
    require_dsl(DSL.error)
    b, h, _, c, r, v, _ = check_args(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale)
    if b == 0:
        return torch.empty(0, h, v, dtype=torch.float32, device=q_nope.device)
    cfg = config or config_for(h)
    if config is not None:
        config.check(h, c, r)
    return absorbed_attention(q_nope, q_pe, kv_cache, block_table, lengths, w_uk, w_uv, scale, cfg)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       lengths: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                       cfg: MlaConfig, out_scale: float = 1.0) -> torch.Tensor:
    """The query absorption in torch, then the two launches, for a checked call: out [B, H, V] fp32 (times
    out_scale: an fp8 cache's kv_scale)."""
    # the reference's absorption: bf16 products are exact in fp32 and cuBLAS sums them in fp32, with no fp32 copy of
    # W_UK made on every call (3 MB written and read again at 12 heads, and two launches); the kernel reads its
    # [H, B, C] output and q_pe where they are (no concatenated query)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk, out_dtype=torch.float32)  # [H, B, C]
    # the kernel reads int32 entries, vLLM's; an int64 table costs one conversion on the device (no-op for int32)
    return attention_core(q_lat, q_pe, kv_cache, block_table.to(torch.int32), lengths, w_uv, scale, cfg, out_scale)


def attention_core(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   lengths: torch.Tensor, w_uv: torch.Tensor, scale: float, cfg: MlaConfig,
                   out_scale: float = 1.0) -> torch.Tensor:
    """The two launches alone (no argument checks: mla_decode_cute's job; q_lat fp32 [H, B, C] contiguous, q_pe bf16
    [B, H, R] (a copy is made only if its rows are not contiguous), the block table int32, W_UV as check_args admits
    it): out [B, H, V] fp32 = out_scale x latent W_UV^T. For the benchmark's kernel-only timing."""
    h, b, c = q_lat.shape
    v = w_uv.shape[1]
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    num_pages, page_size, _ = kv_cache.shape
    blocks = block_table.shape[1]
    splits, chunk = split_plan(b, blocks * page_size, _num_sms(q_lat.device.index), cfg)
    partials = torch.empty(b, splits, h, c, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(b, splits, h, dtype=torch.float32, device=q_lat.device)
    out = torch.empty(b, h, v, dtype=torch.float32, device=q_lat.device)
    _compiled(cfg, h, c, q_pe.shape[-1])(*launch_args(
        q_lat.data_ptr(), q_pe.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), lengths.data_ptr(),
        partials.data_ptr(), lse.data_ptr(), w_uv.data_ptr(), out.data_ptr(), b, blocks, page_size, num_pages, splits,
        chunk, float(scale), (q_pe.stride(0), q_pe.stride(1)), v, w_uv.stride(0), float(out_scale),
        merge_vsplit(b, h, v, c, _num_sms(q_lat.device.index)), torch.cuda.current_stream(q_lat.device).cuda_stream,
        cfg.cache))
    return out


def compile_keys(contract) -> list[tuple[MlaConfig, int, int, int]]:
    """The gate's compile protocol: the (config, H, C, R) the entry point compiles at every head count / latent / rope
    dim the contract admits. B, the page size, the block table's width, the split plan and the scale are runtime
    arguments."""
    keys = {(config_for(h), h, c, r) for h in contract.shapes["heads"] for c in contract.shapes["kv_lora_rank"]
            for r in contract.shapes["rope_dim"]}
    return sorted(keys, key=lambda key: (key[1], key[2], key[3]))


def compile(key: tuple[MlaConfig, int, int, int], target: str):  # noqa: A001 - the gate's protocol's name
    """Compile one (config, H, C, R) for a target ('sm_90a') without a GPU: a CompileReport."""
    cfg, h, c, r = key
    return compile_report(cfg, h, c, r, arch=target)
