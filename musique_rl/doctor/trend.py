"""The logged reward's trend over a run (least squares), and the gain it could detect: read by the
flat-reward finding (reward_power) and by the policy stage's within-group-spread alarm
(stages/policy.py). Its own module so that neither imports the other (reward_power needs the policy
stage's ``barely_moves``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import TRL_REWARD
from musique_rl.doctor.findings import History, helper_reads

# The reward "rises" when the least-squares slope over the run is positive at one-sided p < FLAT_P
# (scipy.stats.linregress); below FLAT_MIN_POINTS logged steps nothing is said.
FLAT_P = 0.05
FLAT_MIN_POINTS = 8
# "Too short to judge": the reward rose, short of significance, with one-sided p < TOO_SHORT_P (the
# observed gain is >= 0.84 of its standard errors above 0: a rise is more likely than not). Such a run
# is not flat: no flat-reward finding is made of it.
TOO_SHORT_P = 0.2
# Detectable gain: the gain over the run that a one-sided test at FLAT_P detects with 80% power,
# (z_0.95 + z_0.80) standard errors of the fitted gain.
Z_ALPHA, Z_POWER = 1.6449, 0.8416


@helper_reads(TRL_REWARD)
def reward_trend(m: Mapping[str, History]) -> dict[str, float] | None:
    """Least-squares slope of the logged reward over steps, its one-sided p (slope > 0), the fitted
    gain over the run and its standard error, and the detectable gain (80% power at FLAT_P)."""
    pts = [(s, v) for s, v in (m.get(TRL_REWARD) or []) if v is not None and not math.isnan(v)]
    if len(pts) < FLAT_MIN_POINTS:
        return None
    from scipy.stats import linregress

    xs, ys = [float(s) for s, _ in pts], [v for _, v in pts]
    span = xs[-1] - xs[0]
    q = max(2, len(ys) // 4)
    base = {"first": statistics.fmean(ys[:q]), "last": statistics.fmean(ys[-q:]), "points": float(len(ys)),
            "span": span}
    if len(set(ys)) == 1:
        return {**base, "slope": 0.0, "p_rise": 1.0, "gain": 0.0, "gain_se": 0.0, "detectable_gain": 0.0}
    fit = linregress(xs, ys)
    p_rise = fit.pvalue / 2 if fit.slope > 0 else 1 - fit.pvalue / 2
    se = float(fit.stderr) * span
    return {**base, "slope": float(fit.slope), "p_rise": float(p_rise), "gain": float(fit.slope) * span,
            "gain_se": se, "detectable_gain": (Z_ALPHA + Z_POWER) * se}


def flat(t: dict[str, float] | None) -> bool:
    """Whether a trend (``reward_trend``) is flat: no significant rise, and no rise short of
    significance that is more likely than not (that is "too short to judge", not flat)."""
    return t is not None and t["p_rise"] >= FLAT_P and not too_short(t)


def too_short(t: dict[str, float]) -> bool:
    """A rise short of significance but more likely than not: too short to judge, not flat."""
    return t["p_rise"] < TOO_SHORT_P and t["gain"] > 0
