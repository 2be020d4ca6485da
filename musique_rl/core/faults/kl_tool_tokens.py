"""kl_tool_tokens: the KL penalty also covers tool-result and template tokens."""

from __future__ import annotations

from typing import Any

from musique_rl.base.catalogue import H03_KL_ENV_TOKENS
from musique_rl.core.faults import Fault


class KlToolTokens(Fault):
    """KL computed on tool tokens: beta x KL added on the environment tokens too.

    The KL mask taken from the completion instead of the loss mask: tool results, which the policy
    never sampled, are penalised for their (meaningless) log-ratio (docs/failure_modes.md defect 3)."""

    name = "kl_tool_tokens"
    expected = "h03"
    fingerprint = f"`{H03_KL_ENV_TOKENS}` > 0"
    overlay = {"loss": {"beta": 0.04}}  # a KL penalty to misplace

    def kl_mask(self, loss_mask: Any, completion_mask: Any) -> Any:
        return completion_mask.float()
