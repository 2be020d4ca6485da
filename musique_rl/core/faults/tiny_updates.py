"""tiny_updates: updates too small to move the policy."""

from __future__ import annotations

from musique_rl.base.catalogue import H08_KL_TO_START, H08_UPDATE_WEIGHT_RATIO
from musique_rl.core.faults import Fault


class TinyUpdates(Fault):
    """Learning rate x0.01 and grad clip 0.001: updates too small to matter."""

    name = "tiny_updates"
    expected = "h08"
    fingerprint = f"median `{H08_UPDATE_WEIGHT_RATIO}` < 1e-4 (healthy ~1e-3), `{H08_KL_TO_START}` ~0"
    overlay = {"loss": {"learning_rate": "${mul:0.01,${model.learning_rate}}", "max_grad_norm": 0.001}}
