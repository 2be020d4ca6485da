"""The ``diagnostics`` config group (what the instruments read; schema.py composes it into the
job's config). Here, not in schema.py, so the diagnostics' functions can name their type without
importing the experiment layer (tests/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from musique_rl.base.config_base import ReadOnly, at_least
from musique_rl.core.config import JobConfig


@dataclass
class DiagnosticsConfig(ReadOnly):
    enabled: bool = True
    near_zero_std: float = 0.05  # a group whose reward std is below this carries ~no signal
    parity_probe_every: int = 10  # steps between sampler/trainer/base parity probes
    reward_audit_size: int = 4  # episodes a step re-scored by the independent reward audit (h05/reward_audit_*)
    trajectory_views: int = 4  # episodes rendered to the HTML token view per logged step

    RULES: ClassVar = {"near_zero_std": at_least(0), "parity_probe_every": at_least(1),
                       "reward_audit_size": at_least(0), "trajectory_views": at_least(0)}


class InstrumentedJobConfig(JobConfig, Protocol):
    """What the instruments read of a job's config (schema.Config is one)."""

    diagnostics: DiagnosticsConfig
