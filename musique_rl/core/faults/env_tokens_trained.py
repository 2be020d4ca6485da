"""env_tokens_trained: tool-result and template tokens carry loss."""

from __future__ import annotations

from musique_rl.core.faults import Fault


class EnvTokensTrained(Fault):
    name = "env_tokens_trained"
    plants = "tool/template tokens carry loss"
    acts = "rollout.py env_mask (also the real knob of hypothesis h02: `train.mask_env_tokens=false`)"
    expected = "h02"
    fingerprint = "`h02/env_tokens_with_loss` > 0 (needs true `token_sources`, independent of env_mask)"
    overlay = {"train": {"mask_env_tokens": False}}

    def env_mask_value(self, value: int) -> int:
        return 1  # so `fault=env_tokens_trained` alone (without the overlay) trains them too
