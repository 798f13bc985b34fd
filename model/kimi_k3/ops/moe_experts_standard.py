"""Routed-expert MoE (`moe_experts`), STANDARD implementation: what a stock serving engine runs on an H200.

Same signature and semantics as the reference `model.kimi_k3.ops.moe_experts.moe_experts`:
y[t] = sum_k weights[t,k] * w2_e(SiTU(w1_e z_t, w3_e z_t)), e = ids[t,k], returned in fp32 [T, L]; the
gate-up product, the SiTU output and the down product are rounded to the activation dtype (bf16) like the
reference's `z @ m13.t()`, `situ(...)` and `act @ m2.t()`.

Path 1, MXFP4 experts and bf16 activations on CUDA: vLLM's humming path on Hopper (`HummingIndexedExperts`
in vLLM's `fused_humming_moe.py`), with vLLM's own glue kernels replaced by equivalents here:

1. routing alignment (vLLM's `moe_align_block_size` CUDA kernel): one Triton program here
   (`_moe_align_kernel`) builds `sorted_ids` (pair index t*k+s of every (token, slot) pair, grouped by expert,
   each expert's group padded to the GEMM's block M with the pad value T*k), `expert_ids` (the expert of each
   block of rows) and `num_tokens_padded`; the torch composition `moe_align_block_size` (several kernels) is
   the CPU-testable oracle and the fallback where Triton is missing.
2. gate-up: humming's indexed MoE GEMM, W4A16 MXFP4 (`humming.ops.humming_gemm`, compute config
   `gemm_type="indexed"`, top_k=k: row r of the output is pair r, its input row is token r // k), bf16 out.
3. SiTU: fused by humming's `process_input` kernel with a custom binary activation
   (`activation_type="binary_split"`, `activation_impl` a CUDA expression of (a, b) evaluated in fp32, fast
   math off, bf16 out): one kernel, like vLLM's activation kernel. `set_situ_mode("torch")` (or the environment
   variable K3_MOE_STANDARD_SITU=torch) swaps in the torch composition `situ_mlp.situ` (several kernels).
4. down: humming's indexed MoE GEMM with top_k=1 on the [T*k, I] activations, bf16 out.
5. weighted sum over the k slots in fp32 (vLLM's `moe_fused_mul_sum`): one Triton kernel here
   (`_weighted_sum_kernel`), a torch mul+sum where Triton is missing.

Everything in a call is CUDA-graph capturable (no host synchronization; shapes depend on T and k only) once a
first eager call per T has compiled the kernels. Humming picks its GEMM configuration per valid row count
T*k with its own SM90 heuristics (`humming.tune.get_heuristics_config(shape_m=T*k, gemm_type="indexed")`,
the config vLLM's interval table gives for that row count).

Weight repacking. Humming needs its own layout: the E2M1 codes repacked for its dequantizing MMA loads
(`humming.transform.transform_humming_tensors` -> `repack_weight`, same bytes as the checkpoint's packed
tensor) and the E8M0 scales transposed and permuted (same bytes as the checkpoint's scales). It is done ONCE
per weight set: `prepare(w13, w2)` (a layer may call it at load time), or implicitly on the first call, cached
by the tensors' data pointers, shapes and versions (the entry keeps weak references, so a freed and
reallocated tensor is never mistaken for a prepared one; an in-place weight update, which bumps the tensor
version, re-prepares). Memory: with the default `prepare(..., inplace=False)` the repacked copy is a SECOND
copy of the expert weights (E*(2I*L + L*I)/2 bytes of codes plus 1/16 of that in scales: 1.97 GB per MoE
layer at TP8, 1.31 GB at TP16), held while the cache entry lives (`clear_cache()` drops them). With
`prepare(..., inplace=True)` the repacked codes and scales are written back into the checkpoint tensors'
own storage and only that copy exists (no permanent extra memory; a transient ~2x of one projection's codes
during the repack); the checkpoint layout is then gone, so the reference and the fallback can no longer read
those tensors: a model that serves from this standard only would load this way.

Path 2, everything else (no CUDA, no humming, dense bf16 experts, non-bf16 activations):
`moe_experts_fallback`, a PyTorch composition with no Python loop over experts: per (token, slot) pair the
chosen expert's packed rows and scales are gathered and dequantized (one 256-entry byte -> two-values table,
exact), the pair's token goes through a batched matmul (bmm) with its expert's gate-up, SiTU, a bmm with its
down projection, and the k slots are summed in fp32. Pairs are processed in chunks sized so the temporaries
stay under ~256 MB. No library MoE kernel: it is a correctness fallback, not a performance standard.

`standard_label()` names the path that serves; `standard_available()` says whether the humming path can.
A failure inside the humming path raises (it never falls back silently: a baseline must say what it ran).

Toolchain (humming-kernels 0.1.20). Kernels are compiled on first use, by default with NVRTC through humming's
bundled `nvrtc_compile` helper (HUMMING_COMPILER=nvcc switches to nvcc). Humming finds the CUDA toolkit
itself (`humming.utils.cuda.find_all_cuda_paths`): /usr/local/cuda and /usr/local/cuda-*, then $CUDA_HOME and
$CUDA_PATH, then pip `nvidia/cu13` trees, keeping those whose major version (version.json, else `nvcc -V`)
is torch.version.cuda's (13) and that have the headers it needs (cuda_runtime.h, nvrtc.h, CCCL) and
lib64/libnvrtc.so. Compiled cubins are cached under $HUMMING_CACHE_DIR (default ~/.humming/cache), locks and
generated modules under $HUMMING_TMP_DIR (default ~/.humming/tmp). Its launcher and device-info extensions ship
precompiled for torch >= 2.11 (stable ABI): no C++ build. `import humming` also needs `packaging` and
`filelock` (torch brings filelock, not packaging). `HummingMoEExperts.warmup(token_counts, k)` compiles every
GEMM config those batch sizes need in parallel (otherwise each compiles on its first call, one at a time).
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .. import mxfp4
from ..config import MXFP4_GROUP
from .situ_mlp import situ

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    _TRITON_ERROR = None
except Exception as _e:  # no Triton (CPU machines): the module stays importable
    triton = tl = None
    _TRITON_ERROR = f"{type(_e).__name__}: {_e}"

FALLBACK_TEMP_BYTES = 256 << 20  # temporaries of one chunk of pairs in the fallback
PAD_N_MULTIPLE, PAD_K_MULTIPLE = 256, 128  # what vLLM's HummingMoEMethod pads humming's MoE layers to
SITU_MODES = ("humming", "torch")

_HUMMING: SimpleNamespace | None = None
_HUMMING_ERROR: str | None = None
_situ_mode = os.environ.get("K3_MOE_STANDARD_SITU", "humming")
_last_path = "none"


def _load_humming() -> SimpleNamespace | None:
    global _HUMMING, _HUMMING_ERROR
    if _HUMMING is None and _HUMMING_ERROR is None:
        try:
            import humming
            from humming import dtypes, ops
            from humming.schema import HummingWeightSchema
            from humming.transform import prepare_fp16_e8m0_scale, prepare_layer_config, transform_humming_tensors
            from humming.tune import get_heuristics_config

            _HUMMING = SimpleNamespace(
                version=getattr(humming, "__version__", "?"), dtypes=dtypes, ops=ops,
                HummingWeightSchema=HummingWeightSchema, prepare_layer_config=prepare_layer_config,
                prepare_fp16_e8m0_scale=prepare_fp16_e8m0_scale, transform_humming_tensors=transform_humming_tensors,
                get_heuristics_config=get_heuristics_config)
        except Exception as e:  # ImportError without humming/triton, or a broken install
            _HUMMING_ERROR = f"humming-kernels not importable: {type(e).__name__}: {e}"
    return _HUMMING


def humming_version() -> str | None:
    h = _load_humming()
    return None if h is None else str(h.version)


_AVAILABLE: tuple[bool, str] | None = None


def standard_available() -> tuple[bool, str]:
    """(True, 'ok') when the humming path can run here, else (False, reason). Where it cannot, the standard
    still runs: `moe_experts_standard` serves through `moe_experts_fallback`. Decided once per process."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _check_available()
    return _AVAILABLE


def _check_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, ("no CUDA device: the humming MoE GEMMs are JIT-compiled CUDA kernels; "
                       "moe_experts_standard serves through the PyTorch fallback composition")
    if _load_humming() is None:
        return False, _HUMMING_ERROR
    if _TRITON_ERROR is not None:
        return False, f"Triton not importable ({_TRITON_ERROR})"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"humming's bf16-activation GEMMs need sm_80 or newer (this device: sm_{major}x)"
    return True, "ok"


def set_situ_mode(mode: str) -> None:
    """'humming' (SiTU fused in humming's process_input kernel) or 'torch' (the `situ_mlp.situ` composition)."""
    global _situ_mode
    if mode not in SITU_MODES:
        raise ValueError(f"situ mode must be one of {SITU_MODES}, got {mode!r}")
    _situ_mode = mode


def situ_mode() -> str:
    return _situ_mode


FALLBACK_LABEL = "PyTorch composition, gathered per-pair dequantization + bmm (no library MoE)"


def standard_label(quantized: bool = True) -> str:
    """The path `moe_experts_standard` takes for MXFP4 experts (quantized=True) or dense bf16 experts."""
    ok, why = standard_available()
    if not quantized:
        return FALLBACK_LABEL + " [dense bf16 experts: humming has no bf16-weight MoE GEMM]"
    if not ok:
        return f"{FALLBACK_LABEL} [humming path unavailable: {why}]"
    act = ("SiTU fused in humming process_input (custom binary activation)" if _situ_mode == "humming"
           else "SiTU in torch (situ_mlp.situ composition)")
    return (f"humming {humming_version()} MoE W4A16 (MXFP4) indexed GEMMs, {act}; "
            "routing alignment and k-slot weighted sum: one Triton kernel each")


def last_path() -> str:
    """Which path served the latest `moe_experts_standard` call: 'humming' or 'fallback'."""
    return _last_path


# ---------------------------------------------------------------------------------------------------------
# Routing alignment (vLLM's moe_align_block_size semantics)
# ---------------------------------------------------------------------------------------------------------

def max_align_blocks(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Blocks `sorted_ids` needs for any routing of `num_pairs` pairs: every nonempty expert's group is padded
    up to a multiple of `block_size`, and at most min(num_pairs, num_experts) experts are nonempty. Two spare
    blocks cover a GEMM that schedules M blocks in pairs (CTA clusters along M)."""
    worst = num_pairs + min(num_pairs, num_experts) * (block_size - 1)
    return -(-worst // block_size) + 2


def moe_align_block_size(ids: torch.Tensor, num_experts: int, block_size: int, max_blocks: int | None = None):
    """Torch composition of vLLM's `moe_align_block_size` (no host synchronization). ids: [T, k] or flat.

    Returns (sorted_ids int32 [max_blocks*block_size], expert_ids int32 [max_blocks], num_tokens_padded
    int32 [1]): pair p = t*k + s of expert e sits in e's group, groups in expert order, each padded to a
    multiple of block_size with the value T*k (an out-of-range pair the GEMM neither reads nor writes);
    expert_ids[b] is the expert of rows [b*block_size, (b+1)*block_size) (clamped to a valid expert past the
    last group); num_tokens_padded is the total padded length. Within an expert, pairs are in pair order."""
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    if max_blocks is None:
        max_blocks = max_align_blocks(n, num_experts, block_size)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_size - 1)) // block_size * block_size
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    dest = pad_start[sorted_e] + (torch.arange(n, device=dev) - cnt_start[sorted_e])
    sorted_ids = torch.full((max_blocks * block_size,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_size
    expert_ids = torch.searchsorted(pad_end, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


if _TRITON_ERROR is None:

    @triton.jit
    def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr, work_ptr, n, num_experts,
                          max_blocks, total_slots, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                          LOG_E: tl.constexpr):
        """One program. work: int32 [2*E_PAD] scratch (counts, then per-expert write cursors | group ends)."""
        counts_ptr = work_ptr
        ends_ptr = work_ptr + E_PAD
        e_offs = tl.arange(0, E_PAD)
        tl.store(counts_ptr + e_offs, tl.zeros([E_PAD], dtype=tl.int32))
        for start in range(0, total_slots, CHUNK):  # every slot starts as padding
            offs = start + tl.arange(0, CHUNK)
            tl.store(sorted_ids_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + n, mask=offs < total_slots)
        tl.debug_barrier()
        for start in range(0, n, CHUNK):  # tokens per expert
            offs = start + tl.arange(0, CHUNK)
            m = offs < n
            e = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
            tl.atomic_add(counts_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=m)
        tl.debug_barrier()
        counts = tl.load(counts_ptr + e_offs, cache_modifier=".cg")  # written by atomics: read from L2
        padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        tl.store(counts_ptr + e_offs, ends - padded)  # becomes the write cursor of each group
        tl.store(ends_ptr + e_offs, ends)
        tl.store(ntp_ptr, tl.sum(padded, axis=0))
        tl.debug_barrier()
        for start in range(0, n, CHUNK):  # scatter pair indices into their groups (order within a group free)
            offs = start + tl.arange(0, CHUNK)
            m = offs < n
            e = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
            dest = tl.atomic_add(counts_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=m)
            tl.store(sorted_ids_ptr + dest, offs.to(tl.int32), mask=m)
        for start in range(0, max_blocks, CHUNK):  # expert of each block: first e with ends[e] > block start
            b = start + tl.arange(0, CHUNK)
            row = b * BLOCK_M
            lo = tl.zeros([CHUNK], dtype=tl.int32)
            hi = tl.zeros([CHUNK], dtype=tl.int32) + num_experts
            for _ in tl.static_range(LOG_E):
                active = lo < hi
                mid = (lo + hi) // 2
                v = tl.load(ends_ptr + mid, mask=active, other=0, cache_modifier=".cg")
                hi = tl.where(active & (v > row), mid, hi)
                lo = tl.where(active & (v <= row), mid + 1, lo)
            tl.store(expert_ids_ptr + b, tl.minimum(lo, num_experts - 1), mask=b < max_blocks)

    @triton.jit
    def _weighted_sum_kernel(down_ptr, w_ptr, y_ptr, L, K: tl.constexpr, BLOCK_L: tl.constexpr):
        """y[t, :] = sum_s w[t, s] * down[t*K + s, :] in fp32 (the slots summed in slot order)."""
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        m = offs < L
        acc = tl.zeros([BLOCK_L], dtype=tl.float32)
        for s in tl.static_range(K):
            w = tl.load(w_ptr + t * K + s).to(tl.float32)
            d = tl.load(down_ptr + (t * K + s).to(tl.int64) * L + offs, mask=m, other=0.0).to(tl.float32)
            acc += w * d
        tl.store(y_ptr + t.to(tl.int64) * L + offs, acc, mask=m)


def moe_align_block_size_triton(ids: torch.Tensor, num_experts: int, block_size: int, max_blocks: int | None = None):
    """`moe_align_block_size` in one Triton program (the order of pairs within an expert's group is the order
    the atomics ran in: any order is valid, every row of a group is computed independently)."""
    if _TRITON_ERROR is not None:
        raise RuntimeError(f"Triton unavailable: {_TRITON_ERROR}")
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n, dev = flat.numel(), flat.device
    if max_blocks is None:
        max_blocks = max_align_blocks(n, num_experts, block_size)
    e_pad = triton.next_power_of_2(max(num_experts, 16))
    sorted_ids = torch.empty(max_blocks * block_size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    ntp = torch.empty(1, dtype=torch.int32, device=dev)
    work = torch.empty(2 * e_pad, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, ntp, work, n, num_experts, max_blocks,
                            max_blocks * block_size, BLOCK_M=block_size, E_PAD=e_pad, CHUNK=256,
                            LOG_E=max(1, num_experts.bit_length()), num_warps=8)
    return sorted_ids, expert_ids, ntp


def weighted_slot_sum(down: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """down [T*k, L] (pair rows), weights [T, k] -> fp32 [T, L] = sum_s weights[t,s] * down[t*k+s]."""
    t, k = weights.shape
    L = down.shape[-1]
    if _TRITON_ERROR is None and down.is_cuda:
        y = torch.empty(t, L, dtype=torch.float32, device=down.device)
        block = 1024
        _weighted_sum_kernel[(t, triton.cdiv(L, block))](down.contiguous(), weights.float().contiguous(), y, L,
                                                         K=k, BLOCK_L=block, num_warps=4)
        return y
    return (down.view(t, k, L) * weights.float().unsqueeze(-1)).sum(1)


# ---------------------------------------------------------------------------------------------------------
# Humming path
# ---------------------------------------------------------------------------------------------------------

def situ_cuda_expression(beta: float, beta_lin: float) -> str:
    """SiTU(a, b) as the fp32 CUDA expression humming's process_input evaluates (same operation order as
    `situ_mlp.situ`: beta*tanh(a/beta) * sigmoid(a) * (beta_lin*tanh(b/beta_lin)), sigmoid as 1/(1+exp(-a)))."""
    def lit(x: float) -> str:
        x = float(x)
        if not (x == x and abs(x) != float("inf")):
            raise ValueError(f"SiTU constant {x} is not finite")
        return f"({x!r}f)"

    b, bl = lit(beta), lit(beta_lin)
    return (f"{b} * tanhf(a / {b}) * (1.0f / (1.0f + expf(-a))) * ({bl} * tanhf(b / {bl}))")


@dataclass
class _Projection:
    """One humming MoE GEMM (gate-up or down): its layer config and its repacked tensors."""

    config: object  # humming LayerConfig
    config_str: str
    weight: torch.Tensor
    weight_scale: torch.Tensor
    shape_n: int
    shape_k: int


@dataclass
class _Plan:
    """What a call with T tokens needs, decided once per (T, k) from shapes only."""

    n: int
    tuning13: str
    tuning2: str
    block13: int
    block2: int
    blocks13: int
    blocks2: int
    configs: dict = field(default_factory=dict)


class HummingMoEExperts:
    """MXFP4 routed experts repacked for humming, callable with the op's activations.

    Build with `prepare(w13, w2)` (cached) or directly; call as experts(z, ids, weights, beta, beta_lin)."""

    def __init__(self, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor], *,
                 inplace: bool = False, align: str = "triton"):
        h = _load_humming()
        if h is None:
            raise RuntimeError(_HUMMING_ERROR)
        if len(w13) != 2 or len(w2) != 2:
            raise ValueError("HummingMoEExperts needs MXFP4 (packed, scale) pairs")
        (p13, s13), (p2, s2) = w13, w2
        e, two_i, half_l = p13.shape
        L, inter = 2 * half_l, two_i // 2
        expect = {"w13 packed": (p13, (e, two_i, L // 2)), "w13 scale": (s13, (e, two_i, L // MXFP4_GROUP)),
                  "w2 packed": (p2, (e, L, inter // 2)), "w2 scale": (s2, (e, L, inter // MXFP4_GROUP))}
        for name, (t, shape) in expect.items():
            if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_cuda:
                raise ValueError(f"{name}: expected CUDA uint8 {shape}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if align not in ("triton", "torch"):
            raise ValueError(f"align must be 'triton' or 'torch', got {align!r}")
        self.num_experts, self.latent, self.inter = e, L, inter
        self.device = p13.device
        self.inplace = inplace
        self.align = "torch" if _TRITON_ERROR is not None else align
        self.w13 = self._prepare(h, p13, s13, two_i, L, inplace)
        self.w2 = self._prepare(h, p2, s2, L, inter, inplace)
        self.locks = torch.zeros(2048, dtype=torch.int32, device=self.device)  # Stream-K fix-up locks
        self.compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
        self._plans: dict[tuple[int, int], _Plan] = {}

    @staticmethod
    def _prepare(h, packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, inplace: bool) -> _Projection:
        """Checkpoint MXFP4 -> humming tensors, exactly the steps of vLLM's HummingMoEMethod for a
        `mxfp4` / compressed-tensors `mxfp4-pack-quantized` schema (E2M1 codes viewed as int32, E8M0 scales
        viewed as float8_e8m0fnu), then HummingMethod.transform_humming_layer."""
        e = packed.shape[0]
        packed, scale = packed.contiguous(), scale.contiguous()
        schema = h.HummingWeightSchema(b_dtype=h.dtypes.float4e2m1, bs_dtype=h.dtypes.float8e8m0,
                                       weight_scale_group_size=MXFP4_GROUP)
        tensors = {"weight": packed.view(torch.int32), "weight_scale": scale.view(torch.float8_e8m0fnu)}
        config = h.prepare_layer_config(
            shape_n=n, shape_k=k, weight_schema=schema, input_schema=None, num_experts=e,
            pad_n_to_multiple=PAD_N_MULTIPLE, pad_k_to_multiple=PAD_K_MULTIPLE, has_bias=False,
            torch_dtype=torch.bfloat16, device=packed.device, tensors=tensors)
        config, tensors = h.prepare_fp16_e8m0_scale(config, tensors)
        out = h.transform_humming_tensors(config, tensors)
        weight, weight_scale = out["weight"], out["weight_scale"]
        if set(out) - {"weight", "weight_scale"}:
            raise RuntimeError(f"unexpected humming tensors for MXFP4 W4A16: {sorted(out)}")
        if inplace:
            if weight.numel() * weight.element_size() != packed.numel() or \
                    weight_scale.numel() * weight_scale.element_size() != scale.numel():
                raise ValueError("inplace repack needs humming's layout to have the checkpoint's size (no padding): "
                                 f"n={n}, k={k}")
            packed.view(-1).copy_(weight.contiguous().view(torch.uint8).view(-1))
            scale.view(-1).copy_(weight_scale.contiguous().view(torch.uint8).view(-1))
            weight = packed.view(weight.dtype).view(weight.shape)
            weight_scale = scale.view(weight_scale.dtype).view(weight_scale.shape)
            del out
        return _Projection(config=config, config_str=config.to_str(), weight=weight, weight_scale=weight_scale,
                           shape_n=n, shape_k=k)

    def plan(self, t: int, k: int) -> _Plan:
        """GEMM configs for T*k valid rows (humming's SM90 heuristics), and the alignment sizes they imply."""
        key = (t, k)
        p = self._plans.get(key)
        if p is None:
            h = _load_humming()
            n = t * k
            cfgs = {}
            for name, proj in (("w13", self.w13), ("w2", self.w2)):
                cfg = h.get_heuristics_config(proj.config, shape_m=n, gemm_type="indexed", device=self.device)
                cfgs[name] = json.loads(json.dumps(cfg))
            b13, b2 = cfgs["w13"]["block_shape"][0], cfgs["w2"]["block_shape"][0]
            p = _Plan(n=n, tuning13=json.dumps(cfgs["w13"]), tuning2=json.dumps(cfgs["w2"]), block13=b13, block2=b2,
                      blocks13=max_align_blocks(n, self.num_experts, b13),
                      blocks2=max_align_blocks(n, self.num_experts, b2), configs=cfgs)
            self._plans[key] = p
        return p

    def warmup(self, token_counts, top_k: int, beta: float = 4.0, beta_lin: float = 25.0) -> dict:
        """Compile, in parallel, every GEMM these token counts need (humming compiles a config on its first
        use, one at a time: this gathers the distinct configs of all plans into one humming kernel list, which
        `HummingKernel.prepare_kernels` compiles with its parallel builder and caches by the same signature the
        per-call dict configs hit), then run each count once eagerly (process_input, Triton kernels).
        Returns {'compile_s', 'first_calls_s'} for the report."""
        import time

        from humming.kernel.humming import HummingKernel

        t0 = time.time()
        plans = [self.plan(int(t), top_k) for t in token_counts]
        for name, proj in (("w13", self.w13), ("w2", self.w2)):
            distinct = []
            for p in plans:
                if p.configs[name] not in distinct:
                    distinct.append(p.configs[name])
            table = [[i, i + 1, cfg] for i, cfg in enumerate(distinct)]
            HummingKernel.prepare_kernels(proj.config_str, self.compute_config, json.dumps(table), self.device)
        compile_s = time.time() - t0
        t0 = time.time()
        for t in token_counts:
            z = torch.zeros(int(t), self.latent, dtype=torch.bfloat16, device=self.device)
            ids = (torch.arange(int(t) * top_k, device=self.device) % self.num_experts).view(int(t), top_k)
            w = torch.ones(int(t), top_k, device=self.device)
            for mode in SITU_MODES:
                self(z, ids, w, beta, beta_lin, situ=mode)
        torch.cuda.synchronize(self.device)
        return {"compile_s": compile_s, "first_calls_s": time.time() - t0}

    def _align(self, ids: torch.Tensor, block: int, blocks: int):
        fn = moe_align_block_size_triton if self.align == "triton" else moe_align_block_size
        return fn(ids, self.num_experts, block, blocks)

    def __call__(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, beta: float, beta_lin: float,
                 situ: str | None = None) -> torch.Tensor:
        h = _load_humming()
        mode = situ or _situ_mode
        if z.dtype != torch.bfloat16:
            raise ValueError(f"humming path: bf16 activations only, got {z.dtype}")
        t, L = z.shape
        k = ids.shape[1]
        if L != self.latent:
            raise ValueError(f"z has {L} columns, the experts take {self.latent}")
        p = self.plan(t, k)
        n, inter = p.n, self.inter
        z = z.contiguous()
        sorted13, experts13, ntp13 = self._align(ids, p.block13, p.blocks13)
        if p.block2 == p.block13:
            sorted2, experts2, ntp2 = sorted13, experts13, ntp13
        else:
            sorted2, experts2, ntp2 = self._align(ids, p.block2, p.blocks2)

        gate_up = torch.empty(n, 2 * inter, dtype=torch.bfloat16, device=z.device)
        h.ops.humming_gemm(layer_config=self.w13.config_str, compute_config=self.compute_config,
                           tuning_config=p.tuning13, inputs=z, weight=self.w13.weight,
                           weight_scale=self.w13.weight_scale, outputs=gate_up, sorted_ids=sorted13,
                           expert_ids=experts13, num_tokens_padded=ntp13, locks=self.locks, top_k=k,
                           valid_shape_m=n)
        if mode == "humming":
            act = torch.empty(n, inter, dtype=torch.bfloat16, device=z.device)
            h.ops.process_input(gate_up, outputs=act, activation_type="binary_split",
                                activation_impl=situ_cuda_expression(beta, beta_lin))
        elif mode == "torch":
            act = _situ_torch(gate_up[:, :inter], gate_up[:, inter:], beta, beta_lin)
        else:
            raise ValueError(f"situ mode must be one of {SITU_MODES}, got {mode!r}")
        down = torch.empty(n, L, dtype=torch.bfloat16, device=z.device)
        h.ops.humming_gemm(layer_config=self.w2.config_str, compute_config=self.compute_config,
                           tuning_config=p.tuning2, inputs=act, weight=self.w2.weight,
                           weight_scale=self.w2.weight_scale, outputs=down, sorted_ids=sorted2,
                           expert_ids=experts2, num_tokens_padded=ntp2, locks=self.locks, top_k=1,
                           valid_shape_m=n)
        return weighted_slot_sum(down, weights)

    @property
    def extra_bytes(self) -> int:
        """Device bytes this object holds beyond the checkpoint tensors (0 for an in-place repack)."""
        if self.inplace:
            return self.locks.numel() * 4
        return sum(t.numel() * t.element_size() for t in (self.w13.weight, self.w13.weight_scale,
                                                          self.w2.weight, self.w2.weight_scale, self.locks))


def _situ_torch(a: torch.Tensor, b: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    return situ(a, b, beta, beta_lin)


@dataclass
class _Entry:
    experts: HummingMoEExperts
    refs: tuple
    versions: tuple


_CACHE: dict[tuple, _Entry] = {}


def _cache_key(w13, w2) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.dtype, str(t.device)) for t in (*w13, *w2))


def _lookup(w13, w2) -> HummingMoEExperts | None:
    key = _cache_key(w13, w2)
    entry = _CACHE.get(key)
    if entry is None:
        return None
    alive = all(r() is not None for r in entry.refs)
    same = alive and tuple(r()._version for r in entry.refs) == entry.versions
    if not same:  # freed (the address may be reused) or modified in place since prepared
        del _CACHE[key]
        return None
    return entry.experts


def prepare(w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...], *, inplace: bool = False) -> HummingMoEExperts:
    """Repack one layer's MXFP4 experts for humming, once (cached; see the module docstring for the memory
    cost of inplace=False and what inplace=True gives up). Call it eagerly before capturing a CUDA graph."""
    found = _lookup(w13, w2)
    if found is not None:
        if inplace and not found.inplace:
            raise ValueError("these experts were already prepared out of place; clear_cache() first")
        return found
    experts = HummingMoEExperts(tuple(w13), tuple(w2), inplace=inplace)
    tensors = (*w13, *w2)
    _CACHE[_cache_key(w13, w2)] = _Entry(experts, tuple(weakref.ref(t) for t in tensors),
                                         tuple(t._version for t in tensors))
    return experts


def release(w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...]) -> None:
    """Drop one weight set's prepared (repacked) tensors."""
    _CACHE.pop(_cache_key(w13, w2), None)


def clear_cache() -> None:
    """Drop every prepared (repacked) weight set."""
    _CACHE.clear()


def _humming_serves(z: torch.Tensor, w13) -> bool:
    return (len(w13) == 2 and z.is_cuda and z.dtype == torch.bfloat16 and z.shape[0] > 0
            and standard_available()[0])


def moe_experts_standard(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: tuple[torch.Tensor, ...],
                         w2: tuple[torch.Tensor, ...], beta: float, beta_lin: float) -> torch.Tensor:
    """Same signature and semantics as `moe.moe_experts` -> fp32 [T, L]. Humming path where it applies (MXFP4
    experts, bf16 activations, CUDA, humming importable), else the PyTorch fallback composition."""
    global _last_path
    if _humming_serves(z, w13):
        _last_path = "humming"
        return prepare(w13, w2)(z, ids, weights, beta, beta_lin)
    _last_path = "fallback"
    return moe_experts_fallback(z, ids, weights, w13, w2, beta, beta_lin)


# ---------------------------------------------------------------------------------------------------------
# PyTorch fallback composition
# ---------------------------------------------------------------------------------------------------------

_LUTS: dict[tuple, torch.Tensor] = {}
_WORD = {2: torch.int32, 4: torch.int64}  # a pair of values of this byte size, as one integer word


def _byte_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256] words: word b holds the two E2M1 values of byte b (low nibble first) in `dtype`."""
    key = (dtype, str(device))
    lut = _LUTS.get(key)
    if lut is None:
        mags = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float32)
        table = torch.cat([mags, -mags])
        b = torch.arange(256)
        pairs = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).to(dtype).contiguous()  # [256, 2]
        lut = pairs.view(_WORD[pairs.element_size()]).reshape(256).to(device)
        _LUTS[key] = lut
    return lut


def gather_dequantize(packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Dense [P, N, K] weights in `dtype` of experts[p] from MXFP4 (packed [E, N, K/2], scale [E, N, K/32]).

    Exact: every E2M1 value times a power of two is representable (as in `mxfp4.dequantize`)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gather_dequantize: unsupported dtype {dtype}")
    p = packed.index_select(0, experts)  # [P, N, K/2] uint8
    s = scale.index_select(0, experts)  # [P, N, K/32]
    words = _byte_lut(dtype, packed.device).index_select(0, p.reshape(-1).to(torch.int32))
    vals = words.view(dtype).view(*p.shape[:-1], -1, MXFP4_GROUP)  # [P, N, K/32, 32]
    factors = torch.exp2(s.to(torch.float32) - 127.0).to(dtype)
    return vals.mul_(factors.unsqueeze(-1)).flatten(-2)


def _expert_rows(w: tuple[torch.Tensor, ...], experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if len(w) == 2:
        return gather_dequantize(w[0], w[1], experts, dtype)
    return w[0].index_select(0, experts).to(dtype)


def fallback_chunk_pairs(w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...], dtype: torch.dtype,
                         max_temp_bytes: int = FALLBACK_TEMP_BYTES) -> int:
    """Pairs per chunk so that one chunk's gathered/dequantized temporaries stay under max_temp_bytes."""
    e, two_i = w13[0].shape[:2]
    L = w2[0].shape[1]
    inter = two_i // 2
    item = torch.empty((), dtype=dtype).element_size()
    dense = (two_i * L + L * inter) * item  # dequantized weights of one pair
    if len(w13) == 2:  # + packed bytes, their int32 table indices, and the table words (one per byte)
        raw = (two_i * L + L * inter) // 2
        dense += raw * (1 + 4) + raw * 2 * item
    else:
        dense += (two_i * L + L * inter) * w13[0].element_size()
    return max(1, max_temp_bytes // dense)


def moe_experts_fallback(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: tuple[torch.Tensor, ...],
                         w2: tuple[torch.Tensor, ...], beta: float, beta_lin: float, *,
                         max_temp_bytes: int = FALLBACK_TEMP_BYTES) -> torch.Tensor:
    """`moe.moe_experts` as a loop-free-over-experts PyTorch composition (CPU or GPU, capturable)."""
    t, L = z.shape
    k = ids.shape[1]
    n = t * k
    flat = ids.reshape(-1)
    w_flat = weights.reshape(-1).float()
    tok = torch.arange(n, device=z.device) // k
    out = torch.empty(n, L, dtype=torch.float32, device=z.device)
    chunk = fallback_chunk_pairs(w13, w2, z.dtype, max_temp_bytes)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        e = flat[start:stop]
        x = z.index_select(0, tok[start:stop]).unsqueeze(1)  # [P, 1, L]
        h13 = torch.bmm(x, _expert_rows(w13, e, z.dtype).transpose(1, 2)).squeeze(1)  # [P, 2I]
        a, b = h13.chunk(2, dim=-1)
        act = situ(a, b, beta, beta_lin).unsqueeze(1)  # [P, 1, I]
        hd = torch.bmm(act, _expert_rows(w2, e, z.dtype).transpose(1, 2)).squeeze(1)  # [P, L]
        out[start:stop] = w_flat[start:stop, None] * hd.float()
    return out.view(t, k, L).sum(1)
