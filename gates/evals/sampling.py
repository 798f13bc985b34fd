"""Temperature sampling: does the candidate path sample from the distribution the reference path defines?

Both paths are fed one trajectory (a prompt, then tokens the reference samples at T = 1), so they are
compared on identical contexts at every position. Two kinds of check:

- Exact, no sampling noise: at every position and every (temperature, top-p), the total-variation distance
  between the two paths' sampling distributions (softmax(logits / T) cut to the top-p nucleus) is at most
  `tv_bound`, and KL(reference || candidate) of the full distributions at T = 1 at most `kl_bound`, both as
  the max and the mean over positions. With a standard path beside (the yardstick, on the GPU), each bound is
  the larger of that and `slack` x the standard's own distance from the reference in the same run: in bf16 on
  random weights two correct implementations that round differently diverge through top-k routing flips, and
  the candidate is held to the standard's precision. The mean catches a systematic error such as a changed
  temperature, which shifts every position, where the max of rounding noise would hide it.
- Empirical, through the candidate's own sampler: at a few positions, `samples` seeded draws per
  (temperature, top-p). Every draw must lie inside the candidate's top-p set. The draws' distance from the
  reference's distribution may be at most the exact distance, at that row, between the candidate's own
  distribution and the reference's, plus sampling noise (triangle inequality): in TV over `DRAW_BINS` bins of
  the reference's mass (token-level TV of a few thousand draws over a 160k vocabulary is noise above 0.5, a
  bound that cannot fail) and in the Kolmogorov-Smirnov distance over the reference's token ranking (see
  `stats`). So the draws test the sampler against the distribution the candidate's logits define, whatever
  room a yardstick gives the logits, and each bound is a few hundredths above that row's exact distance. The
  noise bounds hold with probability 1 - `false_fail` for a correct sampler, so an identical path passes and,
  for the fixed seed, always passes.

Scaling the logits by 1.05 moves about 4 % of the mass from tail to head (TV ~ 0.04, KL ~ 5e-3 on the
tiny preset): far outside the bounds of the exact checks. A sampler drawing at T / 1.05 from right logits is
outside the KS bound at the CPU sample count.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.progress import Progress

from model.kimi_k3.sampling import top_p_probs

from .config import EvalConfig
from .paths import DecodePath, PathPair
from .result import Check, EvalResult, Plot, Table, badness, yardstick_bound
from .stats import (
    binned,
    dkw_bound,
    empirical,
    kl_divergence,
    mass_bins,
    rank_cdf_distance,
    tv_distance,
    tv_noise_bound,
)

NAME = "sampling"
SAMPLER_ELEMENTS = 1 << 24  # logits elements handed to a sampler at once ([rows, vocab] probabilities)
# Bins of the reference's mass for the draws' TV: noise <= 0.5 * sqrt(32 / n) + McDiarmid, about 0.05 at the CPU's
# 16384 draws and 0.09 at the GPU gate's 4096; a tenth of the mass per bin still sees a changed temperature.
DRAW_BINS = 32


class SamplingBudget(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = Field(16, gt=0)
    positions: int = Field(gt=0, description="trajectory positions compared (the prompt's last, then decode steps)")
    temperatures: tuple[float, ...] = Field((0.6, 1.0), min_length=1)
    top_ps: tuple[float, ...] = Field((1.0, 0.95), min_length=1)
    sampled_positions: int = Field(gt=0, description="positions where the candidate's sampler draws")
    samples: int = Field(gt=0, description="seeded draws per (position, temperature, top-p)")
    tv_bound: float = Field(gt=0, description="exact per-position TV between the paths' sampling distributions")
    kl_bound: float = Field(gt=0, description="per-position KL(reference || candidate) at T = 1")
    false_fail: float = Field(1e-6, gt=0, lt=1, description="chance a correct sampler fails any empirical test")
    slack: float = Field(1.5, ge=1, description="with a standard path beside: the candidate's TV and KL may reach "
                                               "slack x the standard's own (max and mean over positions)")


class SamplingConfig(EvalConfig[SamplingBudget]):
    # fp32 on CPU: implementations of the same math differ by ~1e-5 in logits, TV and KL far below these.
    cpu: SamplingBudget = SamplingBudget(positions=24, sampled_positions=2, samples=16384, tv_bound=1e-3,
                                         kl_bound=1e-5)
    # bf16 on the GPU: rounding points differ between fused kernels and the reference; the gate runs the standard
    # path beside as the yardstick (scaled logits sit at TV ~ 0.04, KL ~ 5e-3 on the tiny preset).
    gpu: SamplingBudget = SamplingBudget(positions=64, sampled_positions=2, samples=16384, tv_bound=2e-2,
                                         kl_bound=1e-3)


class _DrawTest(BaseModel):
    position: int
    temperature: float
    top_p: float
    outside_top_p: int
    tv: float
    tv_bound: float
    ks: float
    ks_bound: float


def run(config: SamplingConfig, paths: PathPair, progress: Progress) -> EvalResult:
    budget = config.budget(paths.device)
    vocab = paths.cfg.vocab_size
    settings = [(t, p) for t in budget.temperatures for p in budget.top_ps]
    every = max(1, budget.positions // budget.sampled_positions)
    sampled = set(range(every - 1, budget.positions, every)[:budget.sampled_positions])
    delta = budget.false_fail / (2 * len(sampled) * len(settings))  # TV and KS for every draw test

    seeds = torch.Generator().manual_seed(config.seed)
    prompt = torch.randint(0, vocab, (budget.prompt_tokens,), generator=seeds).tolist()
    trajectory = torch.Generator().manual_seed(config.seed + 1)
    max_len = budget.prompt_tokens + budget.positions
    others = [paths.candidate] + ([paths.standard] if paths.standard else [])  # the standard: the yardstick
    ref = paths.reference.session(max_len)
    sessions = [path.session(max_len) for path in others]
    ref_logits = ref.feed(prompt)
    logits = [s.feed(prompt) for s in sessions]

    tv = torch.zeros(len(others), budget.positions, len(settings), dtype=torch.float64)
    kl = torch.zeros(len(others), budget.positions, dtype=torch.float64)
    drawn = []
    task = progress.add_task(f"{NAME}: {paths.label}", total=budget.positions)
    for pos in range(budget.positions):
        for i, other in enumerate(logits):
            kl[i, pos] = kl_divergence(ref_logits, other).cpu()
        cand_logits = logits[0]
        for j, (temperature, top_p) in enumerate(settings):
            p_ref = top_p_probs(ref_logits[None], temperature, top_p)[0]
            for i, other in enumerate(logits):
                tv[i, pos, j] = tv_distance(p_ref, top_p_probs(other[None], temperature, top_p)[0]).cpu()
            if pos in sampled:
                p_cand = top_p_probs(cand_logits[None], temperature, top_p)[0]
                base_seed = int(torch.randint(0, 2**62, (1,), generator=seeds))
                draws = _draw(paths.candidate, cand_logits, temperature, top_p, budget.samples, base_seed)
                drawn.append((pos, temperature, top_p, draws, p_ref.cpu(), p_cand.cpu()))
        if pos + 1 < budget.positions:
            next_token = paths.reference.sampler(ref_logits[None], 1.0, 1.0, [trajectory])[0].tolist()  # [id]
            ref_logits = ref.feed(next_token)
            logits = [s.feed(next_token) for s in sessions]
        progress.advance(task)

    tests = [_draw_test(*d, delta) for d in drawn]
    return _result(budget, settings, tv[0], kl[0], tests, config.seed, *((tv[1], kl[1]) if paths.standard else ()))


def _draw(path: DecodePath, logits: torch.Tensor, temperature: float, top_p: float, n: int, base_seed: int):
    """n draws by the path's sampler from one row of logits, draw i from a generator seeded base_seed + i."""
    rows = max(1, SAMPLER_ELEMENTS // logits.shape[-1])
    out = []
    for start in range(0, n, rows):
        gens = [torch.Generator().manual_seed(base_seed + i) for i in range(start, min(n, start + rows))]
        out.append(path.sampler(logits[None].expand(len(gens), -1), temperature, top_p, gens)[0].cpu())
    return torch.cat(out)


def _draw_test(pos: int, temperature: float, top_p: float, draws: torch.Tensor, p_ref: torch.Tensor,
               p_cand: torch.Tensor, delta: float) -> _DrawTest:
    """Draws that should come from p_cand, against p_ref: D(empirical, p_ref) <= D(empirical, p_cand) +
    D(p_cand, p_ref) for D the binned TV and the KS distance over p_ref's ranking; the first term within its noise
    bound with probability 1 - delta for a sampler that draws from p_cand, the second computed exactly."""
    q = empirical(draws, p_ref.shape[-1])
    n = draws.numel()
    bins = mass_bins(p_ref, DRAW_BINS)
    q_b, ref_b, cand_b = (binned(p, bins, DRAW_BINS) for p in (q, p_ref, p_cand))
    return _DrawTest(
        position=pos, temperature=temperature, top_p=top_p,
        outside_top_p=int((p_cand[draws] == 0).sum()),
        tv=tv_distance(q_b, ref_b).item(),
        tv_bound=tv_distance(cand_b, ref_b).item() + tv_noise_bound(cand_b, n, delta),
        ks=rank_cdf_distance(q, p_ref), ks_bound=rank_cdf_distance(p_cand, p_ref) + dkw_bound(n, delta),
    )


def _result(budget: SamplingBudget, settings, tv: torch.Tensor, kl: torch.Tensor, tests: list[_DrawTest],
            seed: int, tv_std: torch.Tensor | None = None, kl_std: torch.Tensor | None = None) -> EvalResult:
    worst_pos, worst_setting = divmod(int(tv.argmax()), len(settings))
    yardstick = tv_std is not None
    def std(stat: torch.Tensor | None, reduce: str) -> float | None:
        return None if stat is None else getattr(stat, reduce)().item()

    max_bound = yardstick_bound(budget.tv_bound, std(tv_std, "max"), budget.slack)  # what "exact TV" applies
    exact = Table(title="exact sampling distributions, per (temperature, top-p) over all positions",
                  columns=["temperature", "top_p", "max TV", "max TV bound", "mean TV"]
                  + (["standard max TV", "standard mean TV"] if yardstick else []))
    for j, (temperature, top_p) in enumerate(settings):
        exact.add(temperature, top_p, tv[:, j].max(), max_bound, tv[:, j].mean(),
                  *((tv_std[:, j].max(), tv_std[:, j].mean()) if yardstick else ()))
    draws = Table(title=f"the candidate's sampler, {budget.samples} seeded draws per row (TV over {DRAW_BINS} bins "
                        "of the reference's mass; each bound: the row's exact distance + sampling noise)",
                  columns=["position", "temperature", "top_p", "outside top-p", "TV", "TV bound", "KS", "KS bound"])
    for t in tests:
        draws.add(t.position, t.temperature, t.top_p, t.outside_top_p, t.tv, t.tv_bound, t.ks, t.ks_bound)

    worst_tv = max(tests, key=lambda t: badness(t.tv - t.tv_bound))
    worst_ks = max(tests, key=lambda t: badness(t.ks - t.ks_bound))
    t_w, p_w = settings[worst_setting]

    checks = [
        Check.no_worse("exact TV", tv.max().item(), budget.tv_bound, std(tv_std, "max"), budget.slack,
                       f"max over {tv.numel()} (position, temperature, top-p); at position {worst_pos}, T={t_w}, "
                       f"top-p={p_w}"),
        Check.no_worse("mean exact TV", tv.mean().item(), budget.tv_bound, std(tv_std, "mean"), budget.slack,
                       f"mean over {tv.numel()} (position, temperature, top-p)"),
        Check.no_worse("KL at T=1", kl.max().item(), budget.kl_bound, std(kl_std, "max"), budget.slack,
                       f"max over {kl.numel()} positions"),
        Check.no_worse("mean KL at T=1", kl.mean().item(), budget.kl_bound, std(kl_std, "mean"), budget.slack,
                       f"mean over {kl.numel()} positions"),
        Check.at_most("draws outside top-p", sum(t.outside_top_p for t in tests), 0,
                      f"{len(tests) * budget.samples} draws, each checked against the candidate's own nucleus"),
        Check.at_most("empirical TV", worst_tv.tv, worst_tv.tv_bound, _where(worst_tv, len(tests))),
        Check.at_most("empirical KS", worst_ks.ks, worst_ks.ks_bound, _where(worst_ks, len(tests))),
    ]
    metrics = {"tv_max": tv.max().item(), "tv_mean": tv.mean().item(), "kl_max": kl.max().item(),
               "kl_mean": kl.mean().item(), "positions": budget.positions, "draw_tests": len(tests),
               "samples_per_test": budget.samples}
    if yardstick:
        metrics.update({"standard_tv_max": tv_std.max().item(), "standard_tv_mean": tv_std.mean().item(),
                        "standard_kl_max": kl_std.max().item(), "standard_kl_mean": kl_std.mean().item()})
    series = {"candidate": tv.max(0).values.tolist()}
    if yardstick:
        series["standard"] = tv_std.max(0).values.tolist()
    plot = Plot(title="exact TV from the reference's sampling distribution, worst position",
                x_label="temperature, top-p", y_label="max TV", categories=[f"T={t}, p={p}" for t, p in settings],
                series=series, bound=checks[0].bound)
    return EvalResult.from_checks(NAME, checks, metrics=metrics, tables=[exact, draws], plots=[plot],
                                  budget={"seed": seed, **budget.model_dump()})


def _where(test: _DrawTest, count: int) -> str:
    return (f"tightest of {count} tests: position {test.position}, T={test.temperature}, top-p={test.top_p} "
            f"(bound = that row's exact distance from the reference + sampling noise)")
