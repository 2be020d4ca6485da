"""Learnability pre-flight: will groups from this policy carry any learning signal?

docs/failure_modes.md defect 7: a group whose completions all pass (or all fail) has zero reward variance and
no gradient. For a question the policy passes with probability p, a group of G completions is
all-same with probability p^G + (1-p)^G. Averaged over questions from the initial policy's own
groups, that forecasts the share of groups that will teach nothing, before any compute is spent.
"""

from __future__ import annotations

import logging

import torch

from musique_rl.base.catalogue import (
    MIN_SIGNAL_SHARE,  # shared with the doctor's learnability rule
    PREFLIGHT_PASS_AT_G,
    PREFLIGHT_PASS_RATE_MEAN,
    PREFLIGHT_QUESTIONS,
    PREFLIGHT_SIGNAL_SHARE_FORECAST,
    PREFLIGHT_ZERO_VARIANCE_FORECAST,
    PREFLIGHT_ZERO_VARIANCE_OBSERVED,
)

log = logging.getLogger(__name__)



@torch.no_grad()
def learnability(passed: torch.Tensor, num_generations: int) -> dict[str, float]:
    """preflight/* from pass/fail of each completion (N,), groups of G contiguous."""
    g = num_generations
    p = passed.detach().double().view(-1, g).mean(dim=1)  # pass rate per question
    forecast = p.pow(g) + (1 - p).pow(g)
    observed = ((p == 0) | (p == 1)).double()
    return {
        PREFLIGHT_PASS_RATE_MEAN: float(p.mean()),
        PREFLIGHT_PASS_AT_G: float((p > 0).double().mean()),  # share of questions solved at least once
        PREFLIGHT_ZERO_VARIANCE_FORECAST: float(forecast.mean()),
        PREFLIGHT_ZERO_VARIANCE_OBSERVED: float(observed.mean()),
        PREFLIGHT_SIGNAL_SHARE_FORECAST: float(1 - forecast.mean()),
        PREFLIGHT_QUESTIONS: float(p.numel()),
    }


def warning(metrics: dict[str, float], min_signal_share: float = MIN_SIGNAL_SHARE) -> str | None:
    """A sentence for the log when too few groups would carry signal, else None."""
    share = metrics.get(PREFLIGHT_SIGNAL_SHARE_FORECAST)
    if share is None or share >= min_signal_share:
        return None
    return (
        f"pre-flight: only {share:.0%} of groups are forecast to carry learning signal "
        f"(pass rate {metrics[PREFLIGHT_PASS_RATE_MEAN]:.2f}, zero-variance forecast "
        f"{metrics[PREFLIGHT_ZERO_VARIANCE_FORECAST]:.2f} < {1 - min_signal_share:.2f} allowed): "
        "the task is too easy or too hard for this policy at this group size"
    )
