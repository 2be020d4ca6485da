"""MLflow tracking: one run per Hydra job, a parent run per multirun, nothing secret ever logged.

- Store: `tracking.tracking_uri`, else `$MLFLOW_TRACKING_URI`, else `sqlite:///<launch dir>/mlflow.db`
  with artifacts beside it in `mlartifacts/` (`make ui` serves it on 127.0.0.1).
- Experiment: `tracking.experiment`, else the hypothesis id (`h01` ...), else `musique_rl`.
- Params: the flattened resolved config. Tags: hypothesis, arm, seed, fault, git commit, the
  override string, sweep id, and Hydra's group choices (model, loss, reward, env, lora).
  Every param, tag and text artifact goes through `musique_rl.redact` first.
- Multirun: the sweep's callback (musique_rl/sweep/callback.py) calls `open_parent_run` before fan-out:
  it creates the store and the experiment ONCE (parallel jobs racing to create a fresh sqlite file
  fail) and a parent run, whose id it writes to `<sweep dir>/mlflow_parent_run_id`. That file is
  the one channel from the sweep to its jobs: each job reads it from its own `hydra.sweep.dir`
  (`parent_run_id`), on whichever node it runs, and nests under it; `close_run` ends the parent.
- `task_wrapper(task)`: runs a job inside its MLflow run; a failing job ends its run FAILED with
  the traceback as artifact `error/traceback.txt`, and in a multirun returns None instead of
  taking the sweep down (the pattern of lightning-hydra-template's `task_wrapper`). A requeued or
  resumed job (same output dir) continues the same run (`mlflow_run_id` file in the job dir), only
  when that run's `config_hash` tag is its own (musique_rl.launch.config_hash).
- Tracking is a side service: an HTTP server that does not answer fails the job in seconds before
  compute (`probe`, naming `tracking.enabled=false`); a failure once the job runs is said once and
  costs nothing (`Tracker`); what the store missed is sent from metrics.jsonl when it answers again,
  or by `python -m musique_rl.tracking --upload <run dir>`.
- At the end of a train run: reward-curve plots (the doctor's `diagnosis.json` is logged by the job pipe).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from musique_rl.redact import redact, redact_tree, redact_value

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id"  # in a job's output dir: resume into the same run
PARENT_ID_FILE = "mlflow_parent_run_id"  # in a sweep dir: the parent run its jobs nest under (open_parent_run)
DEFAULT_EXPERIMENT = "musique_rl"
_PARAM_MAX = 6000  # MLflow's limit on a param value (characters)
_TAG_MAX = 5000


# ---------------------------------------------------------------- store and experiment
def _hydra() -> Any | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _launch_dir() -> Path:
    """Where the user launched from (Hydra may have changed cwd when hydra.job.chdir=true)."""
    hc = _hydra()
    return Path(hc.runtime.cwd) if hc is not None else Path.cwd()


def tracking_uri(cfg: Any | None = None, base_dir: Path | None = None) -> str:
    """`tracking.tracking_uri`, else `$MLFLOW_TRACKING_URI`, else an absolute sqlite file in the launch dir."""
    uri = None
    if cfg is not None:
        with contextlib.suppress(Exception):
            uri = OmegaConf.select(cfg, "tracking.tracking_uri")
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return str(uri)
    # absolute, so jobs started elsewhere (submitit, SLURM) write to the same file
    return f"sqlite:///{(base_dir or _launch_dir()).resolve() / 'mlflow.db'}"


def experiment_name(cfg: Any) -> str:
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


# ---------------------------------------------------------------- params and tags
def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}, 'c': [1, 2]} -> {'a.b': 1, 'c': '[1, 2]'} (lists stay one param)."""
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, Mapping) and v:
                out.update(flatten(v, key))
            else:
                out[key] = v
    else:
        out[prefix] = tree
    return out


def resolved_container(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, interpolations resolved, enums as strings, `hydra` node dropped."""
    data = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=False)
    data.pop("hydra", None)
    return data


def config_params(cfg: DictConfig) -> dict[str, str]:
    """Flattened resolved config as MLflow params, redacted and cut to MLflow's length limit."""
    params = {}
    for k, v in flatten(resolved_container(cfg)).items():
        params[k] = redact_value(k, "None" if v is None else v)[:_PARAM_MAX]
    return params


# What a job runs: a change here makes the checkout "dirty". Docs are left out: a sweep's verdict
# rewrites docs/STATUS.md, which must not mark the next sweep's runs as unrecoverable code.
CODE_PATHS = ("musique_rl", "hydra_plugins", "launchers", "pyproject.toml")  # configs live in musique_rl/conf


def git_commit(repo: Path | None = None) -> tuple[str, bool]:
    """(commit sha, dirty) of the package's checkout (dirty: uncommitted changes to ``CODE_PATHS``);
    ('unknown', False) outside git."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
            cwd=repo, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return sha, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def _sweep_dir() -> Path | None:
    from hydra.types import RunMode

    hc = _hydra()
    if hc is None or hc.mode != RunMode.MULTIRUN:
        return None
    return Path(hc.sweep.dir).resolve()


def sweep_id_of(sweep_dir: Path | str) -> str:
    """A sweep's id: its directory relative to multirun/ ('2026-05-01/10-00-00'), else the full path."""
    p = Path(sweep_dir)
    parts = p.parts
    return "/".join(parts[parts.index("multirun") + 1 :]) if "multirun" in parts[:-1] else str(p)


def run_tags(cfg: DictConfig) -> dict[str, str]:
    """Tags every job run carries (redacted)."""
    hyp = OmegaConf.select(cfg, "hypothesis.id", default=None)
    arm = OmegaConf.select(cfg, "hypothesis.arm", default=None)
    fault = OmegaConf.select(cfg, "fault", default="none")
    seed = OmegaConf.select(cfg, "seed", default=None)
    sha, dirty = git_commit()
    tags = {
        "hypothesis": str(hyp) if hyp else "none",
        "arm": str(arm) if hyp else "none",
        "seed": str(seed),
        "fault": str(fault),
        "mode": str(cfg.get("mode")),
        "git_commit": sha,
        "git_dirty": str(dirty).lower(),
        "mlflow.source.git.commit": sha,
    }
    hc = _hydra()
    if hc is not None:
        tags["overrides"] = " ".join(hc.overrides.task)
        tags["output_dir"] = str(hc.runtime.output_dir)
        for group, choice in hc.runtime.choices.items():
            if not group.startswith("hydra") and group != "schema" and choice is not None:
                tags[f"choice.{group}"] = str(choice)
    else:
        tags["overrides"] = ""
    if (d := _sweep_dir()) is not None:
        tags["sweep_id"] = sweep_id_of(d)  # as the parent's (open_parent_run's caller): both from hydra.sweep.dir
    tags["mlflow.runName"] = run_name(cfg)
    return {k: redact_value(k, v)[:_TAG_MAX] for k, v in tags.items()}


def tag_provenance(tracker: Tracker, origin: dict[str, Any]) -> None:
    """Tag what a run's figures depend on besides code and config (``warm_start.provenance``): every
    ``warm_start/*`` and ``machine/*`` value, plus ``warm_start_hash`` and one ``machine`` string that
    the verdict compares across the runs of a sweep."""
    from musique_rl.core.warm_start import machine_string

    for k, v in origin.items():
        tracker.set_tag(k, v)
    tracker.set_tag("warm_start_hash", origin.get("warm_start/hash", "none"))
    tracker.set_tag("machine", machine_string(*(origin.get(f"machine/{k}") for k in ("cpu", "torch_threads", "device"))))


def run_name(cfg: DictConfig) -> str:
    hyp = OmegaConf.select(cfg, "hypothesis.id", default=None)
    fault = str(cfg.get("fault") or "none")
    seed = OmegaConf.select(cfg, "seed", default="?")
    parts = []
    if hyp:
        arm = OmegaConf.select(cfg, "hypothesis.arm")
        parts += [str(hyp), str(arm)]
    if fault != "none":
        parts.append(f"fault-{fault}")
    if not parts:
        parts.append(str(cfg.get("mode") or "train"))
    parts.append(f"s{seed}")
    return "-".join(parts)


# ---------------------------------------------------------------- the job's run
class Tracker:
    """The MLflow run of one job. Obtain it inside a job with `tracking.active()`.

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
            Metric(key=_metric_key(k), value=float(v), timestamp=now, step=int(step))
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and v is not None
        ]
        if self.failure is None:  # MLflow splits the batch into per-request chunks
            self._call(f"logging step {step}'s metrics", self.client.log_batch, self.run_id, metrics=batch)
        if self.failure is not None and self.unsent_from is None:
            self.unsent_from = int(step)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._call(f"logging {artifact_file}", self.client.log_text, self.run_id, redact(text), artifact_file)

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self._call(f"logging {artifact_file}", self.client.log_dict, self.run_id, redact_tree(data), artifact_file)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call(f"logging {Path(path).name}", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def set_tag(self, key: str, value: Any) -> None:
        self._call(f"setting tag {key}", self.client.set_tag, self.run_id, key, redact_value(key, value)[:_TAG_MAX])

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


def _metric_key(key: str) -> str:
    # MLflow allows alphanumerics, _ - . space : / in metric names
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in str(key))


_ACTIVE: list[Tracker] = []


def _rank() -> int:
    """This process's global rank under torchrun / accelerate launch (0 when launched alone)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def active() -> Tracker | None:
    """The tracker of the job running in this process, or None when tracking is off."""
    return _ACTIVE[-1] if _ACTIVE else None


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


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be used at a job's start: said before any compute, with the way out."""


# MLflow's HTTP client retries a failing request 7 times with exponential backoff and waits 120 s
# for each answer: a dead server then costs minutes per call. A job's calls get a short budget
# (a user's own MLFLOW_HTTP_REQUEST_* settings win), the start's reachability probe a shorter one.
_JOB_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
             # MLflow prints "View run <url>" with the URI as typed (a password included): the job logs a redacted one
             "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
_PROBE_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


@contextlib.contextmanager
def _mlflow_settings(values: Mapping[str, str], force: bool = False) -> Iterator[None]:
    """MLflow reads these environment variables at each request; set the ones the user did not set
    (all of them with ``force``) for the block, then restore."""
    before = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if force or before[k] is None:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _hint(uri: str) -> str:
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
        with _mlflow_settings(_PROBE_HTTP, force=True):
            MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TrackingUnavailable(
            f"MLflow tracking server {redact(uri)} did not answer in {time.time() - t0:.1f} s "
            f"({type(exc).__name__}: {redact(first)[:300]}); {_hint(uri)}"
        ) from None


def _adoptable(prev: Any, exp_id: str, digest: str, id_file: Path) -> bool:
    """A requeued / resumed job continues its run only when that run is this job's: same experiment
    and the same config identity (musique_rl.launch.config_hash), recorded on the run at creation."""
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


def _open_run(cfg: DictConfig, uri: str, id_file: Path | None) -> tuple[str, str]:
    """(run id, experiment id): this job's own run, adopted from ``id_file`` or created."""
    import mlflow

    from musique_rl.launch import config_hash

    exp_id = ensure_experiment(uri, experiment_name(cfg))
    client = mlflow.tracking.MlflowClient(uri)
    tags = run_tags(cfg)
    tags["config_hash"] = config_hash(cfg)
    parent = parent_run_id(d) if (d := _sweep_dir()) is not None else None
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


@contextlib.contextmanager
def job(cfg: DictConfig, output_dir: Path | None = None) -> Iterator[Tracker | None]:
    """Start (or resume) this job's run; end it FINISHED, FAILED (traceback attached) or KILLED.

    The store is checked before any compute (an unreachable server fails here in seconds, naming
    ``tracking.enabled=false``); once the job runs, a tracking failure never ends it (``Tracker``),
    and an error of the closing calls is logged, never raised over the job's own outcome."""
    if not OmegaConf.select(cfg, "tracking.enabled", default=True) or _rank() != 0:
        yield None  # tracking off, or a non-zero data-parallel rank: rank 0 logs for all
        return
    import mlflow

    uri = tracking_uri(cfg)
    hc = _hydra()
    out = output_dir or (Path(hc.runtime.output_dir) if hc is not None else None)
    id_file = out / RUN_ID_FILE if out is not None else None
    with _mlflow_settings(_JOB_HTTP):
        probe(uri)
        try:
            run_id, exp_id = _open_run(cfg, uri, id_file)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise TrackingUnavailable(
                f"MLflow store {redact(uri)} failed before the job started ({type(exc).__name__}: {redact(first)[:300]}); "
                f"{_hint(uri)}") from None
        tracker = Tracker(run_id, exp_id, uri)
        prev_uri = _fluent_uri_state()
        status = "FINISHED"
        _ACTIVE.append(tracker)
        try:
            _log_config(tracker, cfg)
            log.info("MLflow run %s (experiment %s) in %s", run_id, exp_id, redact(uri))
            # the fluent API (mlflow.log_*) of code inside the job writes to this run too
            mlflow.set_tracking_uri(uri)
            tracker._call("starting the run", mlflow.start_run, run_id=run_id)
            yield tracker
        except (KeyboardInterrupt, SystemExit) as exc:
            # Ctrl-C, SIGTERM (musique_rl.launch), or submitit's exit after a preemption / timeout signal
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
            _ACTIVE.pop()
            _close(tracker, cfg, status, out)
            _restore_fluent_uri(prev_uri)


def _close(tracker: Tracker, cfg: DictConfig, status: str, out: Path | None) -> None:
    """End the run: what the store missed, plots and doctor, the status. Nothing here raises: the
    job's own outcome (its result or its first error) is what the user sees."""
    import mlflow

    try:
        if tracker.failure is not None and out is not None:
            _catch_up(tracker, out)
        if tracker.failure is None and status == "FINISHED" and str(cfg.get("mode")) == "train":
            finish_train_run(tracker, out)
    except Exception as exc:
        log.warning("MLflow run %s: closing steps failed (%s: %s)", tracker.run_id, type(exc).__name__, redact(str(exc))[:300])
    down = tracker.failure is not None  # then one quick try, no retries: the warning was given already
    try:
        with _mlflow_settings(_PROBE_HTTP, force=True) if down else contextlib.nullcontext():
            active_run = mlflow.active_run()
            if active_run is not None and active_run.info.run_id == tracker.run_id:
                mlflow.end_run(status=status)  # pops MLflow's active-run stack before it calls the store
            else:
                tracker.client.set_terminated(tracker.run_id, status)
        log.info("MLflow run %s ended %s: %s", tracker.run_id, status, redact(run_url(tracker)))
    except Exception as exc:
        if not down:
            log.warning("MLflow run %s not closed (%s: %s)", tracker.run_id, type(exc).__name__, redact(str(exc))[:300])


def run_url(tracker: Tracker) -> str:
    """Where a person opens the run: the server's page for an HTTP store, else the store URI and run id."""
    if tracker.uri.startswith(("http://", "https://")):
        return f"{tracker.uri.rstrip('/')}/#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}"
    return f"{tracker.uri} run {tracker.run_id}"


def _catch_up(tracker: Tracker, out: Path) -> None:
    """After a mid-job tracking failure: if the store answers again, send what it missed from
    metrics.jsonl; else say how to send it later."""
    try:
        with _mlflow_settings(_PROBE_HTTP, force=True):
            probe(tracker.uri)
            tracker.client.get_run(tracker.run_id)
    except Exception:
        log.warning("MLflow %s still unavailable: run `python -m musique_rl.tracking --upload %s` once it is back "
                    "(metrics.jsonl holds every step)", redact(tracker.uri), out)
        return
    sent = upload_run_dir(out, uri=tracker.uri, run_id=tracker.run_id)
    tracker.failure = None  # the store is back: the closing calls go through again
    log.info("MLflow %s answers again: sent %d step(s) from %s", redact(tracker.uri), sent, out / "metrics.jsonl")


def upload_run_dir(run_dir: str | Path, uri: str | None = None, run_id: str | None = None,
                   experiment: str | None = None) -> int:
    """Send the metrics of ``run_dir/metrics.jsonl`` (and ``metrics.json``'s summary) that its MLflow
    run lacks; returns the number of steps sent. The run is ``run_id``, else the run dir's
    ``mlflow_run_id``, else a new run in ``experiment`` (its params from ``.hydra/config.yaml``)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from musique_rl.console import read_metrics

    run_dir = Path(run_dir)
    config_file = run_dir / ".hydra" / "config.yaml"
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
    for row in read_metrics(run_dir / "metrics.jsonl"):
        step = int(row.get("step", 0))
        for k, v in row.items():
            key = _metric_key(k)
            if k != "step" and isinstance(v, int | float) and step > last.get(key, -1):
                batch.append(Metric(key=key, value=float(v), timestamp=now, step=step))
                steps.add(step)
    summary = run_dir / "metrics.json"
    if summary.exists():
        data = json.loads(summary.read_text())
        final = max(steps | {max(last.values(), default=0)})
        for k, v in data.items():
            key = _metric_key(k)
            if isinstance(v, int | float) and not isinstance(v, bool) and key not in have:
                batch.append(Metric(key=key, value=float(v), timestamp=now, step=final))
    if batch:
        client.log_batch(run_id, metrics=batch)
    run = client.get_run(run_id)
    if run.info.status == "RUNNING" and summary.exists():  # the job finished while the store was away
        client.set_terminated(run_id, "FINISHED")
    client.set_tag(run_id, "uploaded_from", str(run_dir.resolve()))
    return len(steps)


def _log_config(tracker: Tracker, cfg: DictConfig) -> None:
    """Params (flattened resolved config) and the resolved config as artifact, both redacted."""
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in config_params(cfg).items()]
    try:
        tracker.client.log_batch(tracker.run_id, params=items)  # MLflow splits it into per-request chunks
    except Exception:
        # a resumed run already holds its params; a changed value is refused by MLflow: say so, go on
        log.warning("params not (re)logged to run %s (resumed run?)", tracker.run_id, exc_info=True)
    tracker.log_text(OmegaConf.to_yaml(redact_tree(resolved_container(cfg))), "config/resolved.yaml")


def finish_train_run(tracker: Tracker, out_dir: Path | None = None) -> None:
    """Reward-curve plots, an artifact of the run; may not fail the run. (The doctor's diagnosis
    is written by the job pipe after training, from the run's metrics.jsonl: musique_rl.app.)"""
    try:
        plot_reward_curves(tracker)
    except Exception:
        log.exception("reward-curve plot failed")


def task_wrapper(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Run `task(cfg)` inside the job's MLflow run (FAILED with the traceback when it raises). The
    exception goes on: in a multirun the launcher records the job as FAILED and the other jobs
    go on (hydra_plugins/musique_rl_launchers); the multirun then exits non-zero."""

    @functools.wraps(task)
    def wrapped(cfg: DictConfig) -> Any:
        try:
            with job(cfg):
                return task(cfg)
        except Exception:
            if _sweep_dir() is not None:
                log.exception("job failed; its MLflow run is FAILED with the traceback, the sweep goes on")
            raise

    return wrapped


# ---------------------------------------------------------------- plots
_CURVES = ("reward", "reward_std", "frac_reward_zero_std")


def plot_reward_curves(tracker: Tracker) -> str | None:
    """`plots/reward_curves.png`: total reward, each reward component, group-signal shares, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(tracker.client.get_run(tracker.run_id).data.metrics)
    # each reward component's batch mean (instruments h05), else TRL's per-reward-function means
    comp = sorted(k for k in keys if k.startswith("h05/") and k.endswith("/mean")) or sorted(
        k for k in keys if k.startswith("rewards/") and k.endswith("/mean"))
    panels = [
        ("total reward", [k for k in ("reward",) if k in keys]),
        ("reward components (batch mean)", comp),
        ("group signal", [k for k in ("frac_reward_zero_std", "h01/near_zero_std_share") if k in keys]),
    ]
    panels = [(t, ks) for t, ks in panels if ks]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3 * len(panels)), squeeze=False)
    for ax, (title, ks) in zip(axes[:, 0], panels, strict=True):
        for k in ks:
            hist = sorted(tracker.client.get_metric_history(tracker.run_id, k), key=lambda m: m.step)
            xs = [m.step for m in hist if not math.isnan(m.value)]
            ys = [m.value for m in hist if not math.isnan(m.value)]
            ax.plot(xs, ys, marker=".", label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reward_curves.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        tracker.log_artifact(path, "plots")
    return "plots/reward_curves.png"


# ---------------------------------------------------------------- the sweep's parent run
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
        tags = {k: redact_value(k, v)[:_TAG_MAX] for k, v in tags.items()}
        run_id = client.create_run(exp_id, tags=tags, run_name=tags.get("mlflow.runName")).info.run_id
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    (Path(sweep_dir) / PARENT_ID_FILE).write_text(run_id)
    return run_id


def close_run(uri: str, run_id: str, status: str, tags: Mapping[str, Any] | None = None,
              only_if_running: bool = False) -> None:
    """Tag a run and end it ``status`` (FINISHED | FAILED | KILLED). ``only_if_running``: leave a run
    that already ended as it is (a job's own run, closed by its process unless that was killed)."""
    from mlflow.tracking import MlflowClient

    with _mlflow_settings(_JOB_HTTP):  # MLflow's "View run" line would print the URI as typed
        client = MlflowClient(uri)
        if only_if_running and client.get_run(run_id).info.status != "RUNNING":
            return
        for k, v in (tags or {}).items():
            client.set_tag(run_id, k, redact_value(k, v)[:_TAG_MAX])
        client.set_terminated(run_id, status)


def job_run_id(job_dir: str | Path) -> str | None:
    """The MLflow run of the job whose output dir is ``job_dir`` (None: not tracked)."""
    path = Path(job_dir) / RUN_ID_FILE
    return (path.read_text().strip() or None) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    """``python -m musique_rl.tracking --upload <run dir> [--uri URI]``: send a run directory's metrics
    to its MLflow run (after a tracking outage, or a run made with tracking.enabled=false)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m musique_rl.tracking", description=main.__doc__)
    p.add_argument("--upload", metavar="RUN_DIR", nargs="+", required=True, help="run directories (with metrics.jsonl)")
    p.add_argument("--uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else the run's tracking.tracking_uri, "
                                 "else sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", help="experiment of a new run, for a run dir without mlflow_run_id")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for run_dir in args.upload:
        d = Path(run_dir)
        if not (d / "metrics.jsonl").exists():
            p.error(f"{d}: no metrics.jsonl (not a run directory)")
        sent = upload_run_dir(d, uri=args.uri, experiment=args.experiment)
        run_id = (d / RUN_ID_FILE).read_text().strip()
        print(f"{d}: {sent} step(s) sent to MLflow run {run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
