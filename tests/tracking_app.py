"""Stand-in job for the tracking tests: the real conf/ tree, launchers, job pipe
(``app.run``) and MLflow tracking, no training.

Its work logs a few steps of instrument-shaped metrics through the tracker ``app.run`` hands it and
into the run directory's metrics.jsonl; the pipe then runs the doctor and closes the run as for a
training job. It fails on request: TRACKING_APP_FAIL=<seed> raises in that job.
Run: python tests/tracking_app.py -m seed=1,2 hydra.sweep.dir=/tmp/x
"""

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from musique_rl import (
    schema,  # the configs' directory; importing it registers the schema and the ${arm:..} resolver
)
from musique_rl.job.app import run
from musique_rl.job.result import JobResult

CONF = str(schema.CONF_DIR)


def work(cfg: DictConfig, tracker, run_dir: Path) -> JobResult:
    assert (tracker is not None) == bool(cfg.tracking.enabled), "app.run opens the run when tracking is on"
    seed = int(cfg.seed)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for step in range(3):
            metrics = {"reward": 0.5 + 0.1 * step + 0.01 * seed, "h08/update_weight_ratio": 1e-3}
            if tracker is not None:
                tracker.log_metrics(metrics, step=step)
            fh.write(json.dumps({"step": step, **metrics}) + "\n")
    if os.environ.get("TRACKING_APP_FAIL") == str(seed):
        raise RuntimeError(f"planted failure in seed {seed}")
    return JobResult({"stand_in/reward": 0.7, "seed": seed}, 0.7, diagnose=True)


@hydra.main(version_base="1.3", config_path=CONF, config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run(cfg, work)


if __name__ == "__main__":
    main()
