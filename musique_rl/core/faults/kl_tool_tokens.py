"""kl_tool_tokens: the KL penalty also covers tool-result and template tokens."""

from __future__ import annotations

from typing import Any

from musique_rl.core.faults import Fault


class KlToolTokens(Fault):
    name = "kl_tool_tokens"
    plants = "KL computed on tool tokens"
    acts = "trainer.py `_compute_loss`: beta x KL added on the environment tokens too"
    expected = "h03"
    fingerprint = "`h03/kl_env_tokens` > 0"
    overlay = {"loss": {"beta": 0.04}}  # a KL penalty to misplace

    def kl_mask(self, loss_mask: Any, completion_mask: Any) -> Any:
        return completion_mask.float()
