"""std_epsilon: a tiny std epsilon turns near-tied groups' noise into full-size advantages."""

from __future__ import annotations

from typing import Any

from musique_rl.base.catalogue import H01_AMPLIFICATION_MAX
from musique_rl.core.faults import Fault

# Float-level noise on each reward (a non-deterministic reward: float32 reductions in varying order,
# a reward model). TRL's epsilon 1e-4 keeps it at |advantage| ~0.01 in a tied group; the planted
# epsilon 1e-8 turns it into full-size advantages: the defect std_epsilon stands for. Without the
# noise the fault would be inert here: the rewards of tied episodes are bit-identical, and
# (r - mean) / (std + eps) is exactly 0 whatever eps is.
REWARD_JITTER = 1e-6


class StdEpsilon(Fault):
    """Tiny std epsilon amplifies near-ties: rewards with 1e-6 noise, divided by the group std + 1e-8.

    A binary reward (answer EM: most groups tie), scaled per group, with an epsilon far below TRL's:
    tied groups get full-size advantages made of noise, where TRL's 1e-4 keeps them ~0.01."""

    name = "std_epsilon"
    expected = "h01"
    fingerprint = f"`{H01_AMPLIFICATION_MAX}` > 1e4 (only an epsilon below TRL's 1e-4 meeting a float-noise std can do it)"
    defaults = [{"override /reward": "answer_em"}]
    overlay = {"loss": {"scale_rewards": "group", "adv_epsilon": 1.0e-8}}

    def rewards(self, rewards: Any, step: int) -> Any:
        import torch  # here: composing a config stays fast

        gen = torch.Generator().manual_seed(step)  # CPU: the same noise on any device
        noise = torch.randn(rewards.shape, generator=gen, dtype=torch.float64)
        return (rewards.double() + REWARD_JITTER * noise.to(rewards.device)).to(rewards.dtype)
