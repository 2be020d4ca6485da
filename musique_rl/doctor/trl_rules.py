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
# A reward function's std over the batch at exactly 0 on every logged step (at least this many).
CONSTANT_MIN_STEPS = 5
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
def constant_funcs(m: Mapping[str, History]) -> dict[str, float]:
    """Reward functions whose std over the batch is exactly 0 at every logged step: {name: mean}."""
    out = {}
    for f in reward_funcs(m):
        std = values(m.get(TRL_REWARDS.of(func=f, stat="std")))
        if len(std) >= CONSTANT_MIN_STEPS and max(abs(s) for s in std) == 0:
            out[f] = statistics.fmean(values(m.get(TRL_REWARDS.of(func=f, stat="mean"))))
    return out


@helper_reads(TRL_COMPLETIONS_CLIPPED_RATIO)
def clipped_share(m: Mapping[str, History]) -> float | None:
    c = values(m.get(TRL_COMPLETIONS_CLIPPED_RATIO))
    return statistics.fmean(c) if c else None
