"""The sweep's Hydra callback: prepares the MLflow store once and holds a multirun's parent run.

Registered in musique_rl/conf/train.yaml under ``hydra.callbacks.mlflow``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from musique_rl.redact import redact, redact_value
from musique_rl.tracking.provenance import SWEEP_ENV, git_commit, sweep_id_of
from musique_rl.tracking.sink import PARENT_ENV, PARENT_ID_FILE
from musique_rl.tracking.store import (
    DEFAULT_EXPERIMENT,
    ensure_experiment,
    experiment_name,
    probe,
    tracking_uri,
)
from musique_rl.tracking.store import JOB_HTTP as _JOB_HTTP
from musique_rl.tracking.store import PROBE_HTTP as _PROBE_HTTP
from musique_rl.tracking.store import TAG_MAX as _TAG_MAX
from musique_rl.tracking.store import mlflow_settings as _mlflow_settings

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the sweep's parent run
try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a hard dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepCallback(_HydraCallback):
    """Hydra callback: prepare the MLflow store once, and hold a multirun's parent run.

    Registered in musique_rl/conf/train.yaml under `hydra.callbacks.mlflow`. Runs in the launching process:
    `on_multirun_start` fires before any job is launched, so the sqlite schema and the experiment
    exist before parallel jobs (local processes, SLURM array tasks) touch the store.
    """

    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.uri: str | None = None

    @staticmethod
    def _enabled(config: DictConfig) -> bool:
        return bool(OmegaConf.select(config, "tracking.enabled", default=True))

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._enabled(config):
            # the job reports store errors itself, in seconds (tracking.probe): no MLflow retries here
            with contextlib.suppress(Exception), _mlflow_settings(_PROBE_HTTP, force=True):
                uri = tracking_uri(config, Path.cwd())
                probe(uri)
                ensure_experiment(uri, _safe_experiment_name(config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from musique_rl.redact import redact_logs

        redact_logs()  # the launching process's log lines (the sweep's overrides, MLflow's errors)
        if not self._enabled(config):
            return
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(config, Path.cwd())
        probe(self.uri)  # an unreachable server fails the sweep here, in seconds, before any job starts
        exp_id = ensure_experiment(self.uri, _safe_experiment_name(config))
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        sweep = sweep_id_of(sweep_dir)
        sha, dirty = git_commit()
        overrides = " ".join(config.hydra.overrides.task)
        hyp = OmegaConf.select(config, "hypothesis.id", default=None, throw_on_resolution_failure=False)
        tags = {
            "sweep_id": sweep,
            "sweep_parent": "true",
            "hypothesis": str(hyp) if hyp else "none",
            "overrides": overrides,
            "git_commit": sha,
            "git_dirty": str(dirty).lower(),
            "sweep_dir": str(sweep_dir),
            "mlflow.runName": f"sweep {sweep}",
        }
        tags = {k: redact_value(k, v)[:_TAG_MAX] for k, v in tags.items()}
        client = MlflowClient(self.uri)
        earlier = sweep_dir / PARENT_ID_FILE
        if OmegaConf.select(config, "sweep.resume", default=None) and earlier.exists():
            # a resumed sweep finishes under its own parent run: the kept jobs' runs are its children
            self.parent_run_id = earlier.read_text().strip()
            client.update_run(self.parent_run_id, status="RUNNING")
            client.set_tag(self.parent_run_id, "resumes", int(client.get_run(self.parent_run_id).data.tags.get("resumes", 0)) + 1)
        else:
            self.parent_run_id = client.create_run(exp_id, tags=tags, run_name=tags["mlflow.runName"]).info.run_id
        os.environ[PARENT_ENV] = self.parent_run_id
        os.environ[SWEEP_ENV] = sweep
        # jobs started without our environment (e.g. a requeued SLURM task) read it from the sweep dir
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_ID_FILE).write_text(self.parent_run_id)
        (sweep_dir / "sweep_id").write_text(sweep)  # musique_rl.verdict finds the sweep's runs by it
        # Hydra skips on_multirun_end when the sweep itself raised (Ctrl-C, a launcher error): close the parent at exit then
        atexit.register(self._close_parent)
        log.info("MLflow parent run %s for sweep %s", self.parent_run_id, sweep)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Last of the multirun's callbacks (Hydra calls end hooks in reverse order: after the
        verdict): the job table, the parent run's outcome, and a non-zero exit when a job failed."""
        from musique_rl import sweep_jobs
        from musique_rl.redact import redact_files

        redact_files([Path(str(config.hydra.sweep.dir)) / "multirun.yaml"])  # saved as typed by Hydra's launcher
        rows = sweep_jobs.read(Path(str(config.hydra.sweep.dir)))
        if rows:
            print("\n" + sweep_jobs.table(rows), flush=True)
        failed = sum(r.failed for r in rows)
        self._close_parent(len(rows), failed)
        if failed:
            log.error("%d of %d jobs failed (table above; tracebacks in their job dirs)", failed, len(rows))
            raise SystemExit(1)

    def _close_parent(self, jobs: int = 0, failed: int = 0) -> None:
        """Tags `jobs` and `failed_jobs` on the parent run; FAILED when any job failed or was killed."""
        if self.parent_run_id is None or self.uri is None:
            return
        parent_run_id, self.parent_run_id = self.parent_run_id, None  # once, by the hook or at exit
        try:
            with _mlflow_settings(_JOB_HTTP):  # MLflow's "View run" line would print the URI as typed
                self._close_run(parent_run_id, jobs, failed)
        except Exception as exc:  # the jobs are done and recorded in jobs.json: the store's failure is only said
            log.warning("MLflow parent run %s not closed (%s: %s)", parent_run_id, type(exc).__name__, redact(str(exc))[:300])
        os.environ.pop(PARENT_ENV, None)
        os.environ.pop(SWEEP_ENV, None)

    def _close_run(self, parent_run_id: str, jobs: int, failed: int) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        children = client.search_runs(
            experiment_ids=[e.experiment_id for e in client.search_experiments()],
            filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
        )
        for r in children:  # every job has returned: a run still RUNNING belongs to a killed process
            if r.info.status == "RUNNING":
                client.set_terminated(r.info.run_id, "KILLED")
        failed = max(failed, sum(r.info.status in ("FAILED", "KILLED", "RUNNING") for r in children))
        client.set_tag(parent_run_id, "jobs", str(max(jobs, len(children))))
        client.set_tag(parent_run_id, "failed_jobs", str(failed))
        client.set_terminated(parent_run_id, "FAILED" if failed else "FINISHED")


def _safe_experiment_name(config: DictConfig) -> str:
    try:
        return experiment_name(config)
    except Exception:  # an interpolation that only resolves per job
        return DEFAULT_EXPERIMENT
