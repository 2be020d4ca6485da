"""The decision rule: paired differences in, a status and its confidence out. Pure functions.

Input: d_i = treatment minus control on seed i (both arms share seed i's data order and model
init, so seed-to-seed variance cancels), n complete pairs.

Interval: Student's t on the paired differences, mean(d) +- t_{(1+level)/2, n-1} * sd(d) / sqrt(n).
Not a bootstrap: a sweep has 3-5 pairs, and the bootstrap resamples only the values it has. Three
values have 10 distinct resamples, none more extreme than the most extreme value, so its
percentile interval is narrower than the data warrant (coverage well under the nominal 95% for
n < ~10); two identical-sign pairs always "exclude 0". The t-interval widens for small n through
t_{0.975, n-1} (12.7 for 2 pairs, 4.30 for 3, 2.78 for 5) and is exact when the differences are
normal; with n this small nothing can check that assumption, hence the second check.

Second check, distribution-free: the exact sign-flip permutation test. Under "no effect" each
difference is as likely to be +d_i as -d_i, so the 2^n sign assignments are equally likely; the
two-sided p-value is the share whose |mean| reaches the observed |mean| (scipy's
``permutation_test``, all 2^n assignments for n <= 20, else 100,000 seeded ones). Its smallest
possible value is 2 / 2^n: 0.25 for 3 pairs, 0.0625 for 5, so below 6 pairs it can never reach
0.05 whatever the effect. It is reported beside the status, it does not set it.

Criterion (the hypothesis' ``direction`` and ``min_effect``), with the differences signed so the
predicted direction is positive and [lo, hi] their interval:
  Validated    lo >  min_effect   (the effect is there and at least as large as claimed)
  Invalidated  hi <  min_effect   (any effect is smaller than claimed, or opposite)
  Inconclusive otherwise, or with fewer than 2 complete pairs (no interval from one pair).
Confidence: the mass of the t-distribution for the mean effect (centred on mean(d), scale
sd/sqrt(n), n-1 degrees of freedom) on the side of min_effect that the status names: P(effect >
min_effect) for Validated, P(effect < min_effect) for Invalidated, the larger of the two for
Inconclusive. Validated or Invalidated at level 0.95 therefore means confidence >= 0.975.
All differences equal (sd 0): the interval is the point mean(d) and the mass sits on one side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EXACT_SIGN_FLIP_MAX_N = 20  # 2^20 assignments: about a second; beyond, Monte Carlo
SIGN_FLIP_RESAMPLES = 100_000


@dataclass(frozen=True)
class Interval:
    """The t-interval of the mean of the paired differences."""

    mean: float
    lo: float
    hi: float
    sd: float  # sample standard deviation of the differences (ddof 1)
    df: int  # n - 1
    level: float

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.df + 1)

    def mass_above(self, x: float) -> float:
        """P(mean effect > x) under the t-distribution of the interval (1, 0 or 1/2 when sd is 0)."""
        if self.se == 0.0:
            return 1.0 if self.mean > x else 0.0 if self.mean < x else 0.5
        from scipy import stats  # imported here: ~1 s, and every Hydra run imports this package

        return float(stats.t.sf(x, self.df, loc=self.mean, scale=self.se))


def t_interval(diffs: np.ndarray | list[float], level: float = 0.95) -> Interval:
    """Student's t-interval of mean(diffs) at ``level``; at least 2 differences."""
    d = np.asarray(diffs, dtype=float)
    if d.size < 2:
        raise ValueError(f"a t-interval needs at least 2 paired differences, got {d.size}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"interval level must lie in (0, 1), got {level}")
    if np.ptp(d) == 0.0:
        # identical differences: a point, not the ~1e-17 sd that rounding in mean() would leave
        value = float(d[0])
        return Interval(value, value, value, 0.0, d.size - 1, level)
    from scipy import stats

    mean, sd = float(d.mean()), float(d.std(ddof=1))
    lo, hi = stats.t.interval(level, d.size - 1, loc=mean, scale=sd / math.sqrt(d.size))
    return Interval(mean, float(lo), float(hi), sd, d.size - 1, level)


@dataclass(frozen=True)
class SignFlip:
    p: float  # two-sided
    exact: bool  # all 2^n assignments (else SIGN_FLIP_RESAMPLES seeded ones)
    min_p: float  # the smallest p any data could give with this n (exact test)


def sign_flip_test(diffs: np.ndarray | list[float]) -> SignFlip:
    """Two-sided sign-flip permutation test of mean(diffs) = 0."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        raise ValueError("a sign-flip test needs at least 1 paired difference")
    exact = d.size <= EXACT_SIGN_FLIP_MAX_N
    # one sample + permutation_type="samples": scipy flips the sign of each observation
    res = stats.permutation_test((d,), np.mean, permutation_type="samples", vectorized=True,
                                 n_resamples=np.inf if exact else SIGN_FLIP_RESAMPLES,
                                 alternative="two-sided", rng=0)
    return SignFlip(p=float(res.pvalue), exact=exact, min_p=min(1.0, 2.0 / 2.0**d.size))


@dataclass(frozen=True)
class Decision:
    status: str  # Validated | Invalidated | Inconclusive
    confidence: float
    interval: Interval  # of the differences as measured (treatment minus control)
    signed_lo: float  # the interval signed so the predicted direction is positive
    signed_hi: float
    p_beyond: float  # P(signed effect > min_effect) under the t-distribution
    sign_flip: SignFlip
    agree: int  # pairs whose difference has the predicted sign


def decide(diffs: np.ndarray | list[float], direction: str, min_effect: float, level: float = 0.95) -> Decision:
    """Apply the criterion (module docstring) to at least 2 paired differences."""
    if direction not in ("increase", "decrease"):
        raise ValueError(f"direction must be increase or decrease, got {direction!r}")
    d = np.asarray(diffs, dtype=float)
    sign = 1.0 if direction == "increase" else -1.0
    iv = t_interval(d, level)
    signed_lo, signed_hi = sorted((sign * iv.lo, sign * iv.hi))
    # P(signed effect > m) = P(effect > m) when increasing, P(effect < -m) when decreasing
    p_beyond = iv.mass_above(min_effect) if sign > 0 else 1.0 - iv.mass_above(-min_effect)
    if signed_lo > min_effect:
        status, confidence = "Validated", p_beyond
    elif signed_hi < min_effect:
        status, confidence = "Invalidated", 1.0 - p_beyond
    else:
        status, confidence = "Inconclusive", max(p_beyond, 1.0 - p_beyond)
    return Decision(status, confidence, iv, signed_lo, signed_hi, p_beyond, sign_flip_test(d),
                    agree=int(np.sum(sign * d > 0)))
