"""What a training job prints per step: one line a person can read; every metric goes to a file.

TRL's progress callback writes the whole logs dict at every logging step (~4,000 characters with
our instruments), between the progress bar's updates. ``StepLog`` takes its place: it keeps the
bar and writes one line per logging step (step, reward, reward trend, KL, seconds per step, and
the instruments out of bounds right now, by name), while every metric goes to ``metrics.jsonl``
in the run directory (written and read by ``musique_rl.base.rundir`` only) and to MLflow through the
tracking callback. ``train.console=full`` restores TRL's dict on the console.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ProgressCallback

from musique_rl.base import rundir
from musique_rl.base.catalogue import H06_LOGP_GAP_FLOOR, HYPOTHESIS
from musique_rl.doctor.bounds import out_of_bounds

log = logging.getLogger(__name__)

TREND_WINDOW = 5  # logged steps averaged at each end for the reward trend


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


class StepLog(ProgressCallback):
    """A transformers ProgressCallback whose ``on_log`` writes one line (``full``: TRL's dict) and
    appends every numeric metric of the step to ``metrics_path`` as one JSON object per line."""

    def __init__(self, metrics_path: str | Path | None, full: bool = False, warmup_steps: int = 0):
        super().__init__()
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.full = full
        self.warmup_steps = int(warmup_steps)
        self.rewards: list[float] = []
        self._last: tuple[float, int] | None = None  # (time, step) of the previous log
        self.gap_floor: float | None = None  # the run's h06/logp_gap_floor, once logged

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._last = (time.time(), int(state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        step = int(state.global_step)
        numbers = {k: n for k, v in logs.items() if (n := _num(v)) is not None}
        if self.metrics_path is not None:
            try:
                rundir.append_metrics_row(self.metrics_path, step, numbers)
            except OSError as exc:
                from musique_rl.core.checkpoints import disk_full_error, is_disk_full

                if not is_disk_full(exc, self.metrics_path):
                    raise
                raise disk_full_error(exc, self.metrics_path, f"appending step {step} to {self.metrics_path.name}",
                                      "Free space and run the same command again: it resumes from the last "
                                      "checkpoint (train.resume=auto); a torn last line is dropped then.") from exc
        if self.full:
            return super().on_log(args, state, control, logs=logs, **kwargs)
        self._write(self.line(step, int(state.max_steps), numbers))

    def line(self, step: int, max_steps: int, logs: dict[str, float]) -> str:
        """``step 12/60 | reward 0.512 trend +0.041 | kl 0.0012 | 2.31 s/step | out of bounds: ...``"""
        if "reward" not in logs:  # the trainer's closing log (train_runtime, train_loss, ...)
            return "done: " + ", ".join(f"{k} {v:.4g}" for k, v in logs.items())
        now = time.time()
        parts = [f"step {step}/{max_steps}"]
        self.rewards.append(logs["reward"])
        n = min(TREND_WINDOW, len(self.rewards) // 2)
        trend = (sum(self.rewards[-n:]) - sum(self.rewards[:n])) / n if n else math.nan
        parts.append(f"reward {logs['reward']:.3f} trend {trend:+.3f}" if n else f"reward {logs['reward']:.3f}")
        if "kl" in logs:
            parts.append(f"kl {logs['kl']:.2g}")
        if self._last is not None and step > self._last[1]:
            parts.append(f"{(now - self._last[0]) / (step - self._last[1]):.2f} s/step")
        self._last = (now, step)
        if H06_LOGP_GAP_FLOOR in logs:  # re-measured at every parity probe: the run's latest floor
            self.gap_floor = logs[H06_LOGP_GAP_FLOOR]
        bad = out_of_bounds(logs, skip=(HYPOTHESIS["h08"].prefix,) if step <= self.warmup_steps else (),
                            floor=self.gap_floor)
        parts.append("out of bounds: " + ", ".join(bad) if bad else "instruments in bounds")
        return " | ".join(parts)

    def _write(self, text: str) -> None:
        if self.training_bar is not None:
            self.training_bar.write(text)
        else:
            print(text, flush=True)
