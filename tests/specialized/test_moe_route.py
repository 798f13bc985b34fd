"""moe_route's CuTe DSL kernel (model/kimi_k3/specialized/moe_route/).

CPU: the warp's top-k selection (`warp_top_k`, the code the kernel traces) run on a numpy model of a warp against
a sort by (key desc, id asc), at K3's 896 experts and at a TP rank's padded slice (NaN / inf garbage in the
padding), at every lane width and top_k, with one lane holding every winner (the per-lane cache's refills), with
exact ties within and across lanes, and fuzzed; the ordered-key map; the selecting CTAs' token mapping; the
argument checks; the compile for sm_90a without spills, with the PTX instruction mix the design promises, of the
router and of the local-candidates form.
GPU: integer-valued inputs (every logit exact in fp32 in any summation order, keys equal -- often -- or at least
MIN_GAP apart) against the math in float64 with ties to the lower id, exactly; `diagnose` names
the wrong tokens and experts. Then the gate problem's inputs at the contract's benchmark points, strided x,
T = 0, repeated launches and CUDA-graph replays (the arrival counters must come back ready). The local form
against model/kimi_k3/ops/moe_route_tp.py's `local_candidates` at TP 4 / 8 / 16 slices, and moe_route_tp at tp = 1
over the kernel's candidates against the router.
The shortcuts (RouteConfig.lean_arrival, prefetch_bias, branchless_sigmoid; on in the router's configs, NOTES.md
sessions 31-33): on CPU the reciprocal's range test on numpy floats, the lean arrival's counter protocol over
launches of every CTA count and the counter's wrap, each flag's compile without spills and its PTX mix, the local
form's refusal; on the GPU each flag bit for bit against the plain kernel (route_config's shortcuts=False; logits
in the reciprocal's slow range included) and exactly against the float64 reference, and in CUDA graphs beside the
plain kernel (the counters ready after every replay).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gates.problems import bench_point, load_problem
from kernels.contract import load_contract
from kernels.cute import cutlass_available, ptx_instruction_counts
from kernels.trees import clone
from model.kimi_k3.ops.moe_route_tp import local_candidates, local_rows, moe_route_tp, top_k_lowest_id
from model.kimi_k3.ops.registry import registry_problems
from model.kimi_k3.parallel import TP
from model.kimi_k3.specialized.linear.kernel import LinearConfig
from model.kimi_k3.specialized.moe_route import check_args, compile_keys, route_config
from model.kimi_k3.specialized.moe_route.kernel import (
    CACHE,
    DROPPED,
    EPOCH,
    SHORTCUTS,
    RouteConfig,
    rcp_needs_slow_path,
    warp_top_k,
)

CONTRACT_FILE = Path(__file__).resolve().parents[2] / "contracts" / "moe_route.yaml"
CONTRACT = load_contract(CONTRACT_FILE)
E, K, TOP_K = 896, 7168, 16
LOCAL_EXPERTS = {4: 224, 8: 112, 16: 56}  # E / tp at the TP sizes K3 runs
LANES = np.arange(32)
MIN_GAP = 1e-5  # exact-input tests: distinct keys at least this far apart (any fp32 sigmoid orders them alike)


def test_contract_names_this_kernel():
    assert CONTRACT.implementation == "model.kimi_k3.specialized.moe_route:moe_route_cute"
    assert registry_problems(CONTRACT, str(CONTRACT_FILE), imports=False) == []


# --- the selection on a numpy model of a warp ------------------------------------------------------------------

class NumpyWarp:
    """warp_top_k's primitives over arrays of 32 lanes; counts the branches taken (the selection's refills)."""

    zero_id, zero_val, dropped = np.zeros(32, np.int64), np.zeros(32, np.float64), np.uint32(DROPPED)

    def __init__(self):
        self.branches_taken = 0

    @staticmethod
    def umax(v):
        return np.full(32, v.max(), dtype=v.dtype)

    @staticmethod
    def ballot(pred):
        return np.full(32, int((pred.astype(np.uint64) << LANES.astype(np.uint64)).sum()), dtype=np.uint64)

    @staticmethod
    def lowest(mask):
        return np.array([(int(m) & -int(m)).bit_length() - 1 for m in mask])

    @staticmethod
    def shuffle(v, src):
        return v[src]

    @staticmethod
    def select(cond, a, b):
        return np.where(cond, a, b)

    @staticmethod
    def index(i):
        return np.full(32, i)

    @staticmethod
    def in_mask(mask, lane):
        return ((mask >> lane.astype(np.uint64)) & np.uint64(1)) == 1

    def when(self, cond, body, state):
        assert (cond == cond[0]).all(), "a branch the lanes disagree on"  # the kernel's is warp-uniform
        self.branches_taken += bool(cond[0])
        return body(state) if cond[0] else state

    @staticmethod
    def loop(count, body, state):
        for r in range(count):
            state = body(r, state)
        return state


def ordered_u32(keys: np.ndarray) -> np.ndarray:
    """The kernel's ordered_key in numpy: fp32 bits, negatives inverted, positives with the sign bit set."""
    bits = keys.astype(np.float32).view(np.uint32)
    return np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def run_warp(keys: np.ndarray, top_k: int, experts: int | None = None,
             warp: NumpyWarp | None = None) -> tuple[np.ndarray, np.ndarray]:
    """warp_top_k on keys [32 P] (lane l owns [l P, (l + 1) P)), of which the first `experts` (all by default)
    are real; the val of an expert is its id / 7 (any function of the id shows which one was carried). Returns
    the ids and vals lanes 0..top_k-1 hold, after checking that the keys they hold are the chosen experts' and that
    the other lanes hold the zeros."""
    per_lane = keys.size // 32
    owned = ordered_u32(keys).reshape(32, per_lane)
    vals = (np.arange(keys.size) / 7.0).reshape(32, per_lane)
    got_id, got_val, got_key = warp_top_k([owned[:, i] for i in range(per_lane)],
                                          [vals[:, i] for i in range(per_lane)], LANES, top_k,
                                          keys.size if experts is None else experts, warp or NumpyWarp())
    np.testing.assert_array_equal(got_key[:top_k], ordered_u32(keys)[got_id[:top_k]])
    assert not got_id[top_k:].any() and not got_val[top_k:].any() and (got_key[top_k:] == DROPPED).all()
    return got_id[:top_k], got_val[:top_k]


def expected_top_k(keys: np.ndarray, top_k: int) -> np.ndarray:
    return np.lexsort((np.arange(keys.size), -keys.astype(np.float64)))[:top_k]


@pytest.mark.parametrize("top_k", [1, 2, 16, 32])
@pytest.mark.parametrize("kind", ["distinct", "few_values", "negative", "all_equal"])
def test_warp_top_k_matches_a_sort_with_ties_to_the_lower_id(top_k, kind):
    rng = np.random.default_rng(top_k)
    for _ in range(5):
        keys = {"distinct": rng.random(E), "few_values": rng.integers(0, 6, E) / 8.0,
                "negative": rng.standard_normal(E), "all_equal": np.full(E, 0.25)}[kind].astype(np.float32)
        got_id, got_val = run_warp(keys, top_k)
        want = expected_top_k(keys, top_k)
        np.testing.assert_array_equal(got_id, want)
        np.testing.assert_array_equal(got_val, want / 7.0)


def test_warp_top_k_at_other_widths():
    rng = np.random.default_rng(0)
    for n in (32, 64, 256, 1024):
        keys = (rng.integers(0, 50, n) / 64.0).astype(np.float32)
        np.testing.assert_array_equal(run_warp(keys, min(16, n))[0], expected_top_k(keys, min(16, n)))


def check_warp(keys: np.ndarray, top_k: int, experts: int | None = None, warp: NumpyWarp | None = None):
    """run_warp against a sort of the real keys by (key desc, id asc): the ids in order and their vals."""
    real = keys[:experts]
    got_id, got_val = run_warp(keys, top_k, experts, warp)
    want = expected_top_k(real, top_k)
    np.testing.assert_array_equal(got_id, want, err_msg=f"top_k {top_k}, keys {real.tolist()}")
    np.testing.assert_array_equal(got_val, want / 7.0)


def refills(per_lane: int, top_k: int, pops: int) -> int:
    """The refills of a lane that pops `pops` of its keys (in the top_k - 1 rounds that pop), where its cache
    (CACHE keys) holds fewer than it has and the rounds can ask for: one each time it pops its last cached key,
    after CACHE, 2 CACHE, ... pops, and after its last key (its last fill held fewer, then a refill from none)."""
    if min(per_lane, top_k) <= CACHE:
        return 0
    return pops // CACHE + (pops == per_lane and per_lane % CACHE != 0)


def winners_in_one_lane(per_lane: int, lane: int, rng, ties: bool) -> np.ndarray:
    """Keys [32 P] whose P largest are all `lane`'s (random, or all equal with `ties`); the others fall in a
    round robin over the other lanes (expert (l, i) below every (l', i') with i' < i), so that no other lane wins
    twice in 31 rounds."""
    lanes, positions = np.divmod(np.arange(32 * per_lane), per_lane)
    keys = -(positions * 32.0 + lanes)
    block = lanes == lane
    keys[block] = 2.0 if ties else 1.0 + rng.permutation(per_lane) / per_lane
    return keys.astype(np.float32)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "equal"])
@pytest.mark.parametrize("top_k", [CACHE + 1, 16, 32])
@pytest.mark.parametrize("per_lane", [28, 8, 4, 2, 1])
def test_all_winners_in_one_lane(per_lane, top_k, ties):
    """The per-lane cache's worst case: one lane holds every winner (at 28 keys a lane it wins all top_k rounds,
    or all 28 of its keys at top_k 32), so it pops its last cached key again and again and refills each time, the
    last time from no keys left; its equal keys come out in id order across refills. top_k CACHE + 1: the one
    round after the cache's last key."""
    rng = np.random.default_rng(per_lane * top_k)
    for lane in (0, 13, 31):
        keys = winners_in_one_lane(per_lane, lane, rng, ties)
        warp = NumpyWarp()
        check_warp(keys, top_k, warp=warp)
        assert warp.branches_taken == refills(per_lane, top_k, min(top_k - 1, per_lane))


@pytest.mark.parametrize("top_k", [1, 16, 32])
@pytest.mark.parametrize("per_lane", [28, 8, 4, 2, 1])
def test_exact_ties_within_and_across_lanes(per_lane, top_k):
    """Equal keys everywhere: two values only; each lane's keys all equal (three values over the lanes); the same
    keys at the same positions of every lane; a lane whose keys after its cache's last one equal it (the refill
    must give them in position order after it); equal winners on both sides of every lane boundary."""
    n, rng = 32 * per_lane, np.random.default_rng(per_lane + top_k)
    lanes, positions = np.divmod(np.arange(n), per_lane)
    edge = np.zeros(n)  # lane 9: 9, 8, 7, ... down to its CACHE-th key, then that key's value again and again
    edge[lanes == 9] = 9.0 - np.minimum(np.arange(per_lane), CACHE - 1)
    boundary = np.where((positions == 0) | (positions == per_lane - 1), 1.0, rng.random(n) / 2)
    cases = {"two_values": rng.integers(0, 2, n), "per_lane_constant": lanes % 3,
             "same_in_every_lane": rng.integers(0, 3, per_lane)[positions], "cache_edge": edge,
             "lane_boundaries": boundary}
    for keys in cases.values():
        check_warp(np.asarray(keys, np.float32), top_k)


@pytest.mark.parametrize("top_k", [1, 16, 32])
@pytest.mark.parametrize("per_lane", [28, 8, 4, 2, 1])
def test_every_top_k_at_every_width(per_lane, top_k):
    """top_k 1, 16 and 32 at every lane width the kernel compiles (28 at 896 experts; 8, 4, 2 at a TP rank's
    224, 112, 56; 1 below 33 experts): the cache is then min(CACHE, P, top_k) deep, and refills exist only where
    it holds fewer keys than a lane has and the rounds can ask for."""
    rng = np.random.default_rng(per_lane * 100 + top_k)
    for _ in range(4):
        check_warp(rng.random(32 * per_lane).astype(np.float32), top_k)
        check_warp((rng.integers(0, 8, 32 * per_lane) / 8.0).astype(np.float32), top_k)


def test_fuzz_against_a_sort():
    """Random widths (K3's and a TP rank's expert counts, or any of 1..1024, padded), top_k and key distributions
    (distinct, few values, normal, all equal, the winners crowded into every m-th lane), NaN / inf / finite
    garbage in the padding: the ids, vals and keys of a sort by (key desc, id asc), every time."""
    rng = np.random.default_rng(18)
    for _ in range(400):
        experts = int(rng.choice([896, 224, 112, 56])) if rng.random() < 0.5 else int(rng.integers(1, 1025))
        top_k = int(rng.integers(1, min(32, experts) + 1))
        lane_of = np.arange(experts) // per_lane_of(experts)
        real = [rng.random(experts), rng.integers(0, 4, experts) / 4.0, rng.standard_normal(experts),
                np.full(experts, 0.5), rng.random(experts) + 2.0 * (lane_of % rng.integers(2, 33) == 0)
                ][rng.integers(0, 5)]
        garbage = [np.nan, np.inf, -np.inf, 0.0, 3.0][rng.integers(0, 5)]
        check_warp(padded_keys(real.astype(np.float32), garbage), top_k, experts)


def per_lane_of(experts: int) -> int:
    return RouteConfig(LinearConfig(out_dtype="float32"), experts=experts, top_k=1).per_lane


def padded_keys(real: np.ndarray, garbage: float) -> np.ndarray:
    """A lane-major row of 32 P keys as the kernel sees it: the real keys, then `garbage` in the padding (what an
    unwritten workspace column may hold)."""
    cfg = RouteConfig(LinearConfig(out_dtype="float32"), experts=real.size, top_k=1)
    row = np.full(cfg.padded_experts, garbage, np.float32)
    row[:real.size] = real
    return row


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.nan, 2.0, 0.0])
@pytest.mark.parametrize("experts", [224, 112, 56, 40, 17])
def test_padded_selection_never_chooses_the_padding(experts, garbage):
    """TP slices (224, 112, 56 at TP 4 / 8 / 16) and odd sizes: the padding's keys, whatever they hold, lose to
    every real key; equal keys on both sides of the padding boundary go to the lower (real) id."""
    rng = np.random.default_rng(experts)
    for top_k in sorted({1, min(16, experts), experts if experts <= 32 else 32}):
        for kind in ("distinct", "few_values", "all_equal", "boundary_ties"):
            real = {"distinct": rng.random(experts), "few_values": rng.integers(0, 4, experts) / 8.0,
                    "all_equal": np.full(experts, 0.25), "boundary_ties": rng.integers(0, 2, experts) / 2.0
                    }[kind].astype(np.float32)
            padding = garbage
            if kind == "boundary_ties":  # the last real expert holds the largest key, the padding holds it too
                real[-1] = padding = 1.0
            got_id, got_val = run_warp(padded_keys(real, padding), top_k, experts)
            want = expected_top_k(real, top_k)
            np.testing.assert_array_equal(got_id, want)
            np.testing.assert_array_equal(got_val, want / 7.0)


@pytest.mark.parametrize("experts, per_lane, padded", [(896, 28, 896), (224, 8, 256), (112, 4, 128), (56, 2, 64),
                                                       (40, 2, 64), (17, 1, 32), (100, 4, 128)])
def test_per_lane_is_padded_to_whole_vector_loads(experts, per_lane, padded):
    cfg = RouteConfig(LinearConfig(out_dtype="float32"), experts=experts, top_k=1)
    assert (cfg.per_lane, cfg.padded_experts) == (per_lane, padded)
    assert cfg.load_width == min(4, per_lane)


def test_ordered_key_orders_like_the_float():
    v = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 0.25, 1.0, 7.0, np.inf], np.float32)
    u = ordered_u32(v)
    assert (np.diff(u.astype(np.int64)) >= 0).all() and u.min() > DROPPED


# --- configs, token mapping, arguments ----------------------------------------------------------------------------

@pytest.mark.parametrize("t", range(1, 65))
@pytest.mark.parametrize("experts", [E, *LOCAL_EXPERTS.values(), 40])
def test_selecting_ctas_cover_every_token_once(t, experts):
    cfg = route_config(t, experts, K, TOP_K)
    ctas, sel, warps = cfg.gemv.ctas(experts), cfg.selectors(t), cfg.gemv.warps
    assert sel <= ctas and cfg.gemv.out_dtype == "float32"
    assert cfg.passes(t) == 1 or sel == ctas  # several passes only where every CTA already selects
    tokens = [(ticket - (ctas - sel)) * warps + w + p * sel * warps for ticket in range(ctas - sel, ctas)
              for w in range(warps) for p in range(cfg.passes(t))]
    assert sorted(x for x in tokens if x < t) == list(range(t))


def test_route_config_refusals():
    gemv = LinearConfig(out_dtype="float32")
    with pytest.raises(ValueError, match="fp32"):
        RouteConfig(LinearConfig())
    with pytest.raises(ValueError, match="positive"):
        RouteConfig(gemv, experts=0)
    with pytest.raises(ValueError, match="top_k"):
        RouteConfig(gemv, top_k=33)
    with pytest.raises(ValueError, match="top_k"):
        RouteConfig(gemv, experts=8, top_k=16)
    with pytest.raises(ValueError, match="stop_after"):
        RouteConfig(gemv, stop_after="ids")
    with pytest.raises(ValueError, match="output"):
        RouteConfig(gemv, output="ids")


def test_shortcuts_are_the_routers_only():
    gemv = LinearConfig(out_dtype="float32")
    for name in SHORTCUTS:
        assert RouteConfig(gemv, **{name: True}).shortcuts == (name,)
        with pytest.raises(ValueError, match=name):
            RouteConfig(gemv, output="candidates", **{name: True})
    assert RouteConfig(gemv).shortcuts == ()
    assert route_config(1, E, K, TOP_K).shortcuts == SHORTCUTS  # the router takes them all
    assert route_config(1, E, K, TOP_K, shortcuts=False).shortcuts == ()
    assert route_config(1, 112, K, TOP_K, output="candidates").shortcuts == ()


def test_reciprocal_slow_path_test_is_ptxas_range():
    """rcp_needs_slow_path (the kernel's test, run on numpy) sends exactly the denominators whose reciprocal the
    fast path leaves to the exact rcp.rn: biased exponent 0 (zero, subnormals) or 253..255 (>= 2^126, inf, NaN).
    A sigmoid's denominator 1 + exp(-logit) >= 1 is slow only below a logit of ~-87.3 (exp >= 2^126) and for NaN."""
    def slow(d) -> np.ndarray:
        return rcp_needs_slow_path(np.asarray(d, np.float32).view(np.uint32))

    fast = np.float32([1.0, 1.5, 2.0, 3.0, 2.0**100, np.nextafter(np.float32(2.0**126), np.float32(0)), 2.0**-126])
    assert not slow(fast).any()
    assert slow(np.float32([2.0**126, 2.0**127, 3.0e38, np.inf, np.nan, 0.0, 1e-40, -0.0])).all()
    logits = np.float32([-87.0, -50.0, 0.0, 30.0, 88.0])
    assert not slow(np.float32(1) + np.exp(-logits)).any()
    with np.errstate(over="ignore"):
        assert slow(np.float32(1) + np.exp(-np.float32([-88.0, -89.0, -100.0, np.nan]))).all()


def lean_arrival_launch(counter: int, ctas: int, selectors: int, rng) -> int:
    """One launch of RouteConfig.lean_arrival's protocol (arrive_and_select) on a 32-bit counter, the CTAs in a
    random order: each takes raw = counter (atomic add 1), its ticket raw mod EPOCH and the epoch raw - ticket; the
    last ticket adds EPOCH - ctas. A selector (one of the last `selectors` tickets) other than the last waits until
    its reads (any value the counter held after its own add) minus the epoch reach ctas: checked to happen only
    once every CTA has arrived. Returns the counter after the launch."""
    order, history, waiting = rng.permutation(ctas), [], []
    for cta in order:
        raw = counter
        counter = (counter + 1) % 2**32
        ticket, epoch = raw % EPOCH, raw - raw % EPOCH
        history.append(counter)
        if ticket == ctas - 1:
            assert len(history) == ctas  # the last ticket sees every arrival
            counter = (counter + EPOCH - ctas) % 2**32
            history.append(counter)
        elif ticket >= ctas - selectors:
            waiting.append((len(history) - 1, epoch, ticket))
    for after, epoch, ticket in waiting:
        for step, value in enumerate(history[after:], after):
            seen = (value - epoch) % 2**32
            assert ticket + 1 <= seen <= EPOCH
            if seen >= ctas:  # it leaves its wait
                assert step >= ctas - 1, "left before every CTA arrived"
                break
        else:
            raise AssertionError("a selector waits forever")
    assert counter % EPOCH == 0  # the next launch, any CTA count, starts its tickets at 0
    return counter


def test_lean_arrival_protocol_over_launches_and_the_wrap():
    rng = np.random.default_rng(0)
    for start in (0, 2**32 - 3 * EPOCH):  # the 32-bit counter wraps after 2^16 launches
        counter = start
        for ctas, selectors in [(448, 1), (448, 16), (224, 32), (1, 1), (16, 16), (448, 4)] * 3:
            counter = lean_arrival_launch(counter, ctas, selectors, rng)


def test_check_args_refuses_bad_input_on_cpu():
    x, w, b = torch.zeros(2, K, dtype=torch.bfloat16), torch.zeros(E, K, dtype=torch.bfloat16), torch.zeros(E)
    bad = [((x.float(), w, b, 16), "bf16"), ((x, w, b[:-1], 16), "disagree"), ((x, w, b, 0), "top_k"),
           ((x, w, b, 33), "top_k"), ((torch.zeros(65, K, dtype=torch.bfloat16), w, b, 16), "at most 64"),
           ((x, w[:8], b[:8], 16), "top_k"), ((x, w.t(), b, 16), "disagree"),
           ((x[:, ::2], w[:, ::2].contiguous(), b, 16), "stride"), ((x, w, b, 16), "CUDA")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            check_args(*args)


def test_compile_keys_span_the_envelope():
    keys = compile_keys(CONTRACT)
    assert {t for _, t, _ in keys} == {1, 2, 8, 9, 16, 32, 64}
    assert {cfg.gemv.path for cfg, _, _ in keys} == {"gemv", "mma"}


def rounds_mix(experts: int, top_k: int) -> tuple[int, int]:
    """(redux.sync, vote.ballot) in one selection's PTX. Where a lane's cache can run out (P > CACHE and top_k >
    CACHE) the rounds are a loop, so that the refill's code appears once: one redux and two ballots (the winner's,
    and the lanes on their last cached key) in its body for rounds 0..k-2, one redux and one ballot in the last
    round after it. Elsewhere they are unrolled: one of each per round."""
    if min(per_lane_of(experts), top_k) > CACHE:
        return 2, 3
    return top_k, top_k


needs_cutlass = pytest.mark.skipif(not cutlass_available()[0], reason="CuTe DSL (nvidia-cutlass-dsl) not installed")


@needs_cutlass
@pytest.mark.parametrize("t", [1, 16, 64])
def test_compiles_for_sm90a_without_gpu(t):
    """The plain kernel (no shortcuts): no spills or stack; the rounds a loop, not unrolled (rounds_mix); a lane's
    28 logits in 7 vector loads from L2, all issued before the first sigmoid; the counters' two atomics and one
    acquire load; tensor cores from 9 tokens on."""
    from model.kimi_k3.specialized.moe_route import compile as compile_key

    report = compile_key((route_config(t, E, K, TOP_K, shortcuts=False), t, K), "sm_90a")
    assert report.ok(max_registers=255), report.kernels
    counts = ptx_instruction_counts(report.ptx, {
        "redux": r"\bredux\.sync\.max\.u32", "ballot": r"\bvote\.sync\.ballot", "ld.cg": r"\bld\.global\.cg\.v4\.b32",
        "atom": r"\batom\.global\.acq_rel\.add", "acquire": r"\bld\.acquire\.gpu", "mma": r"\bmma\.sync",
        "local": r"\.local"})
    assert (counts["redux"], counts["ballot"]) == rounds_mix(E, TOP_K) and counts["ld.cg"] == E // 32 // 4
    assert counts["atom"] == 2 and counts["acquire"] == 1 and counts["local"] == 0
    assert (counts["mma"] > 0) == (t > 8)
    last_load = max(m.start() for m in re.finditer(r"\bld\.global\.cg\.v4\.b32", report.ptx))
    assert last_load < report.ptx.index("ex2.approx")  # every logit requested before the first sigmoid


@needs_cutlass
def test_the_probes_stages_compile_without_the_later_phases():
    """probe.py's time split: "arrive" keeps the fence, the tickets and the wait but no selection; "gemv" keeps
    neither."""
    from model.kimi_k3.specialized.moe_route import compile as compile_key

    patterns = {"atom": r"\batom\.global\.acq_rel\.add", "redux": r"\bredux\.sync\.max\.u32"}
    expected = {"arrive": {"atom": 2, "redux": 0}, "gemv": {"atom": 0, "redux": 0}}
    for stage, counts in expected.items():
        report = compile_key((replace(route_config(1, E, K, TOP_K, shortcuts=False), stop_after=stage), 1, K),
                             "sm_90a")
        assert report.ok(max_registers=255), report.kernels
        assert ptx_instruction_counts(report.ptx, patterns) == counts, stage


SHORTCUT_FLAGS = [{name: True} for name in SHORTCUTS] + [dict.fromkeys(SHORTCUTS, True)]


@needs_cutlass
@pytest.mark.parametrize("t", [1, 9, 16, 64])
@pytest.mark.parametrize("flags", SHORTCUT_FLAGS, ids=lambda f: "+".join(f))
def test_shortcuts_compile_for_sm90a_without_gpu(flags, t):
    """Each shortcut and all three: no spills or stack, and the PTX mix they promise. lean_arrival: one acq_rel
    ticket and one relaxed add (the last one's step to the next epoch), no second counter nor reset stores, the
    waiters' one acquire load. prefetch_bias: one L2 prefetch. branchless_sigmoid: P approximate reciprocals (the
    fast path, rcp.approx.ftz + Newton step) and the P exact rcp.rn inside the slow branches. The rounds'
    reductions, the logits' vector loads and (off) everything else as in the plain kernel."""
    from model.kimi_k3.specialized.moe_route import compile as compile_key

    cfg = replace(route_config(t, E, K, TOP_K, shortcuts=False), **flags)
    report = compile_key((cfg, t, K), "sm_90a")
    assert report.ok(max_registers=255), report.kernels
    counts = ptx_instruction_counts(report.ptx, {
        "redux": r"\bredux\.sync\.max\.u32", "ballot": r"\bvote\.sync\.ballot", "ld.cg": r"\bld\.global\.cg\.v4\.b32",
        "ticket": r"\batom\.global\.acq_rel\.add", "step": r"\batom\.global\.add\.u32",
        "acquire": r"\bld\.acquire\.gpu", "reset": r"\bst\.relaxed\.gpu", "prefetch": r"\bprefetch\.global\.L2\b",
        "fast rcp": r"\brcp\.approx\.ftz\.f32",
        "rcp.rn": r"\brcp\.rn\.f32", "local": r"\.local"})
    lean, P = flags.get("lean_arrival", False), E // 32
    assert (counts["redux"], counts["ballot"]) == rounds_mix(E, TOP_K) and counts["ld.cg"] >= P // 4
    assert (counts["ticket"], counts["step"], counts["acquire"], counts["reset"]) == ((1, 1, 1, 0) if lean else
                                                                                      (2, 0, 1, 2))
    assert counts["prefetch"] == flags.get("prefetch_bias", False)
    assert (counts["fast rcp"], counts["rcp.rn"]) == (P * flags.get("branchless_sigmoid", False), P)
    assert counts["local"] == 0


@needs_cutlass
@pytest.mark.parametrize("t", [1, 16, 64])
@pytest.mark.parametrize("experts", LOCAL_EXPERTS.values())
def test_local_form_compiles_for_sm90a_without_gpu(experts, t):
    """A TP rank's candidates kernel: no spills or stack; per pass the rounds' reductions and ballots
    (rounds_mix: a loop at 224 experts, unrolled at 112 and 56) and a lane's P logits in P / V vector loads of V
    floats from L2, the first pass's all issued before the first sigmoid."""
    from model.kimi_k3.specialized.moe_route import compile as compile_key

    cfg = route_config(t, experts, K, TOP_K, 132, "candidates")
    report = compile_key((cfg, t, K), "sm_90a")
    assert report.ok(max_registers=255), report.kernels
    V, passes = cfg.load_width, cfg.passes(t)
    load = rf"\bld\.global\.cg\.v{V}\.b32" if V > 1 else r"\bld\.global\.cg\.f32"
    counts = ptx_instruction_counts(report.ptx, {
        "redux": r"\bredux\.sync\.max\.u32", "ballot": r"\bvote\.sync\.ballot", "ld.cg": load,
        "atom": r"\batom\.global\.acq_rel\.add", "acquire": r"\bld\.acquire\.gpu", "mma": r"\bmma\.sync",
        "local": r"\.local"})
    redux, ballots = rounds_mix(experts, TOP_K)
    assert (counts["redux"], counts["ballot"]) == (redux * passes, ballots * passes)
    assert counts["ld.cg"] == cfg.per_lane // V * passes
    assert counts["atom"] == 2 and counts["acquire"] == 1 and counts["local"] == 0
    assert (counts["mma"] > 0) == (t > 8)
    first_pass_loads = [m.start() for m in re.finditer(load, report.ptx)][:cfg.per_lane // V]
    assert max(first_pass_loads) < report.ptx.index("ex2.approx")


def test_tp_router_keeps_the_torch_candidates_on_cpu():
    """moe_route_tp on CPU tensors takes local_candidates' path (the kernel needs a GPU): the single-rank result."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    w, bias = (torch.randn(112, 256, generator=gen) / 16).bfloat16(), torch.randn(112, generator=gen) * 0.02
    ids, weights = moe_route_tp(x, w, bias, TOP_K, True, 2.5, TP())
    keys = torch.sigmoid(x.float() @ w.float().t()) + bias
    assert torch.equal(ids, top_k_lowest_id(keys, torch.arange(112).expand_as(keys), TOP_K))
    assert torch.equal(local_candidates(x, w, bias, TOP_K, 0)[..., 2].long(), ids)


# --- GPU ---------------------------------------------------------------------------------------------------------

def exact_inputs(t: int, seed: int, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x in {-1, 0, 1}, each expert's row four +-1 at columns spread over all of K (every logit an integer in
    -4..4, exact in fp32 in any summation order), bias a multiple of 1/1024 in [-1/16, 1/16]: two keys are then
    equal or at least MIN_GAP apart (sigmoid differences of -4..4 keep 1.76e-5 from the 1/1024 grid), so any
    faithful fp32 sigmoid orders them as float64 does, and exact ties are common; with `ties`, experts 1..8 also
    copy the rows and biases of experts 100..107."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (t, K), generator=gen).to(torch.bfloat16)
    w = torch.zeros(E, K)
    columns = torch.rand(E, K, generator=gen).argsort(dim=-1)[:, :4]
    w.scatter_(1, columns, torch.randint(0, 2, (E, 4), generator=gen).float() * 2 - 1)
    bias = torch.randint(-64, 65, (E,), generator=gen) / 1024.0
    if ties:
        w[1:9], bias[1:9] = w[100:108], bias[100:108]
    w = w.to(torch.bfloat16)
    gaps = reference_keys(x, w, bias).sort(dim=-1).values.diff(dim=-1)
    assert bool(((gaps == 0) | (gaps >= MIN_GAP)).all())
    return x, w, bias


def reference_keys(x, w, bias):
    return torch.sigmoid(x.double() @ w.double().t()) + bias.double()


def exact_route(x, w, bias, top_k, scaling):
    keys = reference_keys(x, w, bias)
    ids = top_k_lowest_id(keys, torch.arange(keys.shape[-1]).expand_as(keys), top_k)
    s = torch.sigmoid(x.double() @ w.double().t()).gather(-1, ids)
    return ids, (s / (s.sum(-1, keepdim=True) + 1e-20) * scaling).float()


def diagnose(got_ids, got_w, want_ids, want_w, keys) -> str:
    """Which tokens are wrong and how: chosen set, order, weights (at most 4 tokens)."""
    lines = []
    for t in range(want_ids.shape[0]):
        g, r = got_ids[t].tolist(), want_ids[t].tolist()
        if g == r and torch.allclose(got_w[t], want_w[t], rtol=1e-5, atol=1e-7):
            continue
        extra, missing = sorted(set(g) - set(r)), sorted(set(r) - set(g))
        what = (f"set: chose {extra} (keys {[round(float(keys[t, e]), 7) for e in extra]}) instead of {missing} "
                f"(keys {[round(float(keys[t, e]), 7) for e in missing]})" if extra or missing
                else f"order: got {g}, want {r}" if g != r
                else f"weights: max |diff| {float((got_w[t] - want_w[t]).abs().max()):.3g}")
        lines.append(f"token {t}: {what}")
    return f"{len(lines)} wrong token(s): " + "; ".join(lines[:4])


def _kernel(entry: str = "moe_route_cute"):
    """The router's entry point `entry` (moe_route_cute or moe_route_local_cute); skips where it cannot run."""
    from model.kimi_k3.specialized import moe_route

    ok, why = moe_route.available()
    if not ok:
        pytest.skip(why)
    return getattr(moe_route, entry)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 3, 8, 9, 16, 33, 64])
def test_exact_inputs_match_exactly(t):
    kernel = _kernel()
    x, w, bias = exact_inputs(t, seed=t)
    want_ids, want_w = exact_route(x, w, bias, TOP_K, 2.5)
    ids, weights = kernel(x.cuda(), w.cuda(), bias.cuda(), TOP_K, True, 2.5)
    ids, weights = ids.cpu(), weights.cpu()
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    msg = diagnose(ids, weights, want_ids, want_w, reference_keys(x, w, bias))
    assert torch.equal(ids, want_ids), msg
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7, msg=msg)


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [1, 8, 32])
def test_other_top_k_and_no_renormalize(top_k):
    kernel = _kernel()
    x, w, bias = exact_inputs(5, seed=top_k)
    ids, weights = kernel(x.cuda(), w.cuda(), bias.cuda(), top_k, False, 1.0)
    want_ids, _ = exact_route(x, w, bias, top_k, 1.0)
    assert torch.equal(ids.cpu(), want_ids)
    want_w = torch.sigmoid(x.double() @ w.double().t()).gather(-1, want_ids).float()
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed", "large", "mixed"])
@pytest.mark.parametrize("point", CONTRACT.benchmark.points, ids=lambda p: f"batch{p.batch}")
def test_gate_problem_inputs(point, dist):
    kernel = _kernel()
    problem = load_problem("moe_route")
    case = problem.generate_input(bench_point(CONTRACT, problem, point), 1, dist)
    got = kernel(*clone(case.args, "cuda"))
    ref = problem.reference(*clone(case.args, "cuda"))
    for name, g, r in zip(("out[0]", "out[1]"), got, ref):
        result = problem.check(name, g, r, CONTRACT.tolerance)
        assert result.passed, (result.problems, result.mismatches)


@pytest.mark.gpu
def test_strided_x_empty_batch_and_repeats_in_a_graph():
    kernel = _kernel()
    x, w, bias = exact_inputs(16, seed=3)
    want_ids, _ = exact_route(x, w, bias, TOP_K, 1.0)
    wide = torch.zeros(16, K + 64, dtype=torch.bfloat16, device="cuda")
    wide[:, :K] = x.cuda()
    w, bias = w.cuda(), bias.cuda()
    assert torch.equal(kernel(wide[:, :K], w, bias, TOP_K, True, 1.0)[0].cpu(), want_ids)
    empty = kernel(wide[:0, :K], w, bias, TOP_K, True, 1.0)
    assert empty[0].shape == (0, TOP_K) and empty[1].shape == (0, TOP_K)
    for t in (1, 64, 16, 9):  # the counters return to zero after every launch, whatever its CTA count
        assert torch.equal(kernel(wide[:t, :K], w, bias, TOP_K, True, 1.0)[0].cpu(), want_ids[:t])
    static = wide[:, :K].clone()
    kernel(static, w, bias, TOP_K, True, 1.0)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_ids, _ = kernel(static, w, bias, TOP_K, True, 1.0)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_ids.cpu(), want_ids)


def slow_range_inputs(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """exact_inputs with every 9th expert's row times 32: its logits multiples of 32 in -128..128, below the
    reciprocal's fast range (< -87.3: sigmoid subnormal or 0) for some tokens, so some lanes take the branchless
    sigmoid's slow branch."""
    x, w, bias = exact_inputs(t, seed)
    w[::9] *= 32
    return x, w, bias


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 9, 16, 64])
@pytest.mark.parametrize("flags", SHORTCUT_FLAGS, ids=lambda f: "+".join(f))
def test_shortcuts_match_the_plain_kernel_bit_for_bit(flags, t):
    """Every shortcut returns the plain kernel's ids and weights bit for bit (same fp32 operations, moved or
    without branches), where logits fall in the reciprocal's slow range too, and the exact inputs' ids and
    weights against float64 as test_exact_inputs_match_exactly."""
    kernel = _kernel()
    plain = route_config(t, E, K, TOP_K, shortcuts=False)
    cfg = replace(plain, **flags)
    x, w, bias = exact_inputs(t, seed=t)
    want_ids, want_w = exact_route(x, w, bias, TOP_K, 2.5)
    ids, weights = (a.cpu() for a in kernel(x.cuda(), w.cuda(), bias.cuda(), TOP_K, True, 2.5, config=cfg))
    msg = diagnose(ids, weights, want_ids, want_w, reference_keys(x, w, bias))
    assert torch.equal(ids, want_ids), msg
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7, msg=msg)
    x, w, bias = (a.cuda() for a in slow_range_inputs(t, seed=t))
    assert bool((x.float() @ w.float().t() < -88).any())
    for got, want in zip(kernel(x, w, bias, TOP_K, True, 2.5, config=cfg),
                         kernel(x, w, bias, TOP_K, True, 2.5, config=plain)):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", SHORTCUT_FLAGS, ids=lambda f: "+".join(f))
def test_shortcuts_in_a_graph_beside_the_plain_kernel(flags):
    """One CUDA graph launching the plain kernel and the shortcut one alternately at 1, 64 and 16 tokens (448, 224
    and 448 CTAs): every replay's results right, and the counters ready after it: the plain pair at zero, the
    lean one at a multiple of EPOCH."""
    from model.kimi_k3.specialized.moe_route import _sync

    kernel = _kernel()
    x, w, bias = exact_inputs(64, seed=5)
    want_ids, _ = exact_route(x, w, bias, TOP_K, 1.0)
    x, w, bias = x.cuda(), w.cuda(), bias.cuda()
    calls = [(t, replace(route_config(t, E, K, TOP_K, shortcuts=False), **shortcut)) for t in (1, 64, 16)
             for shortcut in ({}, flags)]
    for t, config in calls:  # compiled before capture
        kernel(x[:t], w, bias, TOP_K, True, 1.0, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [kernel(x[:t], w, bias, TOP_K, True, 1.0, config=config)[0] for t, config in calls]
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for (t, _), ids in zip(calls, outs):
            assert torch.equal(ids.cpu(), want_ids[:t])
        words = _sync(x.device).tolist()
        assert words[:2] == [0, 0] and words[2] % EPOCH == 0, words


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 33, 64])
@pytest.mark.parametrize("tp", LOCAL_EXPERTS)
def test_local_candidates_match_torch(tp, t):
    """Every rank's kernel candidates against local_candidates on the same slice: the same ids in the same order
    (exact inputs: distinct keys at least MIN_GAP apart, ties planted), keys and scores to fp32 rounding."""
    kernel = _kernel("moe_route_local_cute")
    x, w, bias = (a.cuda() for a in exact_inputs(t, seed=tp + t))
    for rank in range(tp):
        rows = local_rows(E, TP(rank, tp))
        got = kernel(x, w[rows], bias[rows], TOP_K, rows.start)
        want = local_candidates(x, w[rows], bias[rows], TOP_K, rows.start)
        assert got.shape == want.shape == (t, TOP_K, 3) and got.dtype == torch.float32
        assert torch.equal(got[..., 2], want[..., 2]), (rank, (got[..., 2] != want[..., 2]).nonzero().tolist())
        torch.testing.assert_close(got[..., :2], want[..., :2], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("nan")])
def test_local_candidates_ignore_garbage_in_the_padding(fill):
    """The logits workspace's padding columns (112 experts: 128 columns) are never written: launched by hand on a
    workspace filled with NaN or inf, the kernel gives the candidates it gives on a fresh one."""
    from model.kimi_k3.specialized.moe_route import _compiled, _sync
    from model.kimi_k3.specialized.moe_route.kernel import launch_args

    kernel = _kernel("moe_route_local_cute")
    x, w, bias = (a.cuda() for a in exact_inputs(16, seed=5))
    rows = local_rows(E, TP(3, 8))
    w, bias = w[rows].contiguous(), bias[rows].contiguous()
    cfg = route_config(16, w.shape[0], K, TOP_K, output="candidates")
    logits = torch.full((16, cfg.padded_experts), fill, device="cuda")
    out = torch.empty(16, TOP_K, 3, device="cuda")
    _compiled(cfg, 16, K)(*launch_args(
        x.data_ptr(), w.data_ptr(), bias.data_ptr(), logits.data_ptr(), 0, out.data_ptr(),
        _sync(x.device).data_ptr(), K, False, 1.0, rows.start, torch.cuda.current_stream().cuda_stream))
    assert torch.equal(out, kernel(x, w, bias, TOP_K, rows.start, config=cfg))
    assert not torch.isfinite(logits[:, w.shape[0]:]).any()  # the garbage was there, unwritten, throughout


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64])
def test_tp1_over_kernel_candidates_equals_the_router(t, monkeypatch):
    """moe_route_tp at tp = 1 on CUDA runs on the kernel's candidates (local_candidates is made to fail) and
    gives the router's ids, and its weights to fp32 rounding."""
    import model.kimi_k3.ops.moe_route_tp as tp_module

    _kernel("moe_route_local_cute")
    router = _kernel()
    monkeypatch.setattr(tp_module, "local_candidates", lambda *a: pytest.fail("took the torch path"))
    x, w, bias = (a.cuda() for a in exact_inputs(t, seed=40 + t))
    ids, weights = moe_route_tp(x, w, bias, TOP_K, True, 2.5, TP())
    want_ids, want_w = router(x, w, bias, TOP_K, True, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
