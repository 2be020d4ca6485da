"""turn_end_dropped: the loss's mask leaves each assistant turn's last sampled token out."""

from __future__ import annotations

from musique_rl.base.catalogue import H02_LOSS_ASSISTANT_LEFT_OUT_SHARE
from musique_rl.core.faults import Fault


class TurnEndDropped(Fault):
    """The last sampled token of every assistant turn left out of the loss (its loss-input mask 0).

    A loss mask rebuilt by a rule that counts a turn's end-of-turn id as chat-template scaffolding
    (the pad == eos class): the policy is never trained to end a turn. It acts on the loss's inputs
    only, so the rollout's env_mask and every batch instrument reading it stay clean; the rollout's
    token sources still call those ids the policy's own, so the loss's gradient shows them missing."""

    name = "turn_end_dropped"
    expected = "h02"
    fingerprint = (f"`{H02_LOSS_ASSISTANT_LEFT_OUT_SHARE}` > 0.01 (sampled tokens of rows with signal that the "
                   "loss's gradient does not reach, vs the rollout's token sources)")

    def loss_inputs(self, inputs: dict) -> dict:
        import torch  # here, not at import: composing a config loads every fault and must not load torch

        completion = inputs["completion_mask"]
        tool = inputs.get("tool_mask")
        trained = completion if tool is None else completion * tool
        # the last token of each run of trained tokens: trained here, not trained at the next position
        after = torch.cat([trained[:, 1:], torch.zeros_like(trained[:, :1])], dim=1)
        turn_end = (trained > 0) & (after == 0)
        kept = (tool if tool is not None else torch.ones_like(completion)).masked_fill(turn_end, 0)
        return {**inputs, "tool_mask": kept}
