"""Send a run directory's metrics to MLflow: after a tracking outage (what the store missed), or for
a run made with ``tracking.enabled=false``. ``python -m musique_rl.tracking --upload <run dir>``."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from musique_rl.base import rundir
from musique_rl.tracking.provenance import config_params
from musique_rl.tracking.store import (
    DEFAULT_EXPERIMENT,
    RUN_ID_FILE,
    ensure_experiment,
    experiment_name,
    metric_key,
    tracking_uri,
)


def upload_run_dir(run_dir: str | Path, uri: str | None = None, run_id: str | None = None,
                   experiment: str | None = None) -> int:
    """Send the metrics of ``run_dir/metrics.jsonl`` (and ``metrics.json``'s summary) that its MLflow
    run lacks; returns the number of steps sent. The run is ``run_id``, else the run dir's
    ``mlflow_run_id``, else a new run in ``experiment`` (its params from ``.hydra/config.yaml``)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    run_dir = Path(run_dir)
    config_file = run_dir / rundir.CONFIG
    cfg = OmegaConf.load(config_file) if config_file.exists() else None
    # the run's saved config has its URI redacted: a password comes from --uri or the environment
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or tracking_uri(cfg, base_dir=Path.cwd())
    client = MlflowClient(uri)
    id_file = run_dir / RUN_ID_FILE
    run_id = run_id or (id_file.read_text().strip() if id_file.exists() else None)
    if run_id is None:
        name = experiment or (experiment_name(cfg) if cfg is not None else DEFAULT_EXPERIMENT)
        exp_id = ensure_experiment(uri, name)
        run_id = client.create_run(exp_id, run_name=run_dir.name, tags={"output_dir": str(run_dir.resolve())}).info.run_id
        if cfg is not None:
            from mlflow.entities import Param

            with contextlib.suppress(Exception):
                client.log_batch(run_id, params=[Param(k, v) for k, v in config_params(cfg).items()])
        id_file.write_text(run_id)
    have = client.get_run(run_id).data.metrics
    # the last step the store holds, per key: only later steps are sent (a resent step would be a duplicate point)
    last = {k: max((m.step for m in client.get_metric_history(run_id, k)), default=-1) for k in have}
    now = int(time.time() * 1000)
    batch, steps = [], set()
    for row in rundir.read_metrics_log(run_dir / rundir.METRICS_LOG):
        step = int(row.get("step", 0))
        for k, v in row.items():
            key = metric_key(k)
            if k != "step" and isinstance(v, int | float) and step > last.get(key, -1):
                batch.append(Metric(key=key, value=float(v), timestamp=now, step=step))
                steps.add(step)
    data = rundir.read_summary(run_dir)
    if data is not None:
        final = max(steps | {max(last.values(), default=0)})
        for k, v in data.items():
            key = metric_key(k)
            if isinstance(v, int | float) and not isinstance(v, bool) and key not in have:
                batch.append(Metric(key=key, value=float(v), timestamp=now, step=final))
    if batch:
        client.log_batch(run_id, metrics=batch)
    run = client.get_run(run_id)
    if run.info.status == "RUNNING" and data is not None:  # the job finished while the store was away
        client.set_terminated(run_id, "FINISHED")
    client.set_tag(run_id, "uploaded_from", str(run_dir.resolve()))
    return len(steps)
