"""The mutation benchmark's one door to the doctor, treated as a black box: a run directory's
metrics (all steps, or the steps up to k) in, the doctor's ranked findings (the ``diagnosis.json``
contract: hypothesis, check, flagged, stage, role, rank) out. When the doctor's package moves, the
imports in ``diagnose`` are the one place to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Where the doctor and its instruments live: the doctor's commit is the last commit touching these
# (the measured side: instruments/; the judging side: doctor/; the metric catalogue they share: base/).
DOCTOR_PATHS = ("musique_rl/doctor", "musique_rl/instruments", "musique_rl/base/catalogue.py")


def diagnose(run_dir: str | Path, last_step: int | None = None) -> list[dict[str, Any]]:
    """The doctor's diagnosis of ``run_dir``'s metrics.jsonl (and its config's params); with
    ``last_step``, of the rows logged at steps <= last_step only (what a live diagnosis saw then)."""
    from musique_rl.doctor.diagnose import diagnose_metrics
    from musique_rl.doctor.sources import read_run_dir

    run = read_run_dir(run_dir)
    histories = run.histories
    if last_step is not None:
        histories = {k: [(s, v) for s, v in h if s <= last_step] for k, h in histories.items()}
        histories = {k: h for k, h in histories.items() if h}
    return diagnose_metrics(histories, run.params).to_json()


def stage_names() -> tuple[str, ...]:
    """The doctor's stage names, in chain order (the stage map must use these)."""
    from musique_rl.doctor.step import STAGES

    return tuple(s.name for s in STAGES)
