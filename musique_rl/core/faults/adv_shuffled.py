"""adv_shuffled: the loss's advantages moved one row against its completions."""

from __future__ import annotations

from musique_rl.base.catalogue import H01_LOSS_ADV_MISALIGNED_SHARE
from musique_rl.core.faults import Fault


class AdvShuffled(Fault):
    """Advantages misaligned with completions in the loss's inputs (rolled by one row).

    A reorder (shuffle, split, sort by length) applied to the completions but not to their
    advantages, after the advantages were formed: every instrument reading the scored batch sees
    correct, well-grouped advantages; the loss pairs each completion with its neighbour's."""

    name = "adv_shuffled"
    expected = "h01"
    fingerprint = f"`{H01_LOSS_ADV_MISALIGNED_SHARE}` > 0 (advantage read from the loss's gradient vs the rewards of the episode with the same token ids)"

    def loss_inputs(self, inputs: dict) -> dict:
        return {**inputs, "advantages": inputs["advantages"].roll(1, dims=0)}
