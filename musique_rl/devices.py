"""Where a job's model lives, and the rule for every tensor handed to it.

The rule (issue 11): whoever hands a model a tensor moves it to that model's device
(``diagnostics.sync.model_device``), and whoever reads a statistic back copies it to the CPU
explicitly (``.cpu()`` before ``float``/``tolist``). Rollouts (generation.HFGenerator), the parity
probe (diagnostics.sync.model_scorer), the instruments (diagnostics.instruments: CPU copies of
what they read) and the planted faults (trainer.py) follow it; ``python -m musique_rl.smoke``
runs every fault and hypothesis arm on the GPU to keep it so.
"""

from __future__ import annotations

from typing import Any


def place(model: Any) -> Any:
    """``model`` on this process's device (accelerate's: ``cuda:<local rank>`` on a GPU machine, the
    CPU elsewhere), before anything samples from it; the trainer would move it there anyway, but
    the held-out evaluation before training and ``mode=eval`` run first. A model dispatched over
    several devices by ``device_map`` (``hf_device_map``) stays where it is."""
    from musique_rl.models import process_state

    if getattr(model, "hf_device_map", None):
        return model
    return model.to(process_state().device)
