"""The latent MoE's router (SPEC.md §5, steps 1-7): expert ids and routing weights per token.

    ids, weights = moe_route(x, gate_w, bias, top_k, renormalize, scaling)    # [T, top_k] int64, [T, top_k] fp32

Shapes from the contract: `experts`, `top_k`, `hidden`; T = batch * (1 + spec_tokens) tokens. Router weights are
drawn like trained ones (std 1/sqrt(hidden)), the correction bias small (std BIAS_STD); the activations follow
the distribution. Every input holds three kinds of ties, planted where they decide something:
  - exact ties inside the top-k: a chosen expert's row and bias copied onto an unchosen one (equal keys in any
    implementation that computes both the same way: their order is the tie-break rule's);
  - exact ties at the boundary: the k-th expert's row and bias copied onto another one (which of the two is
    chosen is the tie-break rule's);
  - near ties at the boundary: the bias of the (k+1)-th expert moved so that its key is within a few fp32 ulps of
    the k-th's, above or below (which is chosen is decided by rounding, not by the math).

The check. The reference's tie order is not part of the math (`torch.topk` leaves it unspecified), and two fp32
implementations that sum the 7168 products of a logit in different orders may order two keys closer than their
rounding differently. So ids are checked against the exact keys (the logits in float64), not only against the
reference's ids: each position where the candidate's id differs from the reference's must hold an expert whose
exact key is within TIE tolerance of the reference's there (`tie_eps`: a bound on the fp32 error of one key: the
logit's summation error through the sigmoid's slope, plus the sigmoid's and the addition's rounding), and no
expert may appear twice. Every id the checker accepted while it differed from the reference's is counted: the
ids' close_fraction is the fraction of positions identical to the reference's, their max_units the largest
accepted key gap in tie tolerances (at most 1), and the accepted swaps are listed as mismatches. The weights are
checked at the candidate's own ids, against the exact (float64) scores of those experts, renormalized and scaled
(so a tie swap moves the weight with its expert), with the contract's tolerance.

The gate compares the outputs one tensor at a time (`check(name, got, expected, tolerance)`): the ids first, then
the weights. This module's `reference` keeps, for each result it returns, the exact keys and scores, found again
by the digest of the expected tensor; the ids' check leaves the candidate's ids there for the weights' check.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gates.core.compare import TensorCheck, check_tensor, digest
from gates.problems import Case, Cost, Point, sample
from model.kimi_k3.ops.moe_route import OP, moe_route

SHAPE_KEYS = ("experts", "top_k", "hidden")
BIAS_STD = 0.02  # trained e_score_correction_bias values are small next to the scores' spread
SCALINGS = (1.0, 2.5)  # K3's routed_scaling_factor, and one that a kernel ignoring the factor would fail
NEAR_TIE_TOKENS = 4  # tokens whose k-th and (k+1)-th keys are pulled within a few ulps of each other
NEAR_TIE_ULPS = (-2, -1, 0, 1)  # where the (k+1)-th key lands, in ulps of the k-th's, token by token
# tie_eps in units of 2^-24: SUM_ULPS x the slope x sum|x w| (the fp32 sum's error, far above any summation order's
# actual one: tests measure it) plus ROUND_ULPS x (1 + |key|) (the sigmoid's and the addition's roundings).
SUM_ULPS = 16.0
ROUND_ULPS = 8.0
RECORDS = 4096  # reference results remembered for their checks (a numerics point draws far fewer)


@dataclass
class _Record:
    keys: torch.Tensor  # [T, E] float64: sigmoid(exact logit) + bias
    scores: torch.Tensor  # [T, E] float64: sigmoid(exact logit)
    eps: torch.Tensor  # [T, E] float64: tie_eps
    ids: torch.Tensor  # [T, k] int64: the reference's
    renormalize: bool
    scaling: float
    got_ids: torch.Tensor | None = field(default=None)


_records: OrderedDict[str, _Record] = OrderedDict()


def exact(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """(keys, scores, tie_eps) [T, E] in float64 on the CPU, from the logits summed in float64 on x's device."""
    xd, wd = x.double(), gate_w.double()
    logits = xd @ wd.t()
    magnitude = xd.abs() @ wd.abs().t()
    scores = torch.sigmoid(logits)
    keys = scores + bias.double()
    slope = scores * (1 - scores)
    eps = 2.0**-24 * (SUM_ULPS * slope * magnitude + ROUND_ULPS * (1 + keys.abs()))
    return keys.cpu(), scores.cpu(), eps.cpu()


def reference(x, gate_w, bias, top_k, renormalize, scaling):
    """The op's reference; remembers the exact keys and scores for the check of what it returns."""
    ids, weights = moe_route(x, gate_w, bias, top_k, renormalize, scaling)
    keys, scores, eps = exact(x, gate_w, bias)
    record = _Record(keys, scores, eps, ids.cpu(), bool(renormalize), float(scaling))
    for t in (ids, weights):
        _records[digest(t)] = record
        _records.move_to_end(digest(t))
    while len(_records) > RECORDS:
        _records.popitem(last=False)
    return ids, weights


def check(name: str, got: torch.Tensor, expected: torch.Tensor, tolerance) -> TensorCheck:
    record = _records.get(digest(expected))
    if record is None:
        return TensorCheck(name=name, passed=False, problems=[
            f"{name}: no record of this expected result (check only what this problem's reference returned)"])
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return TensorCheck(name=name, passed=False, problems=[
            f"{name}: got {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}"])
    if expected.dtype == torch.int64:
        return check_ids(name, got.cpu(), record)
    ids = record.got_ids if record.got_ids is not None else record.ids
    return check_tensor(name, got, expected_weights(record, ids), tolerance)


def expected_weights(record: _Record, ids: torch.Tensor) -> torch.Tensor:
    """The exact weights of the experts `ids`: their scores, renormalized if asked, scaled; fp32."""
    w = record.scores.gather(-1, ids)
    if record.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return (w * record.scaling).float()


def check_ids(name: str, got: torch.Tensor, record: _Record) -> TensorCheck:
    """Ids equal to the reference's wherever the two keys there are not within tie tolerance (module doc)."""
    record.got_ids = None
    ref, n_exp = record.ids, record.keys.shape[-1]
    result = TensorCheck(name=name, passed=False, numel=got.numel())
    if got.numel() and (int(got.min()) < 0 or int(got.max()) >= n_exp):
        result.problems = [f"{name}: ids outside 0..{n_exp - 1}"]
        return result
    repeated = [t for t in range(got.shape[0]) if got[t].unique().numel() != got.shape[1]]
    if repeated:
        result.problems = [f"{name}: token {repeated[0]} chooses an expert twice ({len(repeated)} tokens)"]
        return result
    differs = got != ref
    gap = (record.keys.gather(-1, got) - record.keys.gather(-1, ref)).abs()
    units = gap / (record.eps.gather(-1, got) + record.eps.gather(-1, ref))
    units = units.where(differs, torch.zeros((), dtype=units.dtype))
    result.close_fraction = 1.0 - float(differs.double().mean()) if got.numel() else 1.0
    result.max_units = float(units.max()) if got.numel() else 0.0
    wrong = units > 1
    positions = [tuple(int(i) for i in p) for p in (wrong if wrong.any() else differs).nonzero()]
    result.mismatches = [f"{name}[{t}, {i}] = {int(got[t, i])} (key {float(record.keys[t, got[t, i]]):.9g}), "
                         f"reference {int(ref[t, i])} (key {float(record.keys[t, ref[t, i]]):.9g}): "
                         f"{float(units[t, i]):.3g} tie tolerances apart" for t, i in positions[:5]]
    if wrong.any():
        result.problems = [f"{name}: {int(wrong.sum())} ids differ from the reference's by more than a tie "
                           f"(worst {result.max_units:.3g} tie tolerances)"]
        return result
    result.passed = True
    record.got_ids = got
    return result


def _plant_ties(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
    """The exact and near ties of the module doc, in place on w and bias (rows of x ranked in float64)."""
    n_exp = w.shape[0]
    if top_k < 2 or top_k + 2 > n_exp:
        return
    keys = exact(x[:1], w, bias)[0][0]
    order = keys.argsort(descending=True)
    # The first copy lifts expert order[k + 1] into the top k beside order[k // 2], which pushes order[k - 1]
    # out: the k-th is then order[k - 2], and the second copy ties it.
    pairs = ((int(order[top_k // 2]), int(order[top_k + 1])), (int(order[top_k - 2]), int(order[-1])))
    for src, dst in pairs:
        w[dst] = w[src]
        bias[dst] = bias[src]
    touched = {e for pair in pairs for e in pair}
    for t in range(1, min(x.shape[0], NEAR_TIE_TOKENS + 1)):
        keys = exact(x[t:t + 1], w, bias)[0][0]
        order = keys.argsort(descending=True)
        kth, nxt = int(order[top_k - 1]), int(order[top_k])
        if kth in touched or nxt in touched:
            continue
        ulp = 2.0**-23 * max(1.0, abs(float(keys[kth])))
        bias[nxt] = float(bias[nxt]) + float(keys[kth] - keys[nxt]) + NEAR_TIE_ULPS[t % len(NEAR_TIE_ULPS)] * ulp
        touched |= {kth, nxt}


def generate_input(point: Point, seed: int, dist: str) -> Case:
    n_exp, top_k, hidden = point["experts"], point["top_k"], point["hidden"]
    tokens = point.batch * (1 + point.spec_tokens)
    gen = torch.Generator().manual_seed(seed)
    x = sample((tokens, hidden), dist, gen, point.torch_dtype)
    w = (torch.randn(n_exp, hidden, generator=gen) * hidden**-0.5).to(point.torch_dtype)
    bias = torch.randn(n_exp, generator=gen) * BIAS_STD
    if tokens:
        _plant_ties(x, w, bias, top_k)
    return Case(args=(x, w, bias, top_k, True, SCALINGS[seed % len(SCALINGS)]))


def cost(point: Point) -> Cost:
    return OP.cost_of(*generate_input(point, 0, "normal").args)
