"""blind_context: the trainer scores every token blind to the context (verifiers 0.1.x)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from musique_rl.base.catalogue import H06_LOGP_GAP_MEAN
from musique_rl.core.config import JobConfig
from musique_rl.core.faults import Fault

if TYPE_CHECKING:  # torch is imported where a mask is built: composing a config stays fast
    import torch


def blind_attention(attention_mask: torch.Tensor, width: int, tool_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The forward pass's attention mask made the loss mask: the prompt and the tool results are
    invisible when the assistant tokens are scored.

    ``attention_mask``: (N, P + C) prompt then completion (``width`` = C); ``tool_mask``: (N, C), 0 on
    environment tokens.
    """
    import torch

    completion = attention_mask[:, -width:]
    if tool_mask is not None:
        completion = completion * tool_mask.to(completion.device, completion.dtype)  # the mask's device wins
    return torch.cat([torch.zeros_like(attention_mask[:, :-width]), completion], dim=1)


class BlindContext(Fault):
    """Forward-pass attention mask = loss mask (verifiers 0.1.x), in multi-turn environments only.

    Every scoring pass of the trainer (loss, old and reference log-probs) is blind. The defect lived
    in the multi-turn code path: the original researcher's single-turn GSM8K runs, through the same trainer, kept
    their true mask and learned (docs/failure_modes.md 1). So a single-turn environment (env=arith,
    h07's documents in the prompt) trains as if the fault were off."""

    name = "blind_context"
    expected = "h02"
    fingerprint = f"`{H06_LOGP_GAP_MEAN}` at the first step > 0.01 nats/token (trainer scores without context)"

    def __init__(self, cfg: JobConfig):
        from musique_rl.env.prompts import tool_schemas

        self.multi_turn = bool(tool_schemas(cfg.env))

    def attention_mask(self, attention_mask: Any, width: int, tool_mask: Any) -> Any:
        return blind_attention(attention_mask, width, tool_mask) if self.multi_turn else attention_mask
