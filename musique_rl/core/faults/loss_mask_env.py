"""loss_mask_env: the loss path drops the env mask, so tool and template tokens train."""

from __future__ import annotations

from musique_rl.base.catalogue import H02_LOSS_TOOL_TOKEN_SHARE
from musique_rl.core.faults import Fault


class LossMaskEnv(Fault):
    """Tool/template tokens trained in the loss only (its tool_mask replaced by ones).

    The rollout masks the environment's tokens and every batch instrument (the h02 token ledger)
    reads that mask as it leaves the rollout; the loss then takes another mask (a collator that
    rebuilds it from the completion, a key renamed on the way), so the tool results train."""

    name = "loss_mask_env"
    expected = "h02"
    fingerprint = f"`{H02_LOSS_TOOL_TOKEN_SHARE}` > 0 (tokens the loss's gradient reaches vs the rollout's token sources)"

    def loss_inputs(self, inputs: dict) -> dict:
        if inputs.get("tool_mask") is None:
            return inputs
        return {**inputs, "tool_mask": inputs["tool_mask"].new_ones(inputs["tool_mask"].shape)}
