"""What a job hands back to ``musique_rl.job.app.run``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobResult:
    """``summary``: the job's figures (its ``metrics.json``), printed by ``app.run`` as the last line of
    output, one JSON object; None in a process that does not report them (a data-parallel rank
    other than 0, or a launcher whose trainer processes report them themselves).
    ``objective``: the figure a Hydra sweeper optimises (train: ``train/reward_gain``; eval: the
    mean reward). ``diagnose``: the run dir's metrics.jsonl was written by this job in this process,
    so the doctor reads it here (the GPU topology's trainer process diagnoses its own)."""

    summary: dict[str, Any] | None
    objective: float | None
    diagnose: bool = False

    def line(self) -> str:
        """The summary as ONE line of JSON."""
        return json.dumps(self.summary, sort_keys=True)
