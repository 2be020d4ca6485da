"""Reading a sweep: from MLflow (tags hypothesis, arm, seed, sweep_id) or a Hydra multirun dir.

Per job: the value of ``hypothesis.metric``, its state (a job that failed, was killed or never
started is named, not dropped), its params (the flattened resolved config, for the design check),
and its provenance: the git commit (MLflow tag ``git_commit``), the warm-start hash and the
machine. Provenance comes from the job directory's ``metrics.json`` first (``warm_start/hash``,
``machine/cpu``, ``machine/torch_threads``, ``machine/device``, written by train.py), the MLflow
tags ``warm_start_hash`` and ``machine`` as fallback, else "unknown".

Whether a job failed, and why, is read from the sweep's jobs table (``jobs.json``, the one record
of each job's outcome: musique_rl/sweep/jobs.py). Only a sweep without one (another launcher, an
older sweep) falls back to the job dir's traceback and logs, or to its MLflow run's state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from musique_rl.base import rundir
from musique_rl.base.config_base import flatten
from musique_rl.core.warm_start_builder import machine_string
from musique_rl.tracking.provenance import config_params, sweep_id_of
from musique_rl.tracking.store import tracking_uri
from musique_rl.verdict.sweep import HYPOTHESIS_DIR, UNKNOWN, Hypothesis, Run, Sweep, VerdictError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)

# MLflow tags each job run carries (musique_rl/tracking/provenance.py writes them).
TAG_HYPOTHESIS, TAG_ARM, TAG_SEED, TAG_SWEEP = "hypothesis", "arm", "seed", "sweep_id"
TAG_PARENT, TAG_SWEEP_PARENT = "mlflow.parentRunId", "sweep_parent"  # the sweep's parent run (tracking.sweep.open_parent_run)
TAG_WARM_START, TAG_MACHINE = "warm_start_hash", "machine"  # tracking.provenance.origin_tags


# ---------------------------------------------------------------- shared
def load_hypothesis_file(name: str) -> Hypothesis:
    from omegaconf import OmegaConf

    path = HYPOTHESIS_DIR / f"{name}.yaml"
    if not path.exists():
        raise VerdictError(f"no hypothesis {name!r}: expected {path}")
    return Hypothesis.from_mapping(OmegaConf.load(path).hypothesis, str(path))


def swept_values(cfg: DictConfig) -> dict[str, list[str]]:
    """The values a multirun sweeps each key over, expanded by Hydra's own override parser: the
    sweeper's params (named sweeps), then the command line's ``key=a,b`` (which wins)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    texts = list(OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or [])
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    texts = [f"{k}={v}" for k, v in params.items()] + texts  # command line wins: parsed last
    grid: dict[str, list[str]] = {}
    for ov in OverridesParser.create().parse_overrides(texts):
        key = ov.get_key_element().lstrip("+~")
        grid[key] = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [str(ov.value())]
    return grid


def read_metrics(job_dir: str | Path | None) -> dict[str, Any] | None:
    """A job directory's metrics.json as flat keys ("train/reward_gain"); None when absent."""
    try:
        summary = rundir.read_summary(job_dir)
    except rundir.RunFileError as exc:
        raise VerdictError(str(exc)) from exc
    return None if summary is None else flatten(summary)


def provenance(metrics: dict[str, Any] | None, tags: dict[str, str] | None = None) -> tuple[str, str]:
    """(warm-start hash, machine) of one job: metrics.json first, MLflow tags second, else unknown."""
    metrics, tags = metrics or {}, tags or {}
    warm = metrics.get("warm_start/hash") or tags.get(TAG_WARM_START) or UNKNOWN
    parts = [metrics.get(f"machine/{k}") for k in ("cpu", "torch_threads", "device")]
    machine = machine_string(*("?" if p is None else p for p in parts)) if any(p is not None for p in parts) \
        else tags.get(TAG_MACHINE) or UNKNOWN
    return str(warm), str(machine)


# ---------------------------------------------------------------- multirun directories
def _exception_line(text: str) -> str | None:
    """The exception line ("RuntimeError: ...") closing the last traceback in a log text."""
    if "Traceback (most recent call last):" not in text:
        return None
    lines = text.rsplit("Traceback (most recent call last):", 1)[1].splitlines()[1:]
    for ln in lines:
        if ln.strip() and not ln.startswith((" ", "\t")):
            return ln.strip()[:200]
    return None


def _read_failure(job_dir: Path) -> str:
    """Why a job left no metrics, for a sweep without a jobs table: its traceback file (the
    launcher's), else its Hydra job log."""
    for f in [job_dir / "traceback.txt", job_dir / "error.txt", *sorted(job_dir.glob("*.log"))]:
        if f.exists() and (line := _exception_line(f.read_text(errors="replace"))):
            return line
    return "no metrics.json: the job failed or was killed (see its log)"


def _job_params(cfg: DictConfig) -> dict[str, str]:
    """A job's saved config as the params MLflow would hold (resolved where our resolvers can)."""
    from omegaconf import OmegaConf

    from musique_rl import schema

    schema.register()
    try:
        return config_params(cfg)
    except Exception:  # e.g. a ${hydra:...} interpolation outside a Hydra run: compare unresolved
        return {k: str(v) for k, v in flatten(OmegaConf.to_container(cfg, resolve=False)).items()}


def load_multirun(sweep_dir: str | Path) -> Sweep:
    """Read a Hydra multirun directory: each job's .hydra/config.yaml and metrics.json."""
    from omegaconf import OmegaConf

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise VerdictError(f"sweep directory {sweep_dir} does not exist")
    job_cfgs = rundir.job_config_files(sweep_dir)
    grid = swept_values(OmegaConf.load(sweep_dir / "multirun.yaml")) if (sweep_dir / "multirun.yaml").exists() else {}
    hyp: Hypothesis | None = None
    runs: list[Run] = []
    for cfg_path in job_cfgs:
        job_dir = cfg_path.parent.parent
        cfg = OmegaConf.load(cfg_path)
        h = cfg.get("hypothesis")
        if h is None:
            raise VerdictError(f"{cfg_path}: job has no hypothesis (run the sweep with +hypothesis=hNN or +sweep=hNN)")
        this = Hypothesis.from_mapping(h, str(cfg_path))
        if hyp is None:
            hyp = this
        elif this.id != hyp.id:
            raise VerdictError(f"{sweep_dir} mixes hypotheses {hyp.id} and {this.id} ({cfg_path})")
        arm, seed, params = str(h.get("arm")), int(cfg.get("seed")), _job_params(cfg)
        try:
            metrics, unreadable = read_metrics(job_dir), None
        except VerdictError as exc:  # one cut-off file must not hide the other jobs' evidence
            metrics, unreadable = None, str(exc)
        warm, machine = provenance(metrics)
        run = Run(arm, seed, "FINISHED", None, str(job_dir), params=params, warm_start=warm, machine=machine,
                  code=(metrics or {}).get("git/commit"), job_dir=str(job_dir))
        if metrics is None:
            run.status, run.reason = "FAILED", unreadable or _read_failure(job_dir)
        elif metrics.get(hyp.metric) is None:
            run.reason = f"metrics.json has no {hyp.metric!r} (has {', '.join(sorted(metrics)[:8])} ...)"
        else:
            run.value = float(metrics[hyp.metric])
        runs.append(run)
    if hyp is None:
        named = grid.get("sweep") or grid.get("hypothesis")
        if not named:
            raise VerdictError(f"{sweep_dir} holds no job (no */.hydra/config.yaml) and names no hypothesis")
        hyp = load_hypothesis_file(named[0])
    seeds = [int(s) for s in grid.get("seed", [])]
    return Sweep(hyp, runs, seeds, source={"kind": "files", "sweep_dir": str(sweep_dir)})


def latest_multirun_for(hyp_id: str, root: Path = Path("multirun")) -> Path | None:
    """The newest multirun directory (under ``root``) whose jobs ran hypothesis ``hyp_id``."""
    from omegaconf import OmegaConf

    best: tuple[float, Path] | None = None
    for cfg_path in root.glob(f"**/{rundir.CONFIG}"):
        try:
            h = OmegaConf.load(cfg_path).get("hypothesis")
        except Exception:
            continue
        if h is not None and str(h.get("id")) == hyp_id:
            sweep_dir = cfg_path.parent.parent.parent
            mtime = cfg_path.stat().st_mtime
            if best is None or mtime > best[0]:
                best = (mtime, sweep_dir)
    return best[1] if best else None


# ---------------------------------------------------------------- MLflow
def default_tracking_uri(explicit: str | None = None) -> str:
    """The jobs' store (tracking.store.tracking_uri): explicit, else $MLFLOW_TRACKING_URI, else ./mlflow.db."""
    return explicit or tracking_uri(None, Path.cwd())


def sweep_ids_for_dir(sweep_dir: Path) -> list[str]:
    """The sweep_id tag of a multirun directory's runs: the `sweep_id` file the sweep's callback
    leaves in it (the id it was launched under, if the directory moved since), else what
    tracking.provenance.sweep_id_of derives from the path."""
    ids = []
    marker = sweep_dir / "sweep_id"
    if marker.exists():
        ids.append(marker.read_text().strip())
    ids += [sweep_id_of(sweep_dir.resolve()), str(sweep_dir)]
    return list(dict.fromkeys(ids))


def _mlflow_runs(tracking_uri: str, filter_string: str, experiment: str | None = None) -> list[Any]:
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        exp_ids = [exp.experiment_id]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments(view_type=mlflow.entities.ViewType.ALL)]
    if not exp_ids:
        return []
    return list(client.search_runs(exp_ids, filter_string=filter_string, max_results=5000))


def _mlflow_run(r: Any, hyp: Hypothesis, sweep_ended: bool) -> Run:
    tags = r.data.tags
    status = r.info.status
    if sweep_ended and status in ("RUNNING", "SCHEDULED"):
        status = "KILLED"
    try:  # a run that logged its summary only to the job dir still counts
        metrics = read_metrics(tags.get("output_dir"))
    except VerdictError as exc:
        log.warning("%s; using run %s's MLflow metrics and tags only", exc, r.info.run_id)
        metrics = None
    value = r.data.metrics.get(hyp.metric)
    if value is None and status == "FINISHED" and metrics is not None and metrics.get(hyp.metric) is not None:
        value = float(metrics[hyp.metric])
    reason = ""
    if status != "FINISHED":
        reason = f"run ended {status}" if status in ("FAILED", "KILLED") else f"run still {status}"
        if status == "KILLED" and r.info.status != "KILLED":
            reason = "its process died without ending the run (killed)"
        err = tags.get("error") or tags.get("exception")
        if err:
            reason += f": {err[:200]}"
    elif value is None:
        reason = f"run has no metric {hyp.metric!r}"
    sha = tags.get("git_commit")
    code = None if sha in (None, UNKNOWN) else sha + ("+dirty" if tags.get("git_dirty") == "true" else "")
    warm, machine = provenance(metrics, tags)
    return Run(tags[TAG_ARM], int(tags[TAG_SEED]), status, value, r.info.run_id, reason,
               params=dict(r.data.params) or None, code=code, warm_start=warm, machine=machine,
               job_dir=tags.get("output_dir"))


def load_mlflow(
    *, sweep_id: str | list[str] | None = None, experiment: str | None = None, tracking_uri: str | None = None,
    sweep_ended: bool = False,
) -> Sweep | None:
    """Runs of one sweep (by sweep_id tag) or of the latest sweep of an experiment; None if none.

    sweep_ended: every job has returned (the verdict runs at the sweep's end), so a run still
    RUNNING belongs to a process that died without closing it: reported as KILLED.
    """
    uri = default_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None  # no local store: nothing tracked here (and MLflow would create an empty one)
    ids = [sweep_id] if isinstance(sweep_id, str) else list(sweep_id or [])
    runs: list[Any] = []
    if ids:
        for sid in ids:
            runs = _mlflow_runs(uri, f"tags.{TAG_SWEEP} = '{sid}'")
            if runs:
                break
    elif experiment is not None:
        all_runs = _mlflow_runs(uri, f"tags.{TAG_SWEEP} != ''", experiment=experiment)
        if not all_runs:
            return None
        latest = max(all_runs, key=lambda r: r.info.start_time or 0).data.tags[TAG_SWEEP]
        runs = [r for r in all_runs if r.data.tags.get(TAG_SWEEP) == latest]
    if not runs:
        return None
    parents = [r for r in runs if r.data.tags.get(TAG_SWEEP_PARENT) == "true"] or [
        r for r in runs if TAG_PARENT not in r.data.tags and TAG_ARM not in r.data.tags
    ]
    jobs = [r for r in runs if TAG_ARM in r.data.tags]
    if not jobs:
        return None
    hyp_id = jobs[0].data.tags.get(TAG_HYPOTHESIS)
    if hyp_id is None:
        raise VerdictError(f"run {jobs[0].info.run_id} has no {TAG_HYPOTHESIS!r} tag")
    hyp = load_hypothesis_file(hyp_id)
    out = [_mlflow_run(r, hyp, sweep_ended) for r in jobs]
    seeds = sorted({r.seed for r in out})
    source = {
        "kind": "mlflow",
        "tracking_uri": uri,
        "sweep_id": jobs[0].data.tags.get(TAG_SWEEP),
        "parent_run_id": parents[0].info.run_id if parents else jobs[0].data.tags.get(TAG_PARENT),
        "experiment_id": jobs[0].info.experiment_id,
    }
    return Sweep(hyp, out, seeds, source=source)


# ---------------------------------------------------------------- the jobs table
_STATUS_OF_ROW = {"FAILED": "FAILED", "DIED": "KILLED"}  # jobs.json status -> the run status the verdict names


def apply_job_outcomes(sweep: Sweep, rows: list[rundir.JobRow]) -> Sweep:
    """A run whose job the jobs table records as FAILED or DIED is a gap, named with the table's
    error line, whatever files or MLflow state the job left behind."""
    failed = {str(r.num): r for r in rows if r.failed}
    for run in sweep.runs:
        row = failed.get(Path(run.job_dir).name) if run.job_dir else None
        if row is not None:
            run.status = _STATUS_OF_ROW[row.status]
            run.reason = row.error or f"the job {row.status} (jobs.json)"
    return sweep


# ---------------------------------------------------------------- either
def load_sweep(sweep: str | None = None, experiment: str | None = None, tracking_uri: str | None = None,
               prefer: str = "auto", sweep_ended: bool = False,
               jobs: list[rundir.JobRow] | None = None) -> Sweep:
    """MLflow first (it also knows jobs that died before writing files), the directory as fallback.

    The directory still supplies the requested grid, so a job that never started is named, and
    its jobs table (``jobs``, else its jobs.json) says which jobs failed and why.
    """
    loaded = _load(sweep, experiment, tracking_uri, prefer, sweep_ended)
    sweep_dir = loaded.source.get("sweep_dir")
    if jobs is None and sweep_dir:
        jobs = rundir.read_jobs(sweep_dir)
    return apply_job_outcomes(loaded, jobs or [])


def _load(sweep: str | None, experiment: str | None, tracking_uri: str | None, prefer: str,
          sweep_ended: bool) -> Sweep:
    if (sweep is None) == (experiment is None):
        raise VerdictError("give exactly one of --sweep and --experiment")
    from_files = None
    sweep_dir = Path(sweep) if sweep is not None and Path(sweep).is_dir() else None
    if sweep_dir is not None:
        from_files = load_multirun(sweep_dir)
    from_mlflow = None
    if prefer != "files":
        try:
            ids = sweep_ids_for_dir(sweep_dir) if sweep_dir is not None else sweep
            from_mlflow = load_mlflow(sweep_id=ids, experiment=None if sweep else experiment,
                                      tracking_uri=tracking_uri, sweep_ended=sweep_ended)
        except VerdictError:
            raise
        except Exception as exc:  # an unreachable server must not hide the files' evidence
            if prefer == "mlflow" or from_files is None:
                raise
            log.warning("MLflow unavailable (%s); judging from the sweep directory's files", exc)
    if from_mlflow is not None:
        if from_files is not None:
            from_mlflow.seeds = sorted(set(from_mlflow.seeds) | set(from_files.seeds))
            from_mlflow.source["sweep_dir"] = str(sweep_dir)
        return from_mlflow
    if prefer == "mlflow":
        raise VerdictError(f"no MLflow runs for {sweep or experiment!r} in {default_tracking_uri(tracking_uri)}")
    if from_files is not None:
        return from_files
    if experiment is not None:
        latest = latest_multirun_for(experiment)
        if latest is not None:
            return load_multirun(latest)
    raise VerdictError(
        f"no runs found for {sweep or experiment!r}: not a directory, no MLflow runs tagged "
        f"{TAG_SWEEP}={sweep!r} in {default_tracking_uri(tracking_uri)}"
    )
