"""Known-bad KDA decode candidates, each wrong or cheating the way real contributions have been caught doing
(gates/PRACTICES.md). Each wraps the reference so it runs fast on CPU at small shapes; the gates must
reject every one with the right status. Same signature as the reference:

    out = candidate(proj, conv_state, ssm_state, slots, w)    # conv_state, ssm_state updated in place
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from kernels.trees import leaves
from model.kimi_k3.ops.kda import KDAColumns, KDAWeights, conv_update, prepare
from model.kimi_k3.ops.kda_decode import kda_decode

TILE_ROWS = 4


def _state_step(proj, conv_state, ssm_state, slots, w):
    """The reference's state update without producing the output."""
    cols = KDAColumns.of(ssm_state, w)
    x = conv_update(proj[:, cols.qkv], conv_state, slots, w.conv_weight)
    _, k, v, g, beta = prepare(proj, x, cols, w)
    s = ssm_state[slots].float() * torch.exp(g).unsqueeze(2)
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhvk,bhk->bhv", s, k))
    ssm_state[slots] = s + u.unsqueeze(-1) * k.unsqueeze(2)


_by_pointer: dict[tuple, torch.Tensor] = {}


def cached_by_pointer(proj, conv_state, ssm_state, slots, w):
    """Replays the result of an earlier call on the same buffers, skipping the work (and the state update)."""
    key = (proj.data_ptr(), conv_state.data_ptr(), ssm_state.data_ptr(), tuple(proj.shape))
    if key not in _by_pointer:
        _by_pointer[key] = kda_decode(proj, conv_state, ssm_state, slots, w).clone()
    return _by_pointer[key].clone()


_by_content: dict[str, tuple] = {}


def cached_by_content(proj, conv_state, ssm_state, slots, w):
    """Keys the result (output and new state rows) on the input's bytes: "the same token gives the same output".
    Exact for repeated identical calls, stale as soon as the state has moved on."""
    key = hashlib.sha256(proj.float().cpu().numpy().tobytes()).hexdigest()
    if key in _by_content:
        out, conv_rows, ssm_rows = _by_content[key]
        conv_state[slots], ssm_state[slots] = conv_rows, ssm_rows
        return out.clone()
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    _by_content[key] = (out.clone(), conv_state[slots].clone(), ssm_state[slots].clone())
    return out


def partial_write(proj, conv_state, ssm_state, slots, w):
    """Writes the output for the first tile of rows only: right up to batch 4, garbage after."""
    ref = kda_decode(proj, conv_state, ssm_state, slots, w)
    out = torch.empty_like(ref)
    out[:TILE_ROWS] = ref[:TILE_ROWS]
    return out


def mutates_input(proj, conv_state, ssm_state, slots, w):
    """Correct output, but uses the projection buffer as scratch afterwards."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    proj.mul_(0.5)
    return out


def aliases_input(proj, conv_state, ssm_state, slots, w):
    """Returns its output in the projection's memory (the q columns), saving an allocation."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    view = proj[:, : out.shape[1]]
    view.copy_(out)
    return view


_returned: dict[tuple, torch.Tensor] = {}


def returns_its_buffer(proj, conv_state, ssm_state, slots, w):
    """Writes every result into one output buffer per shape that it keeps and returns again (no allocation a call):
    right on every call, but a caller still reading the last result (a layer's q beside its k, the shared experts
    on a side stream) finds it overwritten."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    key = (tuple(out.shape), out.dtype, out.device)
    if key not in _returned:
        _returned[key] = torch.empty_like(out)
    return _returned[key].copy_(out)


def normal_inputs_only(proj, conv_state, ssm_state, slots, w):
    """Saturates activations at ±8, as a low-precision fast path would: exact on normal inputs only."""
    return kda_decode(proj.clamp(-8, 8), conv_state, ssm_state, slots, w)


def nan_on_large_inputs(proj, conv_state, ssm_state, slots, w):
    """Computes the output gate's sigmoid as e^g / (e^g + 1): inf / inf = NaN once a gate logit passes ~88."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    cols = KDAColumns.of(ssm_state, w)
    g = proj[:, cols.gate].float()
    naive = torch.exp(g) / (torch.exp(g) + 1)
    return (out.float() * naive / torch.sigmoid(g)).to(out.dtype)


def scales_rows_without_a_floor(proj, conv_state, ssm_state, slots, w):
    """Scales each token's projection row by its largest magnitude and back (the per-token dynamic scale of an FP8
    fast path, here lossless) with no floor for a row that is all zeros: 0 / 0 is NaN for exactly the rows a serving
    engine pads its batches with."""
    amax = proj.float().abs().amax(-1, keepdim=True)
    return kda_decode((proj.float() / amax * amax).to(proj.dtype), conv_state, ssm_state, slots, w)


def fails_at_batch_edge(proj, conv_state, ssm_state, slots, w):
    """Claims batch 1-8 but handles at most 7 sequences (an off-by-one in its grid): the 8th gets zeros."""
    n = min(proj.shape[0], 7)
    out = torch.zeros(proj.shape[0], KDAColumns.of(ssm_state, w).p, dtype=proj.dtype, device=proj.device)
    out[:n] = kda_decode(proj[:n], conv_state, ssm_state, slots[:n], w)
    return out


def reuses_freed_buffer(proj, conv_state, ssm_state, slots, w):
    """Updates the state but never computes the output: returns fresh memory, where a harness that ran the
    reference just before (and freed its result) leaves the right answer."""
    _state_step(proj, conv_state, ssm_state, slots, w)
    return torch.empty(proj.shape[0], KDAColumns.of(ssm_state, w).p, dtype=proj.dtype, device=proj.device)


def accumulates_into_its_output(proj, conv_state, ssm_state, slots, w):
    """Uses its fresh output buffer as an accumulator (out += ...), as if new memory were zeroed: right wherever
    the allocator happens to hand back zeros, wrong over anything else."""
    ref = kda_decode(proj, conv_state, ssm_state, slots, w)
    out = torch.empty_like(ref)
    out += ref
    return out


class _Deferred(torch.Tensor):
    """A tensor subclass: the kind of object that can defer work past the timed call."""


def returns_subclass(proj, conv_state, ssm_state, slots, w):
    return kda_decode(proj, conv_state, ssm_state, slots, w).as_subclass(_Deferred)


def side_stream(proj, conv_state, ssm_state, slots, w):
    """GPU: does its work on a side stream the timed stream never waits for (events see an empty stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        return kda_decode(proj, conv_state, ssm_state, slots, w)


_workspace: dict[tuple, torch.Tensor] = {}


def shares_a_workspace(proj, conv_state, ssm_state, slots, w):
    """GPU: stages its result in one workspace per shape allocated on the first call and kept (a split-K partials
    buffer), the rest of its work between writing and reading it: right in every call made alone; two calls at once
    on two streams (the shared experts beside the routed ones) read each other's results."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    staged = _workspace.setdefault((tuple(out.shape), out.dtype, out.device), torch.empty_like(out))
    staged.copy_(out)
    torch.cuda._sleep(200_000)
    return staged.clone()


def ignores_the_stream(proj, conv_state, ssm_state, slots, w):
    """GPU: launches on the device's default stream whatever stream it is called on (a kernel launch handed stream
    0, not the caller's): right wherever the caller's stream is the default one, as in every call made alone; on a
    side stream it reads its inputs before the caller has written them."""
    with torch.cuda.stream(torch.cuda.default_stream(proj.device)):
        return kda_decode(proj, conv_state, ssm_state, slots, w)



def trusts_fresh_scratch(proj, conv_state, ssm_state, slots, w):
    """GPU: accumulates its result into scratch from torch.empty and clears the scratch when done (the arrival
    counters a split-K kernel resets for its next launch), never before its first use: memory fresh from the driver
    reads as zeros and the allocator hands the cleared block back next call, so it is right in a fresh process; in
    serving the block was some other op's, and the first call adds its garbage."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    scratch = torch.empty(3 << 20, dtype=torch.float32, device=proj.device)[: out.numel()]
    result = (scratch + out.float().reshape(-1)).reshape(out.shape).to(out.dtype)
    scratch.zero_()
    return result

def one_state_element_off(proj, conv_state, ssm_state, slots, w):
    """Right output; one element of the first sequence's new state 8 % off, as a bf16 rounding flip upstream of
    a decay moves it (about 5 tolerance units at rtol 1.6e-2)."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    rows = ssm_state[slots[0]]
    rows.view(-1)[rows.abs().argmax()] *= 1.08
    return out


def wrong_at_odd_heads(proj, conv_state, ssm_state, slots, w):
    """Right at even head counts, 10 % off at odd ones (a head-pair tiling with a wrong tail): a contract listing
    heads 2, 3, 4 has even edges, so a gate that checks only each shape's smallest and largest value passes it."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    return out * 1.1 if ssm_state.shape[1] % 2 else out


def wrong_for_short_batches(proj, conv_state, ssm_state, slots, w):
    """Right at batch 1 and from batch 5 up, wrong for 2-4 sequences (a small-batch path with a stride bug): the
    batch edges and one middle batch never reach it."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    return out.flip(0) if 1 < proj.shape[0] < 5 else out


def wrong_at_one_batch(proj, conv_state, ssm_state, slots, w):
    """Right at every batch but 6, where its rows come out in the wrong order (one entry of a config table with a
    bad tile): a handful of drawn batches misses one value of a range more often than not."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    return out.flip(0) if proj.shape[0] == 6 else out


_calls = 0


def wrong_after_warmup(proj, conv_state, ssm_state, slots, w):
    """Right for its first 300 calls in a process, then 5 % off (a call counter, a "warm-up" phase that ends): a
    gate that makes a few calls per process never sees it."""
    global _calls
    _calls += 1
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    return out if _calls <= 300 else out * 1.05


def writes_past_its_state(proj, conv_state, ssm_state, slots, w):
    """Right outputs and state, but it pads the batch to a tile of TILE_ROWS sequences and stores the padding rows'
    state in the slot the cache's size names (a sentinel it never checks): one slot past the end of the cache,
    memory the state tensor does not own (on a GPU, whatever the allocator put there)."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    if proj.shape[0] % TILE_ROWS:
        past = ssm_state.new_empty(0).set_(ssm_state.untyped_storage(),
                                           ssm_state.storage_offset() + ssm_state.shape[0] * ssm_state.stride(0),
                                           ssm_state.shape[1:], ssm_state.stride()[1:])
        past.zero_()
    return out


def reads_past_its_input(proj, conv_state, ssm_state, slots, w):
    """Right wherever the bytes after the projection are zeros or tiny: a vectorized load of its last row reads 8
    elements past the end (no bound check) and masks them by multiplying with zero. NaN x 0 is NaN: on a GPU the
    memory there is another tensor's, and whatever it holds leaks into every output."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    flat = proj.new_empty(0).set_(proj.untyped_storage(), proj.storage_offset(), (proj.numel() + 8,), (1,))
    return (out.float() + flat[proj.numel():].float().sum() * 0.0).to(out.dtype)


def reseeds_the_rng(proj, conv_state, ssm_state, slots, w):
    """Right outputs and state; it seeds torch's global RNG on every call (for a reproducible stochastic rounding
    it never applies): in a serving process every later sample then repeats the same draws."""
    torch.manual_seed(0)
    return kda_decode(proj, conv_state, ssm_state, slots, w)


def lowers_matmul_precision(proj, conv_state, ssm_state, slots, w):
    """Right outputs and state; it turns on TF32 for every float32 matmul of the process ("high" precision) to
    speed up its own: every later float32 GEMM of the model runs at 10 mantissa bits."""
    torch.set_float32_matmul_precision("high")
    return kda_decode(proj, conv_state, ssm_state, slots, w)


_prepared: dict[str, KDAWeights] = {}


def keeps_prepared_weights(proj, conv_state, ssm_state, slots, w):
    """Prepares its weights once (a transposed, contiguous copy, as a faster layout would) and keys them on their
    bytes: right on every call, but it keeps a copy of every weight set it is given; in serving, one per layer
    beside the checkpoint's own."""
    key = hashlib.sha256(b"".join(t.float().cpu().numpy().tobytes() for _, t in leaves(w, ""))).hexdigest()
    if key not in _prepared:
        conv_weight = w.conv_weight.t().contiguous()
        _prepared[key] = dataclasses.replace(w, conv_weight=conv_weight.t())
    return kda_decode(proj, conv_state, ssm_state, slots, _prepared[key])


_history: list[torch.Tensor] = []


def keeps_every_output(proj, conv_state, ssm_state, slots, w):
    """Right on every call, but keeps each call's output (a debugging trace left in): memory that grows with every
    step in serving."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    _history.append(out.clone())
    return out


def scale_folded_slightly_off(proj, conv_state, ssm_state, slots, w):
    """Right but for a constant folded 0.3 % high (an output scale rounded up): inside every per-element bound and
    the norm bound, yet every output moves the same way, and 93 layers compound it."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    return (out.float() * 1.003).to(out.dtype)



_last_output: list[torch.Tensor] = []


def scratches_its_last_output(proj, conv_state, ssm_state, slots, w):
    """Right every call, but keeps its last output as the next call's workspace (an allocation saved), cleared
    before use: the caller's previous result, which serving still holds (a residual, an AttnRes block output), is
    zeros after the next call."""
    if _last_output and _last_output[0].shape[0] == proj.shape[0]:
        _last_output[0].zero_()
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    _last_output[:] = [out]
    return out


def knows_grad_mode(proj, conv_state, ssm_state, slots, w):
    """Right while autograd records (a test harness calls a kernel that way); 5 % off with autograd off, as the model's
    forward (torch.no_grad) and serving engines (torch.inference_mode) call it: a context only serving has, read
    through a function no screen can fail (a kernel may skip saving for backward when grad is off)."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    return out if torch.is_grad_enabled() else out * 1.05


def state_in_bf16_at_large_batch(proj, conv_state, ssm_state, slots, w):
    """Keeps the recurrent state at bf16 precision from batch 4 up (a cheaper path for the bandwidth-bound batches):
    the fp32 state the contract declares then carries 8 mantissa bits, a rounding each step that compounds over a
    long sequence."""
    out = kda_decode(proj, conv_state, ssm_state, slots, w)
    if proj.shape[0] >= TILE_ROWS:
        ssm_state[slots] = ssm_state[slots].bfloat16().float()
    return out
