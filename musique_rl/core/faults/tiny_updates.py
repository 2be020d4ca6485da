"""tiny_updates: updates too small to move the policy."""

from __future__ import annotations

from musique_rl.core.faults import Fault


class TinyUpdates(Fault):
    """Learning rate x0.01 and grad clip 0.001: updates too small to matter."""

    name = "tiny_updates"
    expected = "h08"
    fingerprint = "median `h08/update_weight_ratio` < 1e-4 (healthy ~1e-3), `h08/kl_to_start` ~0"
    overlay = {"loss": {"learning_rate": "${mul:0.01,${model.learning_rate}}", "max_grad_norm": 0.001}}
