"""H01: how much learning signal each group carries, and how much std scaling amplified it.

docs/failure_modes.md defect 7: with a strong baseline many groups are (near-)ties; dividing by the group
std turns a 0.01 win into the same advantage as a 1.0 win (one winner in 8 always gets 2.47).
Amplification is measured from the tensors the trainer really used (|advantage| / |reward - group
mean|), not from the config, so an epsilon that is not what the config says is caught too.
"""

from __future__ import annotations

import torch

from musique_rl.base.catalogue import (
    H01_ADV_ABS_MAX,
    H01_ADV_ABS_MEAN,
    H01_ADV_GROUP_SUM_REL_MAX,
    H01_ADV_SIGN_MISMATCH_SHARE,
    H01_AMPLIFICATION_MAX,
    H01_AMPLIFICATION_MEDIAN,
    H01_NEAR_TIE_ADV_ABS_MAX,
    H01_NEAR_TIE_ADV_SHARE,
    H01_NEAR_TIE_AMPLIFICATION_MAX,
    H01_NEAR_ZERO_STD_SHARE,
    H01_REWARD_STD_MEAN,
    H01_SIGNAL_GROUP_SHARE,
    H01_ZERO_STD_SHARE,
)
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch

# Centred rewards below this are float round-off, not a reward difference (fp32 rewards in [0, ~2]
# carry ~1e-7 relative precision); their ratio to the advantage is not an amplification.
_ROUNDOFF = 1e-12
_SIGN_MIN = 1e-5


def group_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per-group reward std (unbiased, NaN-aware, as TRL's `nanstd`), shape (N / G,)."""
    grouped = rewards.view(-1, num_generations).double()
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(dim=1)
    var = torch.nanmean((grouped - mean) ** 2, dim=1) * count / (count - 1).clamp(min=1)
    return var.sqrt()


@torch.no_grad()
def advantage_stats(
    rewards: torch.Tensor, advantages: torch.Tensor, num_generations: int, near_zero_std: float
) -> dict[str, float]:
    """H01 metrics for one generation batch.

    rewards: (N,) total reward per completion, N = groups x G, each group contiguous (TRL's layout);
      NaN marks an unscorable completion. advantages: (N,) as the loss used them.
    near_zero_std: a group whose reward std is below this carries ~no signal (diagnostics.near_zero_std).
    """
    g = num_generations
    if rewards.numel() % g:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of num_generations={g}")
    adv = advantages.detach().double().flatten()
    r = rewards.detach().double().flatten()
    std = group_std(r, g)  # (groups,)
    centred = r.view(-1, g) - torch.nanmean(r.view(-1, g), dim=1, keepdim=True)
    zero = torch.isclose(std, torch.zeros_like(std))  # TRL's frac_reward_zero_std test
    near = std < near_zero_std
    adv_abs = adv.abs().view(-1, g)
    moved = centred.abs() > _ROUNDOFF
    factor = torch.where(moved, adv_abs / centred.abs().clamp(min=_ROUNDOFF), torch.nan)
    near_tie = near & ~zero  # groups with a reward difference too small to mean anything
    total_mass = adv_abs.sum().clamp(min=1e-30)
    out = {
        H01_ADV_ABS_MAX: adv_abs.max(),
        H01_ADV_ABS_MEAN: adv_abs.mean(),
        H01_REWARD_STD_MEAN: torch.nanmean(std),
        H01_ZERO_STD_SHARE: zero.double().mean(),
        H01_NEAR_ZERO_STD_SHARE: near.double().mean(),
        H01_SIGNAL_GROUP_SHARE: (~near).double().mean(),
        # share of the total |advantage| handed to groups whose rewards differ by less than near_zero_std
        H01_NEAR_TIE_ADV_SHARE: adv_abs[near_tie].sum() / total_mass,
        H01_NEAR_TIE_ADV_ABS_MAX: adv_abs[near_tie].max() if near_tie.any() else torch.tensor(0.0),
    }
    # Invariants of TRL's group-relative advantages, whatever the scaling: (reward - group mean) / s
    # with s > 0 sums to 0 inside each group and has the sign of reward - group mean. A group whose
    # advantages do not sum to 0, or whose signs disagree with its rewards, was not formed from
    # these rewards (rewards re-ordered after grouping, groups misaligned across processes).
    # Checked on groups whose spread stands clear of round-off (std >= near_zero_std): in a
    # near-tie group float32 centring leaves errors of the size of the spread itself, which std
    # scaling then amplifies (that defect is h01 amplification, measured above).
    adv_g = adv.view(-1, g)
    scale = adv_g.abs().mean(dim=1).clamp(min=1e-12)
    finite = ~torch.isnan(adv_g).any(dim=1) & ~torch.isnan(r.view(-1, g)).any(dim=1) & ~near
    if finite.any():
        out[H01_ADV_GROUP_SUM_REL_MAX] = (adv_g.sum(dim=1).abs() / scale)[finite].max() / g
        # and signs only where the reward stands clear of its group mean: float32 rewards in
        # [0, ~2] round at ~1e-7, so a centred reward below _SIGN_MIN may flip sign between TRL's
        # float32 mean and this float64 one without any defect
        signed = (centred.abs() > _SIGN_MIN) & finite.unsqueeze(1) & (adv_g.abs() > 1e-9)
        wrong = signed & (torch.sign(adv_g) != torch.sign(centred))
        out[H01_ADV_SIGN_MISMATCH_SHARE] = wrong.double().sum() / signed.double().sum().clamp(min=1.0)
    if moved.any():
        f = factor[moved]
        # amplification = how many times std scaling multiplied the centred reward (1 = no scaling)
        out[H01_AMPLIFICATION_MAX] = f.max()
        out[H01_AMPLIFICATION_MEDIAN] = f.median()
        near_f = factor[near_tie.unsqueeze(1) & moved]
        out[H01_NEAR_TIE_AMPLIFICATION_MAX] = near_f.max() if near_f.numel() else torch.tensor(0.0)
    return {k: float(v) for k, v in out.items()}


@BATCH_INSTRUMENTS.register("h01 advantages")
def batch_advantages(b: Batch) -> dict[str, float]:
    return advantage_stats(b.rewards, b.advantages, b.num_generations, b.near_zero_std)
