"""Where a run's logs live, read into what the doctor judges: metric histories and params.

Every reader returns a ``RunLog``: ``histories`` {metric: [(step, value), ...] sorted by step} in
TRL's current names (``normalise_names``), ``params`` {key: str} (the config or TrainingArguments
where the source holds them), and ``home``, the directory ``diagnosis.json`` goes to by default.

- ``read_run_dir``: a run directory of this project (``metrics.jsonl``; params from Hydra's
  ``.hydra/config.yaml``). A copied directory reads the same.
- ``read_trainer_state``: a transformers/TRL ``trainer_state.json`` (the file, a checkpoint
  directory, or an output directory with ``checkpoint-*`` subdirectories: the newest one).
- ``read_table``: a metrics table exported from W&B or any logger (CSV or JSONL, one row per step).
- ``read_mlflow``: an MLflow run (ours, or one logged by transformers' MLflowCallback).
- ``open_source``: any of these from what a user types (a path, ``mlflow:<run id>``, ``runs:/<run id>``).
"""

from __future__ import annotations

import csv
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from musique_rl.base import rundir
from musique_rl.base.config_base import flatten
from musique_rl.doctor.findings import History

log = logging.getLogger(__name__)

RUN_METRICS = rundir.METRICS_LOG  # what every training run of this project writes, one JSON object per logged step
TRAINER_STATE = rundir.TRAINER_STATE
# The step of a row, first match wins: the trainer's own step before a logger's row counter
# (W&B's `_step` counts logged rows, which differs from the trainer's step when eval rows interleave).
STEP_COLUMNS = ("step", "train/global_step", "global_step", "trainer/global_step", "_step", "Step")
# Columns that are not metrics of the training step (W&B bookkeeping, eval rows, wall time)
_NOT_METRICS = re.compile(r"^(_|eval/|eval_|test/|test_)|^(epoch|train/epoch|total_flos|train/total_flos)$")


class SourceError(ValueError):
    """An input the doctor cannot read; the message names the path (or run) and what is wrong."""


@dataclass
class RunLog:
    name: str  # what the triage table calls the run
    source: str  # the path or run it was read from
    histories: dict[str, History]
    params: dict[str, str] = field(default_factory=dict)
    home: Path | None = None  # where diagnosis.json goes unless told otherwise
    notes: list[str] = field(default_factory=list)  # what the reader tolerated or renamed


# ---------------------------------------------------------------- metric names
# TRL before 0.17 (0.14-0.16, the first GRPOTrainer releases) logged `completion_length`,
# `rewards/<func>` (the mean only) and one `clip_ratio`; 0.17 renamed them to
# `completions/mean_length`, `rewards/<func>/mean` (adding `/std`) and, from 0.18, split the clip
# ratio into `clip_ratio/low_mean|high_mean|region_mean`. The names of 1.16 are the ones the rules read.
LEGACY_NAMES = {"completion_length": "completions/mean_length", "clip_ratio": "clip_ratio/region_mean"}
_LEGACY_REWARD = re.compile(r"^rewards/([^/]+)$")
# Logger prefixes: transformers' WandbCallback (and Comet, ClearML...) rewrite `loss` to `train/loss`.
_PREFIXES = ("train/",)


def normalise_names(hist: Mapping[str, History]) -> tuple[dict[str, History], list[str]]:
    """TRL 1.16's names for ``hist``'s keys (logger prefixes dropped, pre-0.17 names mapped); the
    renames made, as notes. A current name present in the log wins over a legacy one."""
    out: dict[str, History] = {}
    renamed: list[str] = []
    def bare(key: str) -> str:
        for p in _PREFIXES:
            if key.startswith(p):
                return key[len(p):]
        return key

    def legacy(key: str) -> bool:
        return key in LEGACY_NAMES or _LEGACY_REWARD.match(key) is not None

    # today's unprefixed names first: they win over a prefixed or legacy twin of the same metric
    for key in sorted(hist, key=lambda k: (legacy(bare(k)), k.startswith(_PREFIXES))):
        new = bare(key)
        if new in LEGACY_NAMES:
            new = LEGACY_NAMES[new]
        elif (m := _LEGACY_REWARD.match(new)) is not None:
            new = f"rewards/{m.group(1)}/mean"
        if new in out:
            continue
        if new != key and not key.startswith(_PREFIXES):
            renamed.append(f"{key} -> {new}")
        out[new] = hist[key]
    if renamed:
        renamed = [f"read pre-0.17 TRL names as today's: {', '.join(renamed)}"]
    return out, renamed


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str) and v.strip():
        try:
            return float(v)
        except ValueError:
            return None
    return None


def histories_from_rows(rows: Iterable[Mapping[str, Any]], where: str) -> dict[str, History]:
    """{metric: [(step, value)]} from rows that each hold a step column and metrics; a metric logged
    twice at one step keeps its last value (a resumed run logs the repeated steps again)."""
    acc: dict[str, dict[int, float]] = {}
    for i, row in enumerate(rows):
        step_key = next((k for k in STEP_COLUMNS if _number(row.get(k)) is not None), None)
        if step_key is None:
            raise SourceError(f"{where}: row {i + 1} has no step column (one of {', '.join(STEP_COLUMNS)})")
        step = int(_number(row[step_key]))  # type: ignore[arg-type]
        for k, v in row.items():
            if k in STEP_COLUMNS or _NOT_METRICS.search(k):
                continue
            x = _number(v)
            if x is not None and not math.isnan(x):
                acc.setdefault(k, {})[step] = x
    return {k: sorted(d.items()) for k, d in acc.items()}


def _jsonl_rows(path: Path, notes: list[str]) -> list[dict]:
    """The objects of a JSONL file, under the run directory's one torn-line policy
    (``rundir.read_metrics_log``: a torn LAST line skipped with a note, any other bad line an error)."""
    try:
        return rundir.read_metrics_log(path, notes)
    except rundir.RunFileError as e:
        raise SourceError(str(e)) from None


def _finish(name: str, source: str, hist: dict[str, History], params: dict[str, str], home: Path | None,
            notes: list[str]) -> RunLog:
    hist, renamed = normalise_names(hist)
    if not hist:
        raise SourceError(f"{source}: no metric found (expected one row per logged step with TRL's metric names)")
    return RunLog(name, source, hist, params, home, notes + renamed)


# ---------------------------------------------------------------- readers
def read_run_dir(path: str | Path) -> RunLog:
    """A run directory of this project: its ``metrics.jsonl``; params from ``.hydra/config.yaml``."""
    d = Path(path)
    f = d / RUN_METRICS
    if not f.is_file():
        raise SourceError(f"{d}: no {RUN_METRICS} (a run directory of musique_rl holds one per training run)")
    notes: list[str] = []
    hist = histories_from_rows(_jsonl_rows(f, notes), str(f))
    params: dict[str, str] = {}
    try:
        raw = rundir.read_config(d) or {}
        params = {k: str(v) for k, v in flatten(raw).items()
                  if not isinstance(v, Mapping)}  # an empty group is no param
        params.update(_resolved(raw, params))
    except rundir.RunFileError as e:
        notes.append(f"{e}; params left empty")
    return _finish(d.resolve().name, str(d), hist, params, d, notes)


def _resolved(raw: Mapping[str, Any], params: Mapping[str, str]) -> dict[str, str]:
    """The values of ``params`` that are interpolations (``${model.learning_rate}``), resolved as the
    job resolved them, so the doctor reads a run dir as the job itself did (its params are the
    resolved config). One that needs a resolver this process lacks stays as written."""
    from omegaconf import OmegaConf

    from musique_rl.base.config_base import register_resolvers

    register_resolvers()  # ${arm:...} of a sweep's job, ${mul:...}: as the job resolved them
    cfg = OmegaConf.create(dict(raw))
    out = {}
    for k, v in params.items():
        if "${" in v:
            try:
                got = OmegaConf.select(cfg, k, throw_on_resolution_failure=True)
            except Exception:  # noqa: BLE001  (an unknown resolver, a missing env var: keep the text)
                continue
            if got is not None and not OmegaConf.is_config(got):
                out[k] = str(got)
    return out


def find_trainer_state(path: str | Path) -> Path:
    """The ``trainer_state.json`` a path means: the file, the one in a checkpoint directory, or the
    newest ``checkpoint-<N>`` of an output directory (the highest N: the most steps logged)."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / TRAINER_STATE).is_file():
        return p / TRAINER_STATE
    newest = rundir.newest_checkpoint_file(p, TRAINER_STATE)
    if newest is None:
        raise SourceError(f"{p}: no {TRAINER_STATE}, and no checkpoint-*/{TRAINER_STATE} under it")
    return newest


def read_trainer_state(path: str | Path) -> RunLog:
    """A transformers Trainer's ``trainer_state.json``: its ``log_history``, one entry per logging step."""
    f = find_trainer_state(path)
    try:
        state = rundir.read_trainer_log(f)
    except rundir.RunFileError as e:
        raise SourceError(str(e)) from None
    rows = [e for e in state["log_history"] if isinstance(e, dict) and "step" in e]
    params = {k: str(state[k]) for k in ("max_steps", "logging_steps", "train_batch_size", "global_step")
              if k in state}
    run = f.parent.parent if f.parent.name.startswith("checkpoint-") else f.parent
    return _finish(run.resolve().name, str(f), histories_from_rows(rows, str(f)), params, f.parent, [])


def read_table(path: str | Path) -> RunLog:
    """A metrics table, one row per logged step: CSV (W&B's export: ``train/`` names, ``_step``,
    ``train/global_step``) or JSONL (any logger)."""
    f = Path(path)
    notes: list[str] = []
    if f.suffix.lower() == ".csv":
        try:
            with f.open(newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
        except (OSError, csv.Error, UnicodeDecodeError) as e:
            raise SourceError(f"{f}: not a readable CSV ({e})") from None
    elif f.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(f, notes)
    else:
        raise SourceError(f"{f}: a metrics table must be .csv or .jsonl")
    if not rows:
        raise SourceError(f"{f}: no rows")
    # the directory names the run: exports are often all called wandb_export.csv / history.jsonl
    name = f"{f.resolve().parent.name}/{f.name}"
    return _finish(name, str(f), histories_from_rows(rows, str(f)), {}, f.parent, notes)


def read_mlflow(run_id: str, uri: str | None = None) -> RunLog:
    """An MLflow run: every metric's history and the run's params. transformers' MLflowCallback keeps
    TRL's names (its sanitiser, ``[^0-9A-Za-z_\\-\\.\\ :/] -> _``, leaves them as they are) and logs
    the TrainingArguments as params (``learning_rate``, ``max_completion_length``, ``beta``...)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise SourceError(f"MLflow run {run_id} in {uri or 'the default store'}: {e.message}") from None
    hist: dict[str, History] = {}
    for key in run.data.metrics:
        pts = client.get_metric_history(run_id, key)
        by_step = {p.step: p.value for p in sorted(pts, key=lambda p: p.timestamp)}  # last value per step
        hist[key] = sorted(by_step.items())
    name = run.data.tags.get("mlflow.runName") or run_id
    return _finish(name, f"mlflow:{run_id}", hist, dict(run.data.params), None, [])


_MLFLOW = re.compile(r"^(?:mlflow:|runs:/)([0-9a-fA-F]{6,64})(?:/.*)?$")


def open_source(spec: str, tracking_uri: str | None = None) -> RunLog:
    """The run ``spec`` names: ``mlflow:<run id>`` / ``runs:/<run id>``, or a path: a run directory of
    this project, a trainer_state.json (or a directory holding one, or checkpoint-* under it), or a
    CSV / JSONL metrics table."""
    m = _MLFLOW.match(spec)
    if m:
        return read_mlflow(m.group(1), tracking_uri)
    p = Path(spec)
    if not p.exists():
        raise SourceError(f"{p}: no such file or directory")
    if p.is_dir():
        if (p / RUN_METRICS).is_file():
            return read_run_dir(p)
        return read_trainer_state(p)  # names what it looked for when there is none
    if p.name == RUN_METRICS:
        return read_run_dir(p.parent)
    if p.suffix == ".json":
        return read_trainer_state(p)
    return read_table(p)
