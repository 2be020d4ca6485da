"""The MLflow store a job writes to: where it is, the experiment, whether it answers, what it accepts.

- Store: ``tracking.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<launch dir>/mlflow.db``
  with artifacts beside it in ``mlartifacts/`` (``make ui`` serves it on 127.0.0.1).
- Experiment: ``tracking.experiment``, else the hypothesis id (``h01`` ...), else ``musique_rl``.
- A store that does not answer fails a job in seconds before compute (``probe``), naming
  ``tracking.enabled=false``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from musique_rl.tracking.redact import redact

DEFAULT_EXPERIMENT = "musique_rl"
RUN_ID_FILE = "mlflow_run_id"  # in a job's run dir: a requeued or resumed job continues the same run
PARAM_MAX = 6000  # MLflow's limit on a param value (characters)
TAG_MAX = 5000

# MLflow's HTTP client retries a failing request 7 times with exponential backoff and waits 120 s
# for each answer: a dead server then costs minutes per call. A job's calls get a short budget
# (a user's own MLFLOW_HTTP_REQUEST_* settings win), the start's reachability probe a shorter one.
JOB_HTTP = MappingProxyType({
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    # MLflow prints "View run <url>" with the URI as typed (a password included): the job logs a redacted one
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"})
PROBE_HTTP = MappingProxyType({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"})


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be used at a job's start: said before any compute, with the way out."""


def hydra_config() -> Any | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def launch_dir() -> Path:
    """Where the user launched from (Hydra may have changed cwd when hydra.job.chdir=true)."""
    hc = hydra_config()
    return Path(hc.runtime.cwd) if hc is not None else Path.cwd()


def sweep_dir() -> Path | None:
    """The multirun's sweep directory, None outside a multirun."""
    from hydra.types import RunMode

    hc = hydra_config()
    if hc is None or hc.mode != RunMode.MULTIRUN:
        return None
    return Path(hc.sweep.dir).resolve()


def tracking_uri(cfg: DictConfig | None = None, base_dir: Path | None = None) -> str:
    """`tracking.tracking_uri`, else `$MLFLOW_TRACKING_URI`, else an absolute sqlite file in the launch dir."""
    uri = None
    if cfg is not None:
        with contextlib.suppress(Exception):
            uri = OmegaConf.select(cfg, "tracking.tracking_uri")
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return str(uri)
    # absolute, so jobs started elsewhere (submitit, SLURM) write to the same file
    return f"sqlite:///{(base_dir or launch_dir()).resolve() / 'mlflow.db'}"


def experiment_name(cfg: DictConfig) -> str:
    name = OmegaConf.select(cfg, "tracking.experiment", default=None)
    if name:
        return str(name)
    hyp = OmegaConf.select(cfg, "hypothesis.id", default=None)
    return str(hyp) if hyp else DEFAULT_EXPERIMENT


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """An inter-process lock beside a sqlite store: MLflow's schema creation is not safe to race."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def ensure_experiment(uri: str, name: str) -> str:
    """Create the store (sqlite schema) and the experiment if missing; return the experiment id."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with _store_lock(uri):
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        db = _sqlite_path(uri)
        # artifacts next to the sqlite file, so `make ui` finds them wherever it is started
        location = (db.parent / "mlartifacts" / name).resolve().as_uri() if db is not None else None
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created meanwhile by a process that does not share our lock
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id


def metric_key(key: str) -> str:
    """``key`` as an MLflow metric name (alphanumerics, _ - . space : / allowed)."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in str(key))


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set these environment variables for the block (processes started in it inherit them), then
    restore each to what it was before, unset included."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mlflow_settings(values: Mapping[str, str], force: bool = False) -> contextlib.AbstractContextManager[None]:
    """MLflow reads these environment variables at each request (it has no other way to set
    them); set the ones the user did not set (all of them with ``force``) for the block, then restore."""
    return scoped_environ(values if force else {k: v for k, v in values.items() if k not in os.environ})


def hint(uri: str) -> str:
    return (f"fix tracking.tracking_uri / $MLFLOW_TRACKING_URI ({redact(uri)}), start the server, or run without "
            "tracking: tracking.enabled=false (metrics.jsonl keeps every metric; `python -m musique_rl.tracking "
            "--upload <run dir>` sends them later)")


def probe(uri: str) -> None:
    """Raise TrackingUnavailable within seconds when an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return  # a local store: opening it (ensure_experiment) is the check
    from mlflow.tracking import MlflowClient

    t0 = time.time()
    try:
        with mlflow_settings(PROBE_HTTP, force=True):
            MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TrackingUnavailable(
            f"MLflow tracking server {redact(uri)} did not answer in {time.time() - t0:.1f} s "
            f"({type(exc).__name__}: {redact(first)[:300]}); {hint(uri)}"
        ) from None
