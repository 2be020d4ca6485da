"""stale_sampler: the sampler's weights are never synced with the trained ones."""

from __future__ import annotations

from typing import Any

from musique_rl.base.catalogue import H06_PARITY_STALE
from musique_rl.core.faults import Fault


class StaleSampler(Fault):
    """Sampler weights never synced: it samples from a frozen copy of the initial model.

    A weight sync that never happens (TRL #6688, ms-swift #9855, verl #3821): every batch is
    off-policy by all the updates made so far."""

    name = "stale_sampler"
    expected = "h06"
    fingerprint = f"parity probe `{H06_PARITY_STALE}` = 1; gap ~0 at step 0, growing"

    def sampler_model(self, model: Any) -> Any:
        from musique_rl.core.generation import frozen_copy

        return frozen_copy(model)
