"""What a verdict judges: the hypothesis, one ``Run`` per job, and the ``Sweep`` that holds them.

``load`` builds these from job directories or MLflow; ``judge`` reads them; nothing here does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from musique_rl.schema import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]
# The repository's status file: the verdict of each hypothesis' latest named sweep (README links it).
# It exists in a source checkout only: an installed package has none, and writes none.
STATUS = ROOT / "docs" / "STATUS.md"
HYPOTHESIS_DIR = CONF_DIR / "hypothesis"
ARMS = ("control", "treatment")
UNKNOWN = "unknown"  # a run that does not record its warm start or machine (older code)


class VerdictError(ValueError):
    """Input the verdict cannot judge (no runs, no hypothesis, unknown sweep): said plainly."""


@dataclass(frozen=True)
class Hypothesis:
    id: str
    title: str
    priority: str
    metric: str
    direction: str  # increase | decrease
    min_effect: float
    min_steps: int = 0  # the shortest run (optimizer steps) the hypothesis can be judged on (conf/hypothesis/<id>.yaml)

    @classmethod
    def from_mapping(cls, h: Any, where: str) -> Hypothesis:
        missing = [k for k in ("id", "metric", "direction") if h.get(k) in (None, "???")]
        if missing:
            raise VerdictError(f"{where}: hypothesis block lacks {', '.join(missing)}")
        direction = str(h["direction"])
        if direction not in ("increase", "decrease"):
            raise VerdictError(f"{where}: hypothesis.direction={direction!r}, expected increase|decrease")
        return cls(
            id=str(h["id"]),
            title=str(h.get("title") or ""),
            priority=str(h.get("priority") or "medium"),
            metric=str(h["metric"]),
            direction=direction,
            min_effect=float(h.get("min_effect") or 0.0),
            min_steps=int(h.get("min_steps") or 0),
        )


@dataclass
class Run:
    """One job of the sweep: its arm, seed, state, (if it finished) the metric's value, and what
    the value depends on besides the config: code, warm start, machine."""

    arm: str
    seed: int
    status: str  # FINISHED | FAILED | KILLED | RUNNING | SCHEDULED (MLflow) or FINISHED | FAILED (files)
    value: float | None
    source: str  # MLflow run id or job directory
    reason: str = ""  # why there is no value
    params: dict[str, str] | None = None  # the flattened resolved config (None: unknown)
    code: str | None = None  # git commit the job ran, "+dirty" with uncommitted changes (None: unknown)
    warm_start: str = UNKNOWN  # 12 hex chars of the warm start's sha256; "none" for hub models
    machine: str = UNKNOWN  # "<cpu> | <threads> threads | <device>", as the MLflow tag `machine`
    job_dir: str | None = None  # the job's output dir (its name is its row in the sweep's jobs.json)

    @property
    def usable(self) -> bool:
        return self.status == "FINISHED" and self.value is not None and math.isfinite(self.value)

    @property
    def cell(self) -> str:
        return f"{self.arm}/seed {self.seed}"


@dataclass
class Sweep:
    hypothesis: Hypothesis
    runs: list[Run]
    seeds: list[int]  # the grid the sweep asked for (so a job that never started is named too)
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    source: dict[str, Any] = field(default_factory=dict)  # kind, sweep_dir, sweep_id, parent_run_id, ...
