"""When a benchmark has timed enough: block estimates, their confidence interval, and the stopping rule.

One block is a run of interleaved (candidate, standard) replay pairs. Its statistics (the speedup: median of
the per-pair ratios standard / candidate; the fraction of the roofline: floor / the candidate's median) are
one observation each. Pairing cancels what a slow phase of the machine does to both; repeating whole blocks
turns a single lucky or unlucky run into one observation among several. Blocks are independent repetitions,
so the mean of a statistic over blocks has a Student-t confidence interval.

The gate asks for blocks until, for every statistic the contract bounds, the interval lies on one side of the
bound (decided) or is narrower than `precision` of the mean (a tight estimate sitting on the bound), with at
least `min_blocks` and at most `max_blocks`. A statistic still undecided at `max_blocks` is judged by its mean
and flagged for the reviewer.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95 % Student-t quantiles for 1..20 degrees of freedom; the normal's 1.96 beyond.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def t975(dof: int) -> float:
    return T975[dof - 1] if dof <= len(T975) else 1.96


def paired_speedup(candidate_us: list[float], standard_us: list[float]) -> float:
    """Median over pairs of standard / candidate: each ratio compares two replays timed side by side."""
    if len(candidate_us) != len(standard_us) or not candidate_us:
        raise ValueError(f"paired samples needed: {len(candidate_us)} candidate vs {len(standard_us)} standard")
    return statistics.median(s / c for c, s in zip(candidate_us, standard_us))


@dataclass(frozen=True)
class Estimate:
    """A statistic observed once per block: mean and 95 % confidence interval over blocks."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def half_width(self) -> float:
        if self.n < 2:
            return math.inf
        return t975(self.n - 1) * statistics.stdev(self.values) / math.sqrt(self.n)

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def decided(self, bound: float) -> bool:
        """The whole interval lies on one side of `bound`."""
        return self.low > bound or self.high < bound

    def precise(self, precision: float) -> bool:
        return self.half_width <= precision * abs(self.mean)

    def settled(self, bound: float | None, precision: float) -> bool:
        return self.precise(precision) or (bound is not None and self.decided(bound))


def enough(bounded: list[tuple[Estimate, float | None]], precision: float, min_blocks: int, max_blocks: int) -> bool:
    """Stop timing: every (estimate, bound) settled after at least min_blocks, or max_blocks reached."""
    n = min(e.n for e, _ in bounded)
    return n >= max_blocks or (n >= min_blocks and all(e.settled(b, precision) for e, b in bounded))
