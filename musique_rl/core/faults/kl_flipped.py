"""kl_flipped: the KL penalty with the wrong sign."""

from __future__ import annotations

from musique_rl.core.faults import Fault


class KlFlipped(Fault):
    name = "kl_flipped"
    plants = "KL penalty with the wrong sign"
    acts = "trainer.py `_compute_loss`: TRL's beta x KL term negated (rewards drifting from the reference)"
    expected = "h03"
    fingerprint = "`h03/kl_negative_share` > 0.5 (`kl_penalty` passed with its applied sign)"
    overlay = {"loss": {"beta": 0.04}}  # a KL penalty to flip

    def kl_beta(self, beta: float) -> float:
        return -beta
