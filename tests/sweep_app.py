"""Stand-in job for launcher tests: the real conf/ tree and launchers, a task that takes seconds.

It writes what a training job writes for the verdict (metrics.json with the hypothesis' metric)
and misbehaves on request, so failure isolation and requeue/resume can be tested without
training: SWEEP_APP_FAIL=<arm>:<seed> raises, SWEEP_APP_KILL=<arm>:<seed> SIGKILLs itself,
SWEEP_APP_STEPS=N with SWEEP_APP_STEP_S=seconds runs N resumable steps (progress.json in the job
dir: a requeued job continues from it, like train.resume=auto).
Jobs run through the job pipe as real jobs do (musique_rl.job.app.run; tracking.enabled=false skips MLflow).
Run: PYTHONPATH=. python tests/sweep_app.py -m +sweep=h02 seed=1,2 hydra.sweep.dir=/tmp/x
"""

import json
import os
import signal
import socket
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from musique_rl import schema  # the configs' directory, the typed schema and ${arm:..}
from musique_rl.job.app import run
from musique_rl.job.result import JobResult

CONF = str(schema.CONF_DIR)

# Effect the stand-in "treatment" has on the metric, per hypothesis direction (> min_effect 0.02).
EFFECT = 0.10


@hydra.main(version_base="1.3", config_path=CONF, config_name="train")
def main(cfg: DictConfig) -> float | None:
    # the real job pipe: one MLflow run per job, FAILED with traceback, resumed on requeue
    return run(cfg, job)


def job(cfg: DictConfig, tracker, out: Path) -> JobResult:
    arm, seed = str(cfg.hypothesis.arm.value if hasattr(cfg.hypothesis.arm, "value") else cfg.hypothesis.arm), int(cfg.seed)
    me = f"{arm}:{seed}"
    progress_path = out / "progress.json"
    progress = json.loads(progress_path.read_text()) if progress_path.exists() else {"step": 0, "starts": 0}
    progress["starts"] += 1
    progress.setdefault("slurm_job_ids", []).append(os.environ.get("SLURM_JOB_ID"))
    progress_path.write_text(json.dumps(progress))
    started = time.time()
    if os.environ.get("SWEEP_APP_FAIL") == me:
        raise RuntimeError(f"planted failure in {me}")
    if os.environ.get("SWEEP_APP_KILL") == me:
        os.kill(os.getpid(), signal.SIGKILL)
    resumed_from = progress["step"]
    for step in range(progress["step"], int(os.environ.get("SWEEP_APP_STEPS", "0"))):
        time.sleep(float(os.environ.get("SWEEP_APP_STEP_S", "1")))
        progress["step"] = step + 1
        progress_path.write_text(json.dumps(progress))  # the job's own checkpoint
    sign = 1.0 if str(getattr(cfg.hypothesis.direction, "value", cfg.hypothesis.direction)) == "increase" else -1.0
    value = 0.30 + 0.01 * seed + (sign * EFFECT if arm == "treatment" else 0.0)
    metrics = {
        cfg.hypothesis.metric: value,
        "job/started": started,
        "job/ended": time.time(),
        "job/omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "job/resumed_from_step": resumed_from,
        "job/starts": progress["starts"],
        "job/host": socket.gethostname(),
        # what the job got from the launching process's environment: the sweep passes it nothing
        "job/musique_rl_env": sorted(k for k in os.environ if k.startswith("MUSIQUE_RL_")),
    }
    # a reward curve as a training job logs it (metrics.jsonl): rising to the job's value
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "reward": value * k / 3}) + "\n" for k in (1, 2, 3)))
    (out / "metrics.json").write_text(json.dumps(metrics))
    if tracker is not None:
        tracker.log_metrics(metrics, step=progress["step"])
    return JobResult(None, value)  # no result line, no doctor: the stand-in's output stays the launcher's


if __name__ == "__main__":
    main()
