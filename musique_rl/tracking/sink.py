"""The job's MLflow run: opened (or adopted) at the start, written through a guarded ``Tracker``,
closed FINISHED, FAILED (traceback attached) or KILLED.

``open_run(cfg, run_dir)`` yields the job's ``Tracker``, or None when tracking is off or this is not
data-parallel rank 0 (rank 0 logs for all). ``musique_rl.job.app.run`` opens it and passes it down.

- Params: the flattened resolved config; tags: ``provenance.run_tags``. Every param, tag and text
  artifact goes through ``musique_rl.tracking.redact`` first.
- In a multirun a job nests under the sweep's parent run, whose id the sweep's callback wrote into
  the sweep dir (``tracking.sweep.parent_run_id``), read from the job's own ``hydra.sweep.dir``.
- A requeued or resumed job (same run dir) continues the same run (``mlflow_run_id`` in the run dir),
  only when that run's ``config_hash`` tag is its own (musique_rl.tracking.provenance.config_hash).
- Tracking is a side service: an HTTP server that does not answer fails the job in seconds before
  compute (``store.probe``, naming ``tracking.enabled=false``); a failure once the job runs is said
  once and costs nothing (``Tracker``); what the store missed is sent from metrics.jsonl when it
  answers again at the close, or by ``python -m musique_rl.tracking --upload <run dir>``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from musique_rl.base import rundir
from musique_rl.tracking.provenance import config_params, resolved_container, run_tags
from musique_rl.tracking.redact import redact, redact_tree, redact_value
from musique_rl.tracking.store import (
    JOB_HTTP,
    PROBE_HTTP,
    RUN_ID_FILE,
    TAG_MAX,
    TrackingUnavailable,
    ensure_experiment,
    experiment_name,
    hint,
    metric_key,
    mlflow_settings,
    probe,
    sweep_dir,
    tracking_uri,
)
from musique_rl.tracking.sweep import parent_run_id
from musique_rl.tracking.upload import upload_run_dir

log = logging.getLogger(__name__)



class Tracker:
    """The MLflow run of one job, handed down by ``musique_rl.job.app.run`` (``open_run``).

    Tracking is a side service: its first failure (a server that went away, a full disk under the
    sqlite store) is logged once, and every later call of this job is skipped instead of spending
    MLflow's retries again; training goes on. Every metric is in the run dir's metrics.jsonl, and
    ``upload_run_dir`` sends what the run lacks (at the job's end when the store answers again, or
    ``python -m musique_rl.tracking --upload <run dir>``).
    """

    def __init__(self, run_id: str, experiment_id: str, uri: str):
        from mlflow.tracking import MlflowClient

        self.run_id, self.experiment_id, self.uri = run_id, experiment_id, uri
        self.client = MlflowClient(uri)
        self.failure: Exception | None = None  # the first tracking error of this job
        self.unsent_from: int | None = None  # the first step whose metrics did not reach the store

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.failure = exc
            log.warning(
                "MLflow tracking failed while %s (%s: %s); the job goes on without it. Every metric is in the run "
                "directory's metrics.jsonl; what the run lacks is sent at the end if %s answers again, or later with "
                "`python -m musique_rl.tracking --upload <run dir>`. To train without tracking: tracking.enabled=false",
                what, type(exc).__name__, redact(str(exc).splitlines()[0] if str(exc) else ""), redact(self.uri),
            )
            return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Numeric entries of `metrics` at `step` in one batch (None, bools and strings skipped)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key=metric_key(k), value=float(v), timestamp=now, step=int(step))
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and v is not None
        ]
        if self.failure is None:  # MLflow splits the batch into per-request chunks
            self._call(f"logging step {step}'s metrics", self.client.log_batch, self.run_id, metrics=batch)
        if self.failure is not None and self.unsent_from is None:
            self.unsent_from = int(step)

    def log_params(self, params: Mapping[str, str]) -> None:
        """Params in one batch. A resumed run already holds its params, and MLflow refuses a changed
        value: said, and the job goes on (not a tracking outage)."""
        from mlflow.entities import Param

        if self.failure is not None:
            return
        try:
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        except Exception:
            log.warning("params not (re)logged to run %s (resumed run?)", self.run_id, exc_info=True)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._call(f"logging {artifact_file}", self.client.log_text, self.run_id, redact(text), artifact_file)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self._call(f"logging {artifact_file}", self.client.log_dict, self.run_id, redact_tree(data), artifact_file)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call(f"logging {Path(path).name}", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def set_tag(self, key: str, value: Any) -> None:
        self._call(f"setting tag {key}", self.client.set_tag, self.run_id, key, redact_value(key, value)[:TAG_MAX])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.set_tag(key, value)

    def callback(self) -> Any:
        """A transformers TrainerCallback that logs every `logs` dict (TRL's metrics and ours) at its step.

        Use it INSTEAD of transformers' MLflowCallback (GRPOConfig(report_to="none")): that one
        logs TrainingArguments as params, which collide with the config's params.
        """
        from transformers import TrainerCallback

        tracker = self

        class MlflowMetricsCallback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and state.is_world_process_zero:
                    tracker.log_metrics(logs, step=state.global_step)

        return MlflowMetricsCallback()

    @property
    def url(self) -> str:
        """Where a person opens the run: the server's page for an HTTP store, else the store URI and run id."""
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"{self.uri} run {self.run_id}"


# ---------------------------------------------------------------- open / adopt / close
def _rank() -> int:
    """This process's global rank under torchrun / accelerate launch (0 when launched alone)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _fluent_uri_state() -> tuple[str | None, str | None]:
    from mlflow.tracking._tracking_service import utils

    return getattr(utils, "_tracking_uri", None), os.environ.get("MLFLOW_TRACKING_URI")


def _restore_fluent_uri(state: tuple[str | None, str | None]) -> None:
    """Undo the job's `mlflow.set_tracking_uri`. That call also writes $MLFLOW_TRACKING_URI, so a
    plain set_tracking_uri(previous) would pin the next job of this process to this job's store;
    mlflow has no public "unset", hence the private global."""
    from mlflow.tracking._tracking_service import utils

    utils._tracking_uri, env = state
    if env is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env


def _adoptable(prev: Any, exp_id: str, digest: str, id_file: Path) -> bool:
    """A requeued / resumed job continues its run only when that run is this job's: same experiment
    and the same config identity (musique_rl.tracking.provenance.config_hash), recorded on the run at creation."""
    if prev.info.experiment_id != exp_id:
        return False
    theirs = prev.data.tags.get("config_hash")
    if theirs == digest:
        return True
    log.warning(
        "%s names MLflow run %s, which %s; this job starts a new run instead of mixing two runs' metrics",
        id_file, prev.info.run_id,
        "records no config identity" if theirs is None else f"belongs to another config (hash {theirs}, this job {digest})",
    )
    return False


def _create_or_adopt(cfg: DictConfig, uri: str, id_file: Path | None) -> tuple[str, str]:
    """(run id, experiment id): this job's own run, adopted from ``id_file`` or created."""
    from mlflow.tracking import MlflowClient

    exp_id = ensure_experiment(uri, experiment_name(cfg))
    client = MlflowClient(uri)
    tags = run_tags(cfg)
    parent = parent_run_id(d) if (d := sweep_dir()) is not None else None
    if parent:
        tags["mlflow.parentRunId"] = parent
    run_id, prev_tags = None, {}
    if id_file is not None and id_file.exists():
        old = id_file.read_text().strip()
        prev = None
        with contextlib.suppress(Exception):
            prev = client.get_run(old)
        if prev is not None and _adoptable(prev, exp_id, tags["config_hash"], id_file):
            run_id, prev_tags = old, prev.data.tags  # a requeued / resumed job continues its run
    if run_id is None:
        run_id = client.create_run(exp_id, tags=tags, run_name=tags["mlflow.runName"]).info.run_id
        if id_file is not None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id)
    else:
        client.update_run(run_id, status="RUNNING")
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
        # A requeued job: what ended the previous attempt is history now, not this run's state.
        for stale in ("error", "interrupted"):
            if stale in prev_tags:
                client.delete_tag(run_id, stale)
        client.set_tag(run_id, "resumes", int(prev_tags.get("resumes", 0)) + 1)
    return run_id, exp_id


def _log_config(tracker: Tracker, cfg: DictConfig) -> None:
    """Params (flattened resolved config) and the resolved config as artifact, both redacted."""
    tracker.log_params(config_params(cfg))
    tracker.log_text(OmegaConf.to_yaml(redact_tree(resolved_container(cfg))), "config/resolved.yaml")


def enabled(cfg: DictConfig) -> bool:
    """Whether this process tracks the job: tracking on, and data-parallel rank 0 (it logs for all)."""
    return bool(OmegaConf.select(cfg, "tracking.enabled", default=True)) and _rank() == 0


@contextlib.contextmanager
def open_run(cfg: DictConfig, run_dir: Path | None) -> Iterator[Tracker | None]:
    """Start (or resume) this job's run; end it FINISHED, FAILED (traceback attached) or KILLED.

    ``run_dir``: the job's run directory (its ``mlflow_run_id`` lets a requeue continue the run;
    None: no resume). Yields None when tracking is off or this is not rank 0. The store is checked
    before any compute (an unreachable server fails here in seconds, naming
    ``tracking.enabled=false``); once the job runs, a tracking failure never ends it (``Tracker``),
    and an error of the closing calls is logged, never raised over the job's own outcome."""
    if not enabled(cfg):
        yield None
        return
    import mlflow

    uri = tracking_uri(cfg)
    id_file = Path(run_dir) / RUN_ID_FILE if run_dir is not None else None
    with mlflow_settings(JOB_HTTP):
        probe(uri)
        try:
            run_id, exp_id = _create_or_adopt(cfg, uri, id_file)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise TrackingUnavailable(
                f"MLflow store {redact(uri)} failed before the job started ({type(exc).__name__}: {redact(first)[:300]}); "
                f"{hint(uri)}") from None
        tracker = Tracker(run_id, exp_id, uri)
        prev_uri = _fluent_uri_state()
        status = "FINISHED"
        try:
            _log_config(tracker, cfg)
            log.info("MLflow run %s (experiment %s) in %s", run_id, exp_id, redact(uri))
            # the fluent API (mlflow.log_*) of code inside the job writes to this run too
            mlflow.set_tracking_uri(uri)
            tracker._call("starting the run", mlflow.start_run, run_id=run_id)
            yield tracker
        except (KeyboardInterrupt, SystemExit) as exc:
            # Ctrl-C, SIGTERM (musique_rl.job.launch), or submitit's exit after a preemption / timeout signal
            # (it requeues the job, which resumes into this run): stopped from outside, not failed.
            status = "KILLED"
            tracker.set_tag("interrupted", f"{type(exc).__name__}: {exc}"[:500])
            raise
        except BaseException as exc:
            status = "FAILED"
            tracker.log_text(traceback.format_exc(), "error/traceback.txt")
            tracker.set_tag("error", f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            _close(tracker, status, run_dir)
            _restore_fluent_uri(prev_uri)


def _close(tracker: Tracker, status: str, run_dir: Path | None) -> None:
    """End the run: what the store missed, then the status. Nothing here raises: the job's own
    outcome (its result or its first error) is what the user sees."""
    import mlflow

    try:
        if tracker.failure is not None and run_dir is not None:
            _catch_up(tracker, Path(run_dir))
    except Exception as exc:
        log.warning("MLflow run %s: closing steps failed (%s: %s)", tracker.run_id, type(exc).__name__, redact(str(exc))[:300])
    down = tracker.failure is not None  # then one quick try, no retries: the warning was given already
    try:
        with mlflow_settings(PROBE_HTTP, force=True) if down else contextlib.nullcontext():
            active_run = mlflow.active_run()
            if active_run is not None and active_run.info.run_id == tracker.run_id:
                mlflow.end_run(status=status)  # pops MLflow's active-run stack before it calls the store
            else:
                tracker.client.set_terminated(tracker.run_id, status)
        log.info("MLflow run %s ended %s: %s", tracker.run_id, status, redact(tracker.url))
    except Exception as exc:
        if not down:
            log.warning("MLflow run %s not closed (%s: %s)", tracker.run_id, type(exc).__name__, redact(str(exc))[:300])


def _catch_up(tracker: Tracker, run_dir: Path) -> None:
    """After a mid-job tracking failure: if the store answers again, send what it missed from
    metrics.jsonl; else say how to send it later."""
    try:
        with mlflow_settings(PROBE_HTTP, force=True):
            probe(tracker.uri)
            tracker.client.get_run(tracker.run_id)
    except Exception:
        log.warning("MLflow %s still unavailable: run `python -m musique_rl.tracking --upload %s` once it is back "
                    "(metrics.jsonl holds every step)", redact(tracker.uri), run_dir)
        return
    sent = upload_run_dir(run_dir, uri=tracker.uri, run_id=tracker.run_id)
    tracker.failure = None  # the store is back: the closing calls go through again
    log.info("MLflow %s answers again: sent %d step(s) from %s", redact(tracker.uri), sent, run_dir / rundir.METRICS_LOG)

