"""env_tokens_trained: tool-result and template tokens carry loss."""

from __future__ import annotations

from musique_rl.base.catalogue import H02_ENV_TOKENS_WITH_LOSS
from musique_rl.core.faults import Fault


class EnvTokensTrained(Fault):
    """Tool/template tokens carry loss (their env_mask is 1).

    The overlay is the real knob of hypothesis h02 (`train.mask_env_tokens=false`); the hook makes
    `fault=env_tokens_trained` set alone (a case config) train them too."""

    name = "env_tokens_trained"
    expected = "h02"
    fingerprint = f"`{H02_ENV_TOKENS_WITH_LOSS}` > 0 (needs true `token_sources`, independent of env_mask)"
    overlay = {"train": {"mask_env_tokens": False}}

    def env_mask_value(self, value: int) -> int:
        return 1
