"""What TRL's importance-sampling correction did to a batch: masked and clipped shares, effective sample size.

TRL 1.16 (``GRPOTrainer._generate_and_score_completions``, ``vllm_importance_sampling_*``) weights
each sequence's (``sequence_*``) or token's (``token_*``) loss by exp(trainer log-prob - sampler
log-prob), over the loss tokens (completion mask x tool mask), and either zeroes ratios outside
[clip_min, clip_max] (``*_mask``) or clamps them to it (``*_truncate``). It logs the ratios'
min/mean/max only, so a correction that zeroes most long episodes looks like a flat reward.
``importance_weights`` recomputes the same weights (tests/test_importance.py checks them against
TRL's own ``importance_sampling_ratio``, the weights its loss uses) and ``importance_metrics``
says what they did. Written here because TRL exposes neither the raw ratios nor these shares.
"""

from __future__ import annotations

import math

import torch

from musique_rl.base.catalogue import (
    H06_IS_CLIPPED_SHARE,
    H06_IS_ESS,
    H06_IS_MASKED_SEQ_SHARE,
    H06_IS_MASKED_TOKEN_SHARE,
)
from musique_rl.core.config import ImportanceSampling

# TRL's importance-sampling modes (the config's ImportanceSampling less its auto and off)
MODES = tuple(m.value for m in ImportanceSampling if m not in (ImportanceSampling.auto, ImportanceSampling.off))


def importance_weights(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, loss_mask: torch.Tensor,
                       mode: str, clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, outside): TRL's weights, (N, 1) for sequence modes and (N, T) for token modes, and
    where the raw ratio fell outside [clip_min, clip_max] (zeroed or clamped). ``mode``: one of
    sequence_mask, sequence_truncate, token_mask, token_truncate (core/config.py ImportanceSampling:
    the schema refuses any other)."""
    mask = loss_mask.to(trainer_logps.dtype)
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo = -math.inf if clip_min is None else float(clip_min)
    hi = math.inf if clip_max is None else float(clip_max)
    outside = (ratio < lo) | (ratio > hi)
    if mode.endswith("mask"):
        return ratio.masked_fill(outside, 0.0), outside
    return torch.clamp(ratio, min=clip_min, max=clip_max), outside


def importance_metrics(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, loss_mask: torch.Tensor,
                       mode: str, clip_min: float | None, clip_max: float | None) -> dict[str, float]:
    """One batch's ``h06/is_*`` metrics (sequences without a loss token are left out):

    - ``h06/is_masked_seq_share``: sequences whose every loss token has weight 0 (no gradient at all);
    - ``h06/is_masked_token_share``: loss tokens with weight 0;
    - ``h06/is_clipped_share``: ratios (a sequence's or a token's, by mode) outside the bounds,
      zeroed by a ``*_mask`` mode or clamped by a ``*_truncate`` one;
    - ``h06/is_ess``: effective sample size of the weights over those units, (sum w)^2 / (n sum w^2),
      in [0, 1]: 1 when every unit counts alike, 1/n when one carries the batch, 0 when none does.
    """
    weights, outside = importance_weights(trainer_logps, sampling_logps, loss_mask, mode, clip_min, clip_max)
    mask = loss_mask.bool()
    rows = mask.any(dim=-1)
    if not bool(rows.any()):
        return {}
    per_token = weights.expand_as(mask)
    zero = (per_token == 0) & mask
    masked_rows = (zero.sum(-1) == mask.sum(-1)) & rows
    units = weights[rows, 0] if weights.shape[-1] == 1 and mode.startswith("sequence") else weights[mask]
    out_units = outside[rows, 0] if mode.startswith("sequence") else outside[mask]
    w = units.double()
    sq = float((w * w).sum())
    ess = float(w.sum()) ** 2 / (len(w) * sq) if sq > 0 else 0.0
    return {
        H06_IS_MASKED_SEQ_SHARE: float(masked_rows.sum()) / float(rows.sum()),
        H06_IS_MASKED_TOKEN_SHARE: float(zero.sum()) / float(mask.sum()),
        H06_IS_CLIPPED_SHARE: float(out_units.double().mean()),
        H06_IS_ESS: ess,
    }
