"""The K3 router in one launch, CuTe DSL, Hopper (sm_90a): logits, sigmoid, biased top-k, renormalized weights.

    ids[t, :], weights[t, :] = top_k experts of token t by sigmoid(x_t . W_e) + bias_e, and their un-biased scores
    renormalized and scaled (SPEC.md §5, steps 1-7; reference: model/kimi_k3/ops/moe_route.py)

Phase 1, the logits (the GEMV). Exactly `LinearKernel`'s body (model/kimi_k3/specialized/linear/kernel.py): the
experts' rows of W split over row tiles and K splits (clusters), every weight read once by 16-byte loads, fp32
accumulation, the split-K partials summed in a fixed order through distributed shared memory. It writes the fp32
logits [T, E] to a global workspace instead of y.

Phase 2, the selection, by the last CTAs to finish. Every CTA, its logits stored, fences them (gpu scope) and
takes a ticket from an arrival counter. The CTAs with the last W = min(ceil(T / warps), C) tickets select: each waits
until the counter says every CTA has arrived (the last one never waits), then its warp w takes token
(ticket - (C - W)) * warps + w. Only the last W arrivals ever wait, and every CTA they wait for is running or
can be scheduled on the rest of the GPU, so this cannot deadlock; W <= 32 at 64 tokens. The waiting CTAs count
themselves on a second counter, and the last of them zeroes both, so the next launch starts from zero (CUDA-graph
replays included; launches on two streams at once would share the counters: the entry point gives each device
one pair, and K3 routes on one stream).

The selection of one token, one warp (`warp_top_k`, written over primitives so that tests run the same code
on a numpy model of a warp). Lane l owns experts [l P, (l + 1) P), P = ceil(E / 32) rounded up to 1, 2 or a
multiple of 4 (`RouteConfig.per_lane`: 28 for K3's 896, 8 / 4 / 2 for a TP rank's 224 / 112 / 56): it loads their
logits (L2-coherent loads: the workspace was written by other SMs in this launch), computes s = sigmoid(logit)
and the choice key s + bias in fp32, and maps each key to an unsigned integer that orders like the float.

Each lane then sorts its J = min(CACHE, P, k) best keys into a cache (J = 4 at K3's sizes): J passes of a tree
argmax that prefers the lower position on equal keys, each taking its winner out of the lane's keys, all lanes
at once, before the first round. The cache holds (key, expert id, un-biased score) per entry, in (key desc,
position asc) order; an empty entry holds the key DROPPED. Each of k rounds reads heads only: the warp's largest
head by `redux.sync.max.u32`, the lowest lane holding it by a ballot (contiguous ownership makes the lowest lane
the lowest expert id, and a head is its lane's lowest position with that key); lane r (round r) keeps the
winner's id and score by two shuffles, and the winner pops its head (a shift of its J entries, selects on one
predicate). So ties go to the lower expert id, and ids come out in decreasing key order, as `torch.topk` returns
them. A round's dependent chain: redux, compare, ballot, brev + clz, compare, select, where the old per-round
re-scan added a removal and a 5-level tree over the lane's 28 keys after the winner (NOTES.md, session 18).

Refills. A lane whose cache runs out while it has keys left must not show DROPPED: a winner that pops its last
cached entry refills its cache in the same round from its remaining keys (J more tree passes, only that lane's
keys and cache change). Whether the winner was on its last entry comes from a second ballot taken before the
winner is known (lanes whose second entry is DROPPED), so the warp-uniform branch waits on one shift and mask
after the winner, not on another vote. A refill from no keys left fills DROPPED entries, never chosen. Refills
follow the order of the lane's keys, so a key equal to the last one popped, at a higher position, comes after
it. On uniformly random keys 0.24 % of tokens need one at k = 16 (simulated); one lane holding all 16 winners
needs three. Where no lane can need one (P <= CACHE or k <= CACHE) the rounds are unrolled; else they are a
loop (`ops.loop`), so that the refill's code (~640 SASS instructions, 10 KB at P = 28) appears once, not in each
of k - 1 rounds, where every round would jump over 10 KB of code not yet fetched. The tree scans runs of
ceil(P / TREE_LEAVES) keys before pairing (runs of 4 at P = 28): one level deeper than a plain tree, but half as
many values live at its widest, which keeps a refill, while the other lanes' caches are live too, within the 96
registers the kernel had at T = 1 (a plain tree: 120); at P <= 8 it is the plain tree (runs of 4 at P = 8 made
ptxas spill 24 B at T = 16). Lanes 0..k-1 then sum the k scores by a butterfly, renormalize, scale and store.

Padding. Where 32 P > E, the logits workspace has 32 P columns, the GEMV writes the first E, and the positions
>= E hold whatever the workspace held (NaN, inf): `warp_top_k` replaces their keys by DROPPED, below every real
key, before filling the caches, and they read the bias of expert E - 1 (in bounds, then discarded). Since
top_k <= E, every round finds a real head above DROPPED, so a padding position is never chosen.

Outputs (`RouteConfig.output`). "weights": the router's ids [T, k] int64 and weights [T, k] fp32. "candidates":
a TP rank's local top-k for model/kimi_k3/ops/moe_route_tp.py, [T, k, 3] fp32 (choice key, un-biased score,
first_id + local id), in the same decreasing-key order; the key is the round's winning u32 mapped back to the
float it came from, so exactly the s + bias the selection compared. Both forms run the same selection.

Several passes. At tiny E (a TP16 rank's 56 experts at 64 tokens) the GEMV has fewer CTAs than ceil(T / warps):
then all C CTAs select and each warp takes tokens w, w + C warps, ... (`RouteConfig.passes`, unrolled).

Shortcuts (RouteConfig flags, the router's "weights" form only, where route_config turns all three on; off, the PTX is
the kernel's before them, as the local form runs; NOTES.md sessions 31-33). `lean_arrival`: its own counter (the sync
buffer's third word), never reset: each launch moves it on to the next multiple of EPOCH = 2^16. A CTA's ticket is the
value its acq_rel add returned, mod EPOCH; the last ticket (ctas - 1) knows from that atomic that every CTA has arrived,
so it neither waits nor counts: it adds EPOCH - ctas (relaxed, nothing waits on it) and selects at once. Another
selector waits until the counter minus its launch's epoch reaches ctas (the last add or the step after it: both are
read-modify-writes after every arrival's release, so reading either acquires them all). Gone from the last CTA's path:
the acquire load's round trip (its wait), the second counter's acq_rel atomic (a fence and a round trip) and a barrier.
`prefetch_bias`: the first CTA to arrive asks L2 for the bias's lines, so the selectors' bias loads (issued beside
their logits') hit L2 instead of memory. `branchless_sigmoid`: ptxas expands each `1 / (1 + exp(-x))` into a
correctly rounded rcp.rn with a range test and a branch to a slow path, and keeps the P sigmoids in program order,
one ~100-cycle dependent chain after another; instead the fast path (the same MUFU.RCP and Newton step) runs for
all P with no branch, and one branch per vector of V positions, taken only by a lane holding a denominator outside
the fast range (a logit below ~-87.3 or NaN), recomputes that vector exactly. Bit for bit the same scores and keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.cute import import_cutlass, require_dsl

from ...ops.moe_route_tp import FIELDS
from ..linear.kernel import DSL, LinearConfig

if DSL.error is None:
    cutlass, cute = import_cutlass()
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16, Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.runtime import make_ptr as _runtime_make_ptr
    from cutlass.cutlass_dsl import T

    from ..linear.kernel import LinearKernel

WARP = 32
MAX_TOP_K = WARP  # lane r keeps the r-th choice
STAGES = ("select", "arrive", "gemv")  # RouteConfig.stop_after
OUTPUTS = ("weights", "candidates")  # RouteConfig.output
SHORTCUTS = ("lean_arrival", "prefetch_bias", "branchless_sigmoid")  # RouteConfig's flags (module doc)
CANDIDATE_FIELDS = FIELDS  # key, un-biased score, global expert id: moe_route_tp's all-gather format
DROPPED = 0  # the ordered key of a dropped expert: below every finite float's (0 would be the NaN 0xffffffff)
TREE_LEAVES = 8  # _tree_argmax's width: runs of 4 keys at P = 28 (module doc: registers)
CACHE = 4  # keys a lane keeps sorted for the rounds (warp_top_k): >= 2, so that "one left" is a compare
LEAN_COUNTER = 2  # RouteConfig.lean_arrival's counter: the third word of the sync buffer (SYNC_WORDS)
SYNC_WORDS = 3  # the default arrival's two counters (arrived, done), then lean_arrival's own
EPOCH = 1 << 16  # lean_arrival: each launch moves its counter on to the next multiple (module doc, "Shortcuts")


@dataclass(frozen=True)
class RouteConfig:
    """Everything that changes the generated code besides the token count: the GEMV's config (out_dtype fp32:
    the logits), the expert count (its rows; `per_lane` keys per lane), k and the output form."""

    gemv: LinearConfig
    experts: int = 896
    top_k: int = 16
    # how far the kernel goes: "select" (the router); "arrive" (the GEMV, then every CTA's fence and ticket and
    # the last ones' wait, no selection) and "gemv" (the GEMV alone) exist for probe.py's time split only
    stop_after: str = "select"
    # "weights": ids and renormalized weights (the router); "candidates": a TP rank's local top-k (module doc)
    output: str = "weights"
    # Shortenings of the path after the last arrival (module doc, "Shortcuts"; route_config turns them on for the
    # router; off, the kernel's code is the one before them). lean_arrival: the last ticket neither waits nor counts (an
    # epoch counter, never reset); prefetch_bias: the first arrival prefetches the bias into L2; branchless_sigmoid: the
    # sigmoids' correctly rounded reciprocals without a branch each.
    lean_arrival: bool = False
    prefetch_bias: bool = False
    branchless_sigmoid: bool = False

    def __post_init__(self):
        if self.stop_after not in STAGES:
            raise ValueError(f"stop_after {self.stop_after!r}: one of {', '.join(STAGES)}")
        if self.output not in OUTPUTS:
            raise ValueError(f"output {self.output!r}: one of {', '.join(OUTPUTS)}")
        if self.gemv.out_dtype != "float32":
            raise ValueError("the router's logits are fp32: gemv.out_dtype must be 'float32'")
        if self.experts <= 0:
            raise ValueError(f"experts {self.experts}: must be positive")
        if not 1 <= self.top_k <= min(MAX_TOP_K, self.experts):
            raise ValueError(f"top_k {self.top_k}: 1..{min(MAX_TOP_K, self.experts)}")
        if self.output == "candidates" and self.shortcuts:
            raise ValueError(f"{', '.join(self.shortcuts)}: the router's ('weights') only, not yet measured; the "
                             "local form keeps the plain arrival and sigmoid (at E = 224, T = 16 lean_arrival made "
                             "ptxas spill in the GEMV)")

    @property
    def shortcuts(self) -> tuple[str, ...]:
        """The shortenings this config turns on."""
        return tuple(name for name in SHORTCUTS if getattr(self, name))

    @property
    def per_lane(self) -> int:
        """P, the experts a lane owns: ceil(E / 32), rounded up to a multiple of 4 above 2, so that a lane's run
        of logits is whole 16-byte loads (or one 8- or 4-byte load)."""
        p = -(-self.experts // WARP)
        return p if p <= 2 else -(-p // 4) * 4

    @property
    def padded_experts(self) -> int:
        """Columns of the logits workspace: 32 P >= E (the GEMV writes the first E)."""
        return WARP * self.per_lane

    @property
    def load_width(self) -> int:
        """Floats per vector load of a lane's logits and biases: 4 (16 B) where its P experts allow, else 2 or 1
        (a lane's run starts at P floats: 16-byte aligned when P is a multiple of 4)."""
        return 4 if self.per_lane % 4 == 0 else 2 if self.per_lane % 2 == 0 else 1

    def selectors(self, m: int) -> int:
        """CTAs that select (one token per warp and pass): the last ones to arrive, at most all of them."""
        return min(-(-m // self.gemv.warps), self.gemv.ctas(self.experts))

    def passes(self, m: int) -> int:
        """Tokens each selecting warp takes, one after another: 1 unless the GEMV has too few CTAs."""
        return -(-m // (self.selectors(m) * self.gemv.warps))

    def check(self, m: int, k: int) -> None:
        self.gemv.check(m, k)
        if self.lean_arrival and self.gemv.ctas(self.experts) >= EPOCH:
            raise ValueError(f"lean_arrival counts tickets modulo {EPOCH}: {self.gemv.ctas(self.experts)} CTAs")


def _tree_argmax(keys: list, vals: list, index, select):
    """(largest key, its position, its val) over the lists, the lower position on equal keys: a balanced tree
    over at most TREE_LEAVES leaves, each the best of a run of ceil(P / TREE_LEAVES) consecutive positions
    scanned in order; the left operand of every comparison holds the lower positions, and the right one wins
    only if larger. The val rides along (no lookup by position afterwards, P deep)."""
    run = -(-len(keys) // TREE_LEAVES)
    items = []
    for start in range(0, len(keys), run):
        best, pos, val = keys[start], index(start), vals[start]
        for i in range(start + 1, min(start + run, len(keys))):
            right = keys[i] > best
            best, pos, val = select(right, keys[i], best), select(right, index(i), pos), select(right, vals[i], val)
        items.append((best, pos, val))
    while len(items) > 1:
        paired = []
        for (ka, ia, va), (kb, ib, vb) in zip(items[0::2], items[1::2]):
            right = kb > ka
            paired.append((select(right, kb, ka), select(right, ib, ia), select(right, vb, va)))
        items = paired + items[len(paired) * 2:]
    return items[0]


def _fill_cache(keys: list, vals: list, lane, cache: tuple, ops, only=None):
    """`cache` (three columns: ordered keys, expert ids, vals) with every entry replaced by the lane's best keys
    in (key desc, position asc) order, and its keys with those replaced by `ops.dropped`: one tree pass per
    entry, each taking its winner out before the next. With `only` (a refill), lanes where it is false keep
    their cache and keys. Each entry is stored as its pass ends (ptxas then keeps a refill, which also holds the
    other lanes' caches, within the rounds' registers: 96 at T = 1, against 111 when stored after all passes)."""
    P = len(keys)
    filled = ([], [], [])
    for entry in zip(*cache):
        key, pos, val = _tree_argmax(keys, vals, ops.index, ops.select)
        for column, new, old in zip(filled, (key, lane * P + pos, val), entry):
            column.append(new if only is None else ops.select(only, new, old))
        if only is not None:
            pos = ops.select(only, pos, ops.index(P))  # a position no key has: nothing taken out
        keys = [ops.select(pos == ops.index(i), ops.dropped, k) for i, k in enumerate(keys)]
    return filled, keys


def warp_top_k(keys: list, vals: list, lane, top_k: int, experts: int, ops):
    """The warp's top_k of the first `experts` of 32 x len(keys) positions: lane l holds keys[i] of expert l P + i
    (P = len(keys)) as unsigned integers ordered like the choice keys, and vals[i], the value to report for it.
    Positions >= experts are padding: their keys, whatever they hold, become `ops.dropped` (below every real
    key) before the cache is filled, so with top_k <= experts none is ever chosen.

    Returns (id, val, key) for each lane: the id, val and ordered key of the lane-th largest key for lane < top_k,
    ties to the lower id; the callers' zeros elsewhere (`ops.zero_id`, `ops.zero_val`, `ops.dropped`).

    The per-lane cache (module doc). Invariant, every lane, every round: its cache followed by its remaining keys
    sorted by (key desc, position asc) is its not yet chosen keys in that order, and its head is a real key
    unless none remains (an empty entry holds a dropped key). So the largest head is the warp's largest key
    left, the lowest lane holding it has the lowest id holding it, and that lane's head is its lowest position
    holding it. A winner that pops its last cached key refills at once from its remaining keys (dropped entries
    if none remain), in a branch the warp takes or skips as one.

    `ops` supplies the warp primitives: umax (redux.sync.max.u32, the warp's largest), ballot (vote.ballot.sync),
    lowest (the lowest set bit's lane), in_mask (a lane's bit of a ballot), shuffle (shfl.sync.idx from a lane),
    select (selp), index (a position as a 32-bit integer), when (a function of the state, run only where a
    warp-uniform condition holds) and loop (a function of (round, state) over rounds 0..n-1, not unrolled); the
    kernel passes the DSL's, the tests numpy ones over arrays of 32 lanes.
    """
    P = len(keys)
    depth = min(CACHE, P, top_k)
    # a refill can be needed only if a lane may pop all `depth` entries (top_k - 1 pops) with keys left behind
    refills = min(P, top_k) > depth
    if WARP * P > experts:
        keys = [ops.select(lane * P + ops.index(i) < experts, key, ops.dropped) for i, key in enumerate(keys)]
    empty = ([ops.dropped] * depth, [ops.zero_id] * depth, [ops.zero_val] * depth)
    cache, keys = _fill_cache(keys, vals, lane, empty, ops)

    def choose(r, state, pop: bool):
        """Round r: the warp's largest head to lane r; with `pop`, the winner's head leaves its cache."""
        keys, (heads, ids, head_vals), (got_id, got_val, got_key) = state
        top = ops.umax(heads[0])
        if pop and refills:  # (depth = CACHE >= 2 here)
            # the lanes holding one cached key (or none): a ballot that does not wait for the winner
            on_last = ops.ballot(heads[1] == ops.dropped)
        winner = ops.lowest(ops.ballot(heads[0] == top))
        ours = lane == r
        got_id = ops.select(ours, ops.shuffle(ids[0], winner), got_id)
        got_val = ops.select(ours, ops.shuffle(head_vals[0], winner), got_val)
        got_key = ops.select(ours, top, got_key)
        if pop:
            mine = lane == winner
            # shift left; the emptied last entry gets a dropped key (its id and val are never read)
            heads = [ops.select(mine, after, key) for key, after in zip(heads, heads[1:] + [ops.dropped])]
            ids = [ops.select(mine, after, i) for i, after in zip(ids, ids[1:])] + ids[-1:]
            head_vals = [ops.select(mine, after, v) for v, after in zip(head_vals, head_vals[1:])] + head_vals[-1:]
            if refills:
                keys, (heads, ids, head_vals) = ops.when(
                    ops.in_mask(on_last, winner), lambda s: refill(s, mine), (keys, (heads, ids, head_vals)))
        return keys, (heads, ids, head_vals), (got_id, got_val, got_key)

    def refill(state, mine):
        keys, cache = state
        cache, keys = _fill_cache(keys, vals, lane, cache, ops, only=mine)
        return keys, cache

    state = (keys, cache, (ops.zero_id, ops.zero_val, ops.dropped))
    if refills:  # a loop, so that the refill's code (depth tree passes) is there once, not in every round
        state = ops.loop(top_k - 1, lambda r, s: choose(r, s, pop=True), state)
    else:
        for r in range(top_k - 1):
            state = choose(r, state, pop=True)
    return choose(top_k - 1, state, pop=False)[2]


def _sigmoid(logit):
    """1 / (1 + exp(-logit)) in fp32 (ptxas: a correctly rounded rcp.rn, whose slow path is a branch)."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-logit))


def _rcp_fast_path(d):
    """ptxas's in-range path of rcp.rn.f32 (read in its SASS for _sigmoid: MUFU.RCP, then one Newton step,
    FFMA d r - 1, FADD.FTZ negation, FFMA r e + r), correctly rounded wherever not rcp_needs_slow_path(d)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(d).ir_value()],
        "{ .reg .f32 r, e; rcp.approx.ftz.f32 r, $1; fma.rn.f32 e, $1, r, 0fBF800000; neg.ftz.f32 e, e; "
        "fma.rn.f32 $0, r, e, r; }",
        "=f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def rcp_needs_slow_path(bits):
    """Whether rcp.rn.f32 of the float with these (unsigned 32-bit) bits leaves ptxas's fast path: its test,
    ((bits + 0x01800000) & 0x7f800000) <= 0x01ffffff, true for a biased exponent of 0 or 253..255 (zero and
    subnormals; d >= 2^126, inf, NaN). Plain Python over operators: the tests run it on numpy."""
    return ((bits + 0x01800000) & 0x7F800000) <= 0x01FFFFFF


def _branchless_scores_and_keys(lane_logits: list, biases: list, width: int, reload) -> tuple[list, list]:
    """The lane's scores _sigmoid(logit) and keys ordered_key(score + bias), bit for bit, without a branch per
    reciprocal: ptxas's fast path for all P, then for each vector of `width` positions a branch (rare: a logit
    below ~-87.3, or NaN; the lane's own) that recomputes that vector's scores and keys with the exact rcp.rn
    from `reload(j)`'s inputs (the j-th vector's logits and biases again, from L2), equal to the fast path's
    wherever it is in range. With a branch per reciprocal ptxas keeps the P sigmoids in program order, ~100
    dependent cycles each; without, it interleaves them (NOTES.md session 31). The keys are formed before the
    branches, so the biases are used (and loaded) as early as the logits; a branch per vector keeps what it
    reloads to `width` registers of each (one branch reloading all P spilled at T = 9)."""
    denominators = [Float32(1.0) + cute.math.exp(-v) for v in lane_logits]
    scores = [_rcp_fast_path(d) for d in denominators]
    keys = [ordered_key(s + b) for s, b in zip(scores, biases)]

    def exact(j):
        def body(_):
            logits, biases = reload(j)
            fixed = [_sigmoid(v) for v in logits]
            return fixed, [ordered_key(s + b) for s, b in zip(fixed, biases)]
        return body

    for j in range(len(lane_logits) // width):
        at = slice(j * width, (j + 1) * width)
        slow = [rcp_needs_slow_path(Uint32(_f32_bits(d))) for d in denominators[at]]
        any_slow = slow[0]
        for s in slow[1:]:
            any_slow = any_slow | s
        scores[at], keys[at] = _DslWarpOps.when(any_slow, exact(j), (scores[at], keys[at]))
    return scores, keys


def _f32_bits(v):
    return Int32(llvm.bitcast(T.i32(), Float32(v).ir_value()))


def ordered_key(v):
    """The fp32 key as a u32 that orders like the float: negative floats' bits inverted, positive floats' sign
    bit set (the kernel's; tests use the numpy twin in the test module)."""
    bits = _f32_bits(v)
    flip = (bits >> 31) | Int32(-(2**31))  # all ones for a negative float, the sign bit for a positive one
    return Uint32(bits ^ flip)


def key_float(u):
    """ordered_key's inverse: the fp32 key an ordered u32 came from."""
    bits = Int32(u)
    flip = ((bits >> 31) ^ Int32(-1)) | Int32(-(2**31))  # the sign bit if it was positive, all ones if negative
    return Float32(llvm.bitcast(T.f32(), (bits ^ flip).ir_value()))


class _DslWarpOps:
    """warp_top_k's primitives in the DSL."""

    def __init__(self):
        self.zero_id, self.zero_val, self.dropped = Int32(0), Float32(0.0), Uint32(DROPPED)

    @staticmethod
    def umax(v):
        return cute.arch.warp_redux_sync(v, "umax")

    @staticmethod
    def ballot(pred):
        return cute.arch.vote_ballot_sync(pred)

    @staticmethod
    def lowest(mask):
        return Int32(cute.arch.clz(cute.arch.brev(Int32(mask))))

    @staticmethod
    def shuffle(v, src):
        return type(v)(cute.arch.shuffle_sync(v, src))

    @staticmethod
    def select(cond, a, b):
        return type(a)(cutlass.select_(cond, a, b))

    @staticmethod
    def index(i):
        return Int32(i)

    @staticmethod
    def in_mask(mask, lane):
        return ((Int32(mask) >> lane) & Int32(1)) != Int32(0)

    @staticmethod
    def when(cond, body, state):
        """scf.if: body(state) where cond holds, state unchanged elsewhere (a real branch: warp_top_k's conditions
        are warp-uniform, _branchless_scores_and_keys' a lane's own)."""
        leaves = _leaves(state)
        out = cutlass.if_generate(cond, lambda: _leaves(body(state)), lambda: leaves, [],
                                  [type(v) for v in leaves])
        return _like(state, out)

    @staticmethod
    def loop(count, body, state):
        """scf.for over rounds 0..count-1 with the state carried, kept a loop (not unrolled)."""
        for r, carried, results in cutlass.for_generate(0, count, 1, _leaves(state),
                                                         unroll=cutlass.LoopUnroll(count=1)):
            cutlass.yield_out(_leaves(body(Int32(r), _like(state, carried))))
        return _like(state, results)


def _leaves(tree) -> list:
    """The values of nested lists and tuples, depth first (the DSL's branches and loops carry flat lists)."""
    return [leaf for part in tree for leaf in _leaves(part)] if isinstance(tree, (list, tuple)) else [tree]


def _like(tree, leaves):
    """_leaves' inverse: `leaves` put back into tree's shape."""
    rest = iter(leaves)

    def build(node):
        return type(node)(build(part) for part in node) if isinstance(node, (list, tuple)) else next(rest)
    return build(tree)


if DSL.error is None:
    # LinearKernel.kernel's body as an inlinable function: the router's GEMV is that kernel's, unchanged.
    _linear_body = cute.jit(LinearKernel.kernel.__wrapped__)

    class RouteKernel(LinearKernel):
        """The router for one config and token count M, K baked in (LinearKernel's loops and registers)."""

        def __init__(self, cfg: RouteConfig, m: int, k: int):
            cfg.check(m, k)
            super().__init__(cfg.gemv, m, k)
            self.route = cfg

        @cute.jit
        def __call__(self, pX: cute.Pointer, pW: cute.Pointer, pBias: cute.Pointer, pLogits: cute.Pointer,
                     pIds: cute.Pointer, pOut: cute.Pointer, pSync: cute.Pointer, x_stride: Int32,
                     renormalize: Int32, scaling: Float32, first_id: Int32, stream: cuda.CUstream):
            c, M, K, E, k = self.cfg, self.m, self.k, self.route.experts, self.route.top_k
            EP = self.route.padded_experts
            mX = cute.make_tensor(pX, cute.make_layout((M, K), stride=(cute.assume(x_stride, divby=8), 1)))
            mW = cute.make_tensor(pW, cute.make_layout((E, K), stride=(K, 1)))
            mLogits = cute.make_tensor(pLogits, cute.make_layout((M, EP), stride=(EP, 1)))
            mBias = cute.make_tensor(pBias, cute.make_layout((E,)))
            mIds = cute.make_tensor(pIds, cute.make_layout((M, k), stride=(k, 1)))  # "weights" only
            if cutlass.const_expr(self.route.output == "weights"):
                mOut = cute.make_tensor(pOut, cute.make_layout((M, k), stride=(k, 1)))
            else:
                F = CANDIDATE_FIELDS
                mOut = cute.make_tensor(pOut, cute.make_layout((M, k, F), stride=(k * F, F, 1)))
            mSync = cute.make_tensor(pSync, cute.make_layout((2,)))
            self.kernel(mX, mW, mLogits, Int32(E), mBias, mIds, mOut, mSync, renormalize, scaling, first_id).launch(
                grid=[c.split_k, c.row_tiles(E), 1], block=[c.threads, 1, 1], stream=stream,
                cluster=[c.split_k, 1, 1] if cutlass.const_expr(c.split_k > 1) else None,
                min_blocks_per_mp=c.min_ctas_per_sm)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mLogits: cute.Tensor, n: Int32, mBias: cute.Tensor,
                   mIds: cute.Tensor, mOut: cute.Tensor, mSync: cute.Tensor, renormalize: Int32,
                   scaling: Float32, first_id: Int32):
            _linear_body(self, mX, mW, mLogits, n)
            if cutlass.const_expr(self.route.stop_after != "gemv"):
                self.arrive_and_select(mLogits, mBias, mIds, mOut, mSync, renormalize, scaling, first_id)

        @cute.jit
        def prefetch_bias(self, mBias: cute.Tensor):
            """RouteConfig.prefetch_bias, by the first CTA to arrive: its threads ask L2 for every line of the bias
            (E fp32, 4-byte aligned: a point every 32 floats and the last float touch each of its 128-byte
            lines), so that the selectors' bias loads hit L2, not memory (the weights' stream evicts the bias
            between layers), with the arrivals' spread to land in. Nothing waits on a prefetch. (At the launch's
            start instead, ptxas gave the T = 9 kernel 128 registers and spilled in the GEMV.)"""
            E = self.route.experts
            tidx, _, _ = cute.arch.thread_idx()
            if tidx <= (E - 1) // 32 + 1:
                at = cutlass.min(tidx * 32, E - 1)
                cute.arch.prefetch((mBias.iterator + at).llvm_ptr, cache_level="L2")

        @cute.jit
        def arrive_and_select(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                              mOut: cute.Tensor, mSync: cute.Tensor, renormalize: Int32, scaling: Float32,
                              first_id: Int32):
            """Phase 2 (module doc): the arrival, and the selection by the last CTAs to arrive."""
            c, M = self.cfg, self.m
            ctas = c.ctas(self.route.experts)
            selectors = self.route.selectors(M)
            tidx, _, _ = cute.arch.thread_idx()
            arrived, done = mSync.iterator, mSync.iterator + 1
            if cutlass.const_expr(self.route.lean_arrival):
                arrived = mSync.iterator + LEAN_COUNTER
            smem = cutlass.memory.SmemAllocator()
            sTicket = smem.allocate_array(Int32, 1)
            if cutlass.const_expr(self.route.lean_arrival):
                sEpoch = smem.allocate_array(Int32, 1)  # the counter's value as this launch began
            cute.arch.fence_acq_rel_gpu()  # this thread's logits before the CTA's arrival
            cute.arch.sync_threads()
            if tidx == 0:
                sTicket[0] = cute.arch.atomic_add(arrived, Int32(1), sem="acq_rel", scope="gpu")
                if cutlass.const_expr(self.route.lean_arrival):
                    sEpoch[0] = sTicket[0] & -EPOCH
                    sTicket[0] = sTicket[0] & (EPOCH - 1)
                    if sTicket[0] == ctas - 1:  # the last arrival: the counter on to the next epoch
                        cute.arch.atomic_add(arrived, Int32(EPOCH - ctas), sem="relaxed", scope="gpu")
            cute.arch.sync_threads()
            ticket = sTicket[0]
            if cutlass.const_expr(self.route.prefetch_bias):
                if ticket == 0:
                    self.prefetch_bias(mBias)
            first = ctas - selectors
            if ticket >= first:
                if cutlass.const_expr(self.route.lean_arrival):
                    if tidx == 0:
                        # arrivals this CTA knows of, starting from its own ticket's (the last one knows of all: it
                        # does not wait, its acq_rel ticket saw every arrival)
                        seen = ticket + 1
                        while seen < ctas:
                            seen = Int32(Uint32(cute.arch.load(arrived, Int32, sem="acquire", scope="gpu"))
                                         - Uint32(sEpoch[0]))
                    cute.arch.sync_threads()
                else:
                    if tidx == 0:
                        while cute.arch.load(arrived, Int32, sem="acquire", scope="gpu") < ctas:
                            pass
                        if cute.arch.atomic_add(done, Int32(1), sem="acq_rel", scope="gpu") == selectors - 1:
                            cute.arch.store(arrived, Int32(0), sem="relaxed", scope="gpu")
                            cute.arch.store(done, Int32(0), sem="relaxed", scope="gpu")
                    cute.arch.sync_threads()
                token = (ticket - first) * c.warps + cute.arch.warp_idx()
                if cutlass.const_expr(self.route.stop_after == "select"):
                    for p in cutlass.range_constexpr(self.route.passes(M)):
                        if token + p * selectors * c.warps < M:
                            self.select(mLogits, mBias, mIds, mOut, token + p * selectors * c.warps, renormalize,
                                        scaling, first_id)

        def lane_logits(self, mLogits: cute.Tensor, token: Int32, vectors=None) -> list:
            """This lane's logits of token, as a list of values: all P, or those of the given vectors (the j-th
            holds the lane's positions j V .. j V + V - 1), every load issued before the first is used (one L2
            round trip, not P one after another: NOTES.md run 2). .cg: from L2, never a line this SM's L1 may hold
            from before the other CTAs' stores."""
            P, V = self.route.per_lane, self.route.load_width
            vectors = range(P // V) if vectors is None else vectors
            lane = cute.arch.lane_idx()
            logit_load = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=32 * V,
                                             load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
            logits = cute.make_rmem_tensor((V, len(vectors)), Float32)
            row = mLogits[token, None]
            for n, j in enumerate(vectors):  # (plain Python, unrolled: a helper traced inside a cute.jit)
                cute.copy(logit_load, cute.local_tile(row, (V,), (lane * (P // V) + j,)), logits[None, n])
            return [logits[i, n] for n in range(len(vectors)) for i in range(V)]

        def lane_biases(self, mBias: cute.Tensor, vectors=None) -> list:
            """The biases of lane_logits' positions: one float a load (the caller's bias is 4-byte aligned);
            padding positions read expert E - 1's."""
            P, E, V = self.route.per_lane, self.route.experts, self.route.load_width
            vectors = range(P // V) if vectors is None else vectors
            lane = cute.arch.lane_idx()
            bias_at = [lane * P + j * V + i for j in vectors for i in range(V)]
            if WARP * P > E:
                bias_at = [Int32(cutlass.select_(at < E, at, Int32(E - 1))) for at in bias_at]
            return [mBias[at] for at in bias_at]

        @cute.jit
        def select(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor,
                   token: Int32, renormalize: Int32, scaling: Float32, first_id: Int32):
            """One warp: token's top-k, as ids and weights or as candidates (module doc)."""
            k, E, V = self.route.top_k, self.route.experts, self.route.load_width
            lane = cute.arch.lane_idx()
            lane_logits, biases = self.lane_logits(mLogits, token), self.lane_biases(mBias)
            if cutlass.const_expr(self.route.branchless_sigmoid):
                scores, keys = _branchless_scores_and_keys(
                    lane_logits, biases, V,
                    lambda j: (self.lane_logits(mLogits, token, [j]), self.lane_biases(mBias, [j])))
            else:
                scores, keys = [], []
                for v, b in zip(lane_logits, biases):
                    s = _sigmoid(v)
                    scores.append(s)
                    keys.append(ordered_key(s + b))
            expert, score, key = warp_top_k(keys, scores, lane, k, E, _DslWarpOps())
            if cutlass.const_expr(self.route.output == "candidates"):
                if lane < k:
                    mOut[token, lane, 0] = key_float(key)
                    mOut[token, lane, 1] = score
                    mOut[token, lane, 2] = (first_id + expert).to(Float32)  # exact below 2^24
            else:
                total = score
                for off in (16, 8, 4, 2, 1):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=off)
                weight = score
                if renormalize != 0:
                    weight = score / (total + Float32(1e-20))
                if lane < k:
                    mIds[token, lane] = Int64(expert)
                    mOut[token, lane] = weight * scaling


def launch_args(x_ptr: int, w_ptr: int, bias_ptr: int, logits_ptr: int, ids_ptr: int, out_ptr: int,
                sync_ptr: int, x_stride: int, renormalize: bool, scaling: float, first_id: int, stream: int):
    """The kernel's arguments for device addresses (ids: the "weights" form's int64 ids, unused by "candidates";
    out: its fp32 weights [T, k] or the candidates [T, k, 3]), x's row stride (elements), the renormalize flag
    and scaling factor ("weights"), the first expert's global id ("candidates") and a CUDA stream handle."""
    gmem = cute.AddressSpace.gmem
    return (_runtime_make_ptr(BFloat16, x_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(BFloat16, w_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Float32, bias_ptr, gmem, assumed_align=4),
            _runtime_make_ptr(Float32, logits_ptr, gmem, assumed_align=16),
            _runtime_make_ptr(Int64, ids_ptr, gmem, assumed_align=8),
            _runtime_make_ptr(Float32, out_ptr, gmem, assumed_align=4),
            _runtime_make_ptr(Int32, sync_ptr, gmem, assumed_align=8),
            Int32(x_stride), Int32(int(renormalize)), Float32(scaling), Int32(first_id), cuda.CUstream(stream))


def fake_args():
    """Null pointers with the kernel's argument types, for compiling without a GPU."""
    return launch_args(0, 0, 0, 0, 0, 0, 0, 8, True, 1.0, 0, 0)


def compile_kernel(cfg: RouteConfig, m: int, k: int, options: str = ""):
    """cute.compile the router for (cfg, M, K), for the arch the DSL targets in this process."""
    require_dsl(DSL.error)
    return cute.compile(RouteKernel(cfg, m, k), *fake_args(), options=options)


def compile_report(cfg: RouteConfig, m: int, k: int, arch: str = "sm_90a", **kw):
    """Compile without a GPU and return kernels.cute.CompileReport (registers, spills, shared memory)."""
    from kernels.cute import compile_for_arch

    require_dsl(DSL.error)
    return compile_for_arch(RouteKernel(cfg, m, k), *fake_args(), arch=arch,
                            dynamic_smem_bytes=cfg.gemv.smem_bytes(m) + 4 * (1 + cfg.lean_arrival), **kw)
