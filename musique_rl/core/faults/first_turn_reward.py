"""first_turn_reward: the training reward parses the FIRST assistant turn."""

from __future__ import annotations

from musique_rl.base.catalogue import H05_COMPONENT_MEAN
from musique_rl.core.faults import Fault


class FirstTurnReward(Fault):
    """Reward parsed from the first assistant turn (training only).

    The held-out evaluation always scores the last turn (train.py), so the run's own evaluation
    still sees what the policy answers."""

    name = "first_turn_reward"
    expected = "h05"
    fingerprint = (f"answers present, yet `{H05_COMPONENT_MEAN.of(component='answer_em')}` and "
                   f"`{H05_COMPONENT_MEAN.of(component='answer_f1')}` ~0 and constant in >= 95% of groups")

    def reward_read_turn(self, turn: str) -> str:
        return "first"
