"""What the doctor's rules over TRL's own metric names (GRPOTrainer 1.16) share: for runs made with
plain TRL (or verifiers on TRL) that carry none of this project's instruments.

The rules themselves live in the stage of the GRPO step their findings belong to
(doctor/stages/<stage>.py, doctor/chain.py), with the same tiers and ranking as the
doctor's other rules: severity = tier + magnitude, tier 3 a direct proof, tier 2 a fingerprint past
a principled threshold, tier 1 a symptom with other causes. Our own runs log TRL's metrics too;
each such rule stands down where our instrument for the same defect is in the log (``_ours``,
``OURS``), so one defect is reported once, by the better measurement.

Where TRL's log cannot decide, the finding (or, for a hypothesis with no data, its ``unmeasured``
words in base/catalogue.py) says which musique_rl sweep or instrument would.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    H01_SIGNAL_GROUP_SHARE,
    H03_KL_MODEL_MEAN,
    H03_KL_NEGATIVE_SHARE,
    H04_BUDGET_CAP_SHARE,
    H05_COMPONENT_MEAN,
    H05_REWARD_ERRORS,
    H06_LOGP_GAP_MEAN,
    H08_UPDATE_WEIGHT_RATIO,
    PREFLIGHT_SIGNAL_SHARE_FORECAST,
    TRL_COMPLETIONS_CLIPPED_RATIO,
    TRL_REWARDS,
)
from musique_rl.doctor.findings import History, helper_reads, values

# ---------------------------------------------------------------- thresholds shared by several stages (and why)
# Share of completions cut at max_completion_length. A truncated completion usually has no answer,
# so the budget, not the policy, scores it; more than 1 in 10 binds (as the doctor's h04 budget rule).
CLIPPED_MAX = 0.1
# A reward function's std over the batch exactly 0 on at least this share of the logged steps (and at
# least CONSTANT_MIN_STEPS of them): it tells completions apart on at most one step in ten, so it
# carries (nearly) no signal; "on every step" would let a function that pays on 2 of 30 steps pass.
CONSTANT_MIN_STEPS = 5
CONSTANT_STEP_SHARE = 0.9
# One-sided p for "rises" / "falls" in the reward-vs-component trend (as the doctor's flat rule)
TREND_P = 0.05
TREND_MIN_POINTS = 8


# Our instruments for the same defects: a TRL-name rule stands down when one of these was logged.
OURS = {
    "zero_variance": (H01_SIGNAL_GROUP_SHARE, PREFLIGHT_SIGNAL_SHARE_FORECAST),
    "truncation": (H04_BUDGET_CAP_SHARE,),
    "logp_diff": (H06_LOGP_GAP_MEAN,),
    "lr": (H08_UPDATE_WEIGHT_RATIO,),
    "kl": (H03_KL_MODEL_MEAN, H03_KL_NEGATIVE_SHARE),
    "reward_funcs": (H05_REWARD_ERRORS, H05_COMPONENT_MEAN.of(component="answer_em"),
                     H05_COMPONENT_MEAN.of(component="answer_f1")),
}


def _ours(m: Mapping[str, History], what: str) -> bool:
    """Whether one of our instruments for ``what`` was logged (a rule calling it reads ``OURS[what]``)."""
    return any(values(m.get(k)) for k in OURS[what])


def _trend(h: History | None) -> tuple[float, float] | None:
    """(slope, one-sided p that it rises) of a history, or None with too few points."""
    pts = [(s, v) for s, v in (h or []) if v is not None and not math.isnan(v)]
    if len(pts) < TREND_MIN_POINTS or len({v for _, v in pts}) == 1:
        return None
    from scipy.stats import linregress

    fit = linregress([float(s) for s, _ in pts], [v for _, v in pts])
    return float(fit.slope), float(fit.pvalue / 2 if fit.slope > 0 else 1 - fit.pvalue / 2)


def reward_funcs(m: Mapping[str, History]) -> list[str]:
    """Names of the reward functions TRL logged (``rewards/<f>/mean``)."""
    return sorted({s["func"] for k in m if (s := TRL_REWARDS.segments(k)) is not None and s["stat"] == "mean"})


@helper_reads(TRL_REWARDS)
def tied_step_share(m: Mapping[str, History], func: str) -> float | None:
    """The share of logged steps on which reward function ``func`` gave every completion the same value
    (its std over the batch exactly 0); None with fewer than CONSTANT_MIN_STEPS logged steps."""
    std = values(m.get(TRL_REWARDS.of(func=func, stat="std")))
    if len(std) < CONSTANT_MIN_STEPS:
        return None
    return sum(1 for s in std if s == 0) / len(std)


@helper_reads(TRL_REWARDS)
def tied_value(m: Mapping[str, History], func: str) -> float:
    """The value reward function ``func`` gave the whole batch on the steps it gave everyone the same
    (the median of its mean on those steps; its mean over every step when there are none)."""
    std = dict(m.get(TRL_REWARDS.of(func=func, stat="std")) or [])
    mean = [(s, v) for s, v in (m.get(TRL_REWARDS.of(func=func, stat="mean")) or []) if v is not None]
    tied = [v for s, v in mean if std.get(s) == 0]
    return statistics.median(tied) if tied else statistics.fmean(v for _, v in mean)


@helper_reads(*tied_step_share.reads)
def constant_funcs(m: Mapping[str, History]) -> dict[str, float]:
    """Reward functions that tell no completion apart on (nearly) every logged step: the same value for
    the whole batch on at least CONSTANT_STEP_SHARE of the steps (a function that pays on 2 of 30 steps
    does not "vary": it carries signal on a fifteenth of the run): {name: mean}."""
    out = {}
    for f in reward_funcs(m):
        share = tied_step_share(m, f)
        if share is not None and share >= CONSTANT_STEP_SHARE:
            out[f] = statistics.fmean(values(m.get(TRL_REWARDS.of(func=f, stat="mean"))))
    return out


@helper_reads(TRL_COMPLETIONS_CLIPPED_RATIO)
def clipped_share(m: Mapping[str, History]) -> float | None:
    c = values(m.get(TRL_COMPLETIONS_CLIPPED_RATIO))
    return statistics.fmean(c) if c else None
