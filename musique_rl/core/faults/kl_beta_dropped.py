"""kl_beta_dropped: the configured KL coefficient never reaches the loss."""

from __future__ import annotations

from musique_rl.base.catalogue import H03_KL_TERM_ZERO_WITH_BETA
from musique_rl.core.faults import Fault


class KlBetaDropped(Fault):
    """KL penalty configured (beta 0.04) but not applied: the loss gets beta 0.

    beta not forwarded between the config and the loss (docs/failure_modes.md defect 10): the
    reference log-probs are computed and the KL is logged, but no penalty term acts."""

    name = "kl_beta_dropped"
    expected = "h03"
    fingerprint = f"`{H03_KL_TERM_ZERO_WITH_BETA}` = 1 (no gradient reaches the reference log-probs once the policy moved)"
    overlay = {"loss": {"beta": 0.04}}

    def kl_beta(self, beta: float) -> float:
        return 0.0
