"""A sweep's parent MLflow run: opened before fan-out, found by its jobs, closed at the sweep's end.

The sweep's Hydra callback (musique_rl/sweep/callback.py) calls ``open_parent_run`` before any job
starts: it creates the store and the experiment ONCE (parallel jobs racing to create a fresh
sqlite file fail) and a parent run, whose id it writes to ``<sweep dir>/mlflow_parent_run_id``.
That file is the one channel from the sweep to its jobs: each job reads it from its own
``hydra.sweep.dir`` (``parent_run_id``), on whichever node it runs, and nests under it;
``close_run`` ends the parent.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from musique_rl.tracking.redact import redact_value
from musique_rl.tracking.store import (
    JOB_HTTP,
    RUN_ID_FILE,
    TAG_MAX,
    ensure_experiment,
    mlflow_settings,
    probe,
)

PARENT_ID_FILE = "mlflow_parent_run_id"  # in a sweep dir: the parent run its jobs nest under


def parent_run_id(sweep_dir: str | Path) -> str | None:
    """The MLflow parent run of the sweep in ``sweep_dir`` (None: no tracked sweep there). Jobs on
    other nodes read it too: the sweep dir is shared with them, their own dirs are inside it."""
    path = Path(sweep_dir) / PARENT_ID_FILE
    return (path.read_text().strip() or None) if path.exists() else None


def open_parent_run(uri: str, experiment: str, sweep_dir: str | Path, tags: Mapping[str, Any],
                    resume: bool = False) -> str:
    """Create a sweep's parent run before fan-out (or, with ``resume``, reopen the one ``sweep_dir``
    names: a resumed sweep's kept jobs are its children) and write its id into ``sweep_dir``.

    Creating the store and the experiment here, once, keeps parallel jobs from racing to create a
    fresh sqlite file; an HTTP server that does not answer fails the sweep in seconds (``probe``)."""
    from mlflow.tracking import MlflowClient

    probe(uri)
    exp_id = ensure_experiment(uri, experiment)
    client = MlflowClient(uri)
    run_id = parent_run_id(sweep_dir) if resume else None
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "resumes", int(client.get_run(run_id).data.tags.get("resumes", 0)) + 1)
    else:
        tags = {k: redact_value(k, v)[:TAG_MAX] for k, v in tags.items()}
        run_id = client.create_run(exp_id, tags=tags, run_name=tags.get("mlflow.runName")).info.run_id
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    (Path(sweep_dir) / PARENT_ID_FILE).write_text(run_id)
    return run_id


def close_run(uri: str, run_id: str, status: str, tags: Mapping[str, Any] | None = None,
              only_if_running: bool = False) -> None:
    """Tag a run and end it ``status`` (FINISHED | FAILED | KILLED). ``only_if_running``: leave a run
    that already ended as it is (a job's own run, closed by its process unless that was killed)."""
    from mlflow.tracking import MlflowClient

    with mlflow_settings(JOB_HTTP):  # MLflow's "View run" line would print the URI as typed
        client = MlflowClient(uri)
        if only_if_running and client.get_run(run_id).info.status != "RUNNING":
            return
        for k, v in (tags or {}).items():
            client.set_tag(run_id, k, redact_value(k, v)[:TAG_MAX])
        client.set_terminated(run_id, status)


def job_run_id(job_dir: str | Path) -> str | None:
    """The MLflow run of the job whose output dir is ``job_dir`` (None: not tracked)."""
    path = Path(job_dir) / RUN_ID_FILE
    return (path.read_text().strip() or None) if path.exists() else None
