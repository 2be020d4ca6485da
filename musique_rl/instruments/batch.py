"""One generation batch as the instruments read it, and the registry of per-batch instruments.

A per-batch instrument is a pure function ``(Batch) -> {"hNN/<metric>": float}`` registered where
it is written (``@BATCH_INSTRUMENTS.register("<name>")`` in its module); ``Instruments.observe_batch``
calls every registered one, so a new instrument needs no other wiring (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from musique_rl.base.registry import Registry
from musique_rl.env.episode import EpisodeSummary

BATCH_INSTRUMENTS = Registry("diagnostics batch instrument")


@dataclass
class Batch:
    """CPU tensors of one generation batch: N completions = groups x G, groups contiguous
    (``Instruments.observe_batch`` documents each field)."""

    num_generations: int
    near_zero_std: float
    rewards: torch.Tensor
    advantages: torch.Tensor
    prompt_mask: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    token_sources: torch.Tensor | None = None
    episodes: Sequence[EpisodeSummary] = ()
    reward_components: Mapping[str, Sequence[float] | torch.Tensor] | None = None
    reward_errors: int = 0
    sampling_logps: torch.Tensor | None = None
    trainer_logps: torch.Tensor | None = None
    max_prompt_tokens: int | None = None
    max_completion_tokens: int | None = None


def batch_instruments() -> list[Any]:
    """Every registered per-batch instrument. The package's modules are imported first (once), so
    defining a registered function in any of them is all a new instrument takes."""
    import importlib
    import pkgutil
    from pathlib import Path

    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{module.name}")
    return BATCH_INSTRUMENTS.values()
