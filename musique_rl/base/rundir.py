"""A run directory and a sweep directory: what a job leaves on disk, under which names, and how each
file is written and read. The one place that knows; every other module calls it.

Why one module: the same files were named, written and read in four places (the doctor's sources,
the console, the launch, the result), with two readers of ``metrics.jsonl`` that treated a torn
line differently. It sits at the bottom of the package and imports nothing of it
(tests/test_layers.py), so the doctor (diagnostics), the job, tracking, the sweep and the verdict
all read the same contract. The file names are contracts users script against: keep them.

A run directory (``hydra.run.dir``; by default ``outputs/<date>/<stamp()>``, conf/train.yaml)::

    metrics.jsonl          one JSON object per logged step ({"step": N, <metric>: value, ...})
    metrics.json           the job's summary (train: reward gain, held-out evals, provenance; eval: means)
    diagnosis.json         the doctor's ranked findings over metrics.jsonl
    episodes.jsonl         an eval job's scored episodes (replayable with policy=replay)
    episodes_<tag>.jsonl   a training job's held-out episodes, before and after training
    checkpoints/           transformers' checkpoint-<N> directories (core/checkpoints.py publishes them)
    plots/                 the run's figures (reward_curves.png)
    launch.json            the launch's identity (job/launch.py claim); .launch.lock its lock
    .hydra/config.yaml     the composed config; .hydra/overrides.yaml the overrides as typed

A sweep directory (``hydra.sweep.dir``): one run directory per job, named by its number, plus
``jobs.json`` (what became of each job) and ``verdict.json`` (the verdict, when it has a hypothesis).

``metrics.jsonl``'s torn-line policy (one, for every reader): the LAST line not being JSON is a
write cut short (a killed job, a full disk): it is skipped, with a warning and a note naming the
file and line. Any other line that is not a JSON object means the file is not what it claims: a
``RunFileError`` naming the file and line.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- a run directory's names
METRICS_LOG = "metrics.jsonl"
SUMMARY = "metrics.json"
DIAGNOSIS = "diagnosis.json"
EPISODES = "episodes.jsonl"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"  # transformers' log of a checkpoint-<N> (ours under checkpoints/, or a TRL run's)
PLOTS = "plots"
IDENTITY = "launch.json"
LOCK = ".launch.lock"
HYDRA_DIR = ".hydra"
CONFIG = f"{HYDRA_DIR}/config.yaml"
OVERRIDES = f"{HYDRA_DIR}/overrides.yaml"
# ---------------------------------------------------------------- a sweep directory's names
JOBS = "jobs.json"
VERDICT = "verdict.json"
STATUS = "status.md"  # the verdict's row of docs/STATUS.md, beside verdict.json
OUTPUTS = "outputs"  # where a run outside Hydra (a test, a notebook) puts its run directory


class RunFileError(ValueError):
    """A file of a run or sweep directory that is not what it claims; the message names the file
    (and the line)."""


def episodes_file(tag: str) -> str:
    """A training job's held-out episodes: ``episodes_before.jsonl``, ``episodes_after.jsonl``."""
    return f"episodes_{tag}.jsonl"


# ---------------------------------------------------------------- naming a run or sweep directory
def stamp(now: dt.datetime | None = None, pid: int | None = None) -> str:
    """``HH-MM-SS.ffffff-<pid>``, the unique part of a default run or sweep directory name (Hydra's
    ``${launch_stamp:}``). Seconds alone made two launches started in the same second one run; the
    microseconds keep the names sortable by start time, the pid keeps two processes apart even within
    one microsecond."""
    now = now or dt.datetime.now()
    return f"{now:%H-%M-%S.%f}-{os.getpid() if pid is None else pid}"


def default_run_dir(now: dt.datetime | None = None) -> Path:
    """``outputs/<date>/<stamp>``: a run directory for a job started outside Hydra."""
    now = now or dt.datetime.now()
    return Path(OUTPUTS) / f"{now:%Y-%m-%d}" / stamp(now)


# ---------------------------------------------------------------- metrics.jsonl
def read_metrics_log(path: str | Path, notes: list[str] | None = None) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (or any JSONL of one object per line), under the torn-line
    policy of the module docstring; [] when the file is absent. A skipped torn last line is
    logged and, when ``notes`` is given, appended to it."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    rows: list[dict] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if n == last:
                msg = f"{path}: last line {n} is torn ({e.msg}): a write cut short; read the {len(rows)} rows before it"
                log.warning(msg)
                if notes is not None:
                    notes.append(msg)
                break
            raise RunFileError(f"{path}: line {n} is not JSON ({e.msg}); only the last line may be torn") from None
        if not isinstance(obj, dict):
            raise RunFileError(f"{path}: line {n} is not a JSON object")
        rows.append(obj)
    return rows


def append_metrics_row(path: str | Path, step: int, metrics: dict[str, float]) -> None:
    """One logged step as one line of ``metrics.jsonl`` (NaN and inf as JSON's extensions, as Python reads them)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": int(step), **metrics}, allow_nan=True) + "\n")


def start_metrics_log(path: str | Path, resume_from: str | None = None) -> None:
    """A fresh ``metrics.jsonl``; resuming from ``checkpoint-<N>``, the rows of steps <= N are kept
    (the steps after it run again and are written again; a torn last line is dropped here)."""
    path = Path(path)
    keep: list[dict] = []
    if resume_from and path.exists():
        name = Path(resume_from).name
        last = int(name.rsplit("-", 1)[-1]) if "-" in name else -1
        keep = [row for row in read_metrics_log(path) if row.get("step", 0) <= last]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row, allow_nan=True) + "\n" for row in keep))
    os.replace(tmp, path)  # the kept steps are never lost to a write cut short


def metric_history(path: str | Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric of a ``metrics.jsonl``, in step order; [] when absent."""
    return sorted((int(r.get("step", 0)), float(r[key])) for r in read_metrics_log(path)
                  if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool))


# ---------------------------------------------------------------- metrics.json, diagnosis.json, episodes
def _write_json(path: Path, data: Any, indent: int, sort_keys: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=sort_keys, default=str) + "\n")  # a Path as its str
    os.replace(tmp, path)  # a reader never sees half a summary
    return path


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """The job's ``metrics.json``."""
    return _write_json(Path(run_dir) / SUMMARY, summary, indent=1)


def read_summary(run_dir: str | Path | None) -> dict[str, Any] | None:
    """A run directory's ``metrics.json``; None when absent (the job has not finished)."""
    if not run_dir or not (path := Path(run_dir) / SUMMARY).is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path} is not valid JSON ({exc}): the job was cut off while writing it?") from None
    if not isinstance(data, dict):
        raise RunFileError(f"{path} is not a JSON object")
    return data


def newest_checkpoint_file(directory: str | Path, name: str = TRAINER_STATE) -> Path | None:
    """``<directory>/checkpoint-<N>/<name>`` of the highest N that holds one (the most steps), or None."""
    found = [c for c in Path(directory).glob("checkpoint-*") if (c / name).is_file() and c.name.split("-")[-1].isdigit()]
    return max(found, key=lambda c: int(c.name.split("-")[-1])) / name if found else None


def read_trainer_log(path: str | Path) -> dict[str, Any]:
    """A transformers ``trainer_state.json`` whose ``log_history`` is a list (one entry per logging
    step); a file that is not one is a ``RunFileError`` naming it."""
    path = Path(path)
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path}: not a readable {TRAINER_STATE} ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise RunFileError(f"{path}: no log_history list (is this a transformers {TRAINER_STATE}?)")
    return state


def write_diagnosis(path: str | Path, diagnosis: Any) -> Path:
    """The doctor's findings as ``diagnosis.json`` (``path``: the file; a run's is ``<run dir>/diagnosis.json``)."""
    return _write_json(Path(path), diagnosis, indent=2, sort_keys=False)  # findings keep their field order


def write_episodes(path: str | Path, episodes: list[dict]) -> Path:
    """Episodes, one JSON object per line (unicode kept, anything else as its str)."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for e in episodes:
            f.write(json.dumps(e, ensure_ascii=False, default=str) + "\n")
    return path


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The composed config Hydra saved in the run directory (``.hydra/config.yaml``), as plain data;
    None when absent. A file that is not YAML raises ``RunFileError`` naming it."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return None
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RunFileError(f"{path}: not YAML ({e})") from None
    return data if isinstance(data, dict) else {}


def job_config_files(sweep_dir: str | Path) -> list[Path]:
    """The ``.hydra/config.yaml`` of every job under a sweep directory, at any depth (a sweep of
    sweeps), in path order; submitit's own folders left out."""
    return sorted(p for p in Path(sweep_dir).glob(f"**/{CONFIG}") if ".submitit" not in p.parts)


# ---------------------------------------------------------------- a sweep's jobs.json
BAD = ("FAILED", "DIED")


@dataclass
class JobRow:
    """One job of a multirun in ``jobs.json`` (fields documented in docs/howto/sweeps.md): ``num``
    (Hydra's job number = the job dir's name), ``overrides`` (the job's own), ``status`` (COMPLETED |
    FAILED | DIED | SKIPPED: finished in an earlier launch of a resumed sweep), ``seconds`` (None when
    the process died), ``error`` (the exception's type and last line; None when it completed)."""

    num: int
    overrides: list[str] = field(default_factory=list)
    status: str = "COMPLETED"
    seconds: float | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status in BAD


def read_jobs(sweep_dir: str | Path) -> list[JobRow]:
    """The rows of a sweep's ``jobs.json``; [] when absent."""
    path = Path(sweep_dir) / JOBS
    if not path.exists():
        return []
    try:
        return [JobRow(**row) for row in json.loads(path.read_text())]
    except (json.JSONDecodeError, TypeError) as exc:
        raise RunFileError(f"{path}: not a list of job rows ({exc})") from None


def write_jobs(sweep_dir: str | Path, rows: list[JobRow]) -> Path:
    """``rows`` as the sweep's ``jobs.json`` (the caller merges and redacts: sweep/jobs.py)."""
    path = Path(sweep_dir) / JOBS
    path.write_text(json.dumps([asdict(r) for r in sorted(rows, key=lambda r: r.num)], indent=1) + "\n")
    return path
