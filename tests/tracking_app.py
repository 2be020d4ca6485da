"""Stand-in job for the tracking tests: the real musique_rl/conf/ tree, launchers and MLflow tracking, no training.

It logs a few steps of instrument-shaped metrics into its MLflow run through `tracking.task_wrapper`
and into the run directory's metrics.jsonl, then runs the doctor as `app.run` does after training
(`app.diagnose`), and fails on request: TRACKING_APP_FAIL=<seed> raises in that job.
Run: python tests/tracking_app.py -m seed=1,2 hydra.sweep.dir=/tmp/x
"""

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from musique_rl import (
    schema,  # the configs' directory; importing it registers the schema and the ${arm:..} resolver
    tracking,
)

CONF = str(schema.CONF_DIR)


def task(cfg: DictConfig) -> float:
    tracker = tracking.active()
    assert tracker is not None, "task_wrapper must have started a run"
    seed = int(cfg.seed)
    from hydra.core.hydra_config import HydraConfig

    from musique_rl.app import diagnose

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for step in range(3):
            metrics = {"reward": 0.5 + 0.1 * step + 0.01 * seed, "h08/update_weight_ratio": 1e-3}
            tracker.log_metrics(metrics, step=step)
            fh.write(json.dumps({"step": step, **metrics}) + "\n")
    if os.environ.get("TRACKING_APP_FAIL") == str(seed):
        raise RuntimeError(f"planted failure in seed {seed}")
    diagnose(cfg, run_dir)
    return 0.7


@hydra.main(version_base="1.3", config_path=CONF, config_name="train")
def main(cfg: DictConfig) -> float | None:
    return tracking.task_wrapper(task)(cfg)


if __name__ == "__main__":
    main()
