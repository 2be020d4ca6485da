"""stale_sampler: the sampler's weights are never synced with the trained ones."""

from __future__ import annotations

from typing import Any

from musique_rl.core.faults import Fault


class StaleSampler(Fault):
    name = "stale_sampler"
    plants = "sampler weights never synced"
    acts = "trainer.py `build_trainer`: the generator samples from a frozen copy of the initial model"
    expected = "h06"
    fingerprint = "parity probe `h06/parity_stale` = 1; gap ~0 at step 0, growing"

    def sampler_model(self, model: Any) -> Any:
        from musique_rl.core.generation import frozen_copy

        return frozen_copy(model)
