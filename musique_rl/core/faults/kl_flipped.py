"""kl_flipped: the KL penalty with the wrong sign."""

from __future__ import annotations

from musique_rl.base.catalogue import H03_KL_NEGATIVE_SHARE
from musique_rl.core.faults import Fault


class KlFlipped(Fault):
    """KL penalty with the wrong sign: TRL's beta x KL term negated.

    A sign slip between the KL estimator and the loss: the penalty pushes the policy away from the
    reference instead of holding it near (docs/failure_modes.md defect 10)."""

    name = "kl_flipped"
    expected = "h03"
    fingerprint = f"`{H03_KL_NEGATIVE_SHARE}` > 0.5 (`kl_penalty` passed with its applied sign)"
    overlay = {"loss": {"beta": 0.04}}  # a KL penalty to flip

    def kl_beta(self, beta: float) -> float:
        return -beta
