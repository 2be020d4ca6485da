"""Verdicts: does a hypothesis' sweep move its predicted metric? Paired by seed, bootstrapped.

Run:  python -m musique_rl.verdict --sweep multirun/2025-01-01/12-00-00   (a multirun dir)
      python -m musique_rl.verdict --sweep <sweep id>                       (MLflow tag sweep_id)
      python -m musique_rl.verdict --experiment h02                         (latest sweep of h02)
A sweep started with ``+sweep=hNN`` runs this by itself at its end (``VerdictCallback``).

Input: one value of ``hypothesis.metric`` per (arm, seed), read from the runs' MLflow tags
(hypothesis, arm, seed, sweep_id) and metrics, or from each job directory's ``metrics.json``
when MLflow has nothing. Effect = treatment minus control on the same seed (both arms share the
data order per seed), so seed-to-seed variance cancels. The interval is a percentile bootstrap
of the mean paired difference (numpy, seeded: the same runs give the same verdict).

Criterion (the hypothesis file's ``direction`` and ``min_effect``), with d = the effect signed
so that the predicted direction is positive and [lo, hi] its interval:
  Validated    lo >  min_effect   (the effect is there and at least as large as claimed)
  Invalidated  hi <  min_effect   (any effect is smaller than claimed, or opposite)
  Inconclusive otherwise, or fewer than 2 complete seed pairs.
Confidence = share of bootstrap means on the side of min_effect that the status names
(for Inconclusive: the larger side, with the lean stated in the notes).

Design check: a paired comparison means something only if the arms differ in the hypothesis'
knob and nothing else, and every seed ran the same configuration. The runs' params (the
flattened resolved config) are compared: the keys the arms differ in are reported
(``arms_differ_in``), and a sweep whose runs of one arm differ in anything but the seed (for
example a default edited while the sweep ran) is ``Confounded``: reported Inconclusive with the
keys named, whatever the numbers say.

Output: ``verdict.json`` (sweep dir, or --out), the status table of all hypotheses between
``<!-- verdicts:start -->`` / ``<!-- verdicts:end -->`` in README.md (only there), and both as
artifacts of the sweep's MLflow parent run.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import json
import logging
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HYPOTHESIS_DIR = ROOT / "conf" / "hypothesis"
MARK_START, MARK_END = "<!-- verdicts:start -->", "<!-- verdicts:end -->"
ARMS = ("control", "treatment")
# MLflow tags each job run carries (musique_rl/tracking.py writes them).
TAG_HYPOTHESIS, TAG_ARM, TAG_SEED, TAG_SWEEP = "hypothesis", "arm", "seed", "sweep_id"
TAG_PARENT, TAG_SWEEP_PARENT = "mlflow.parentRunId", "sweep_parent"  # tracking.SweepCallback's parent run


class VerdictError(ValueError):
    """Input the verdict cannot judge (no runs, no hypothesis, unknown sweep): said plainly."""


# ---------------------------------------------------------------- data
@dataclass(frozen=True)
class Hypothesis:
    id: str
    title: str
    priority: str
    metric: str
    direction: str  # increase | decrease
    min_effect: float

    @classmethod
    def from_mapping(cls, h: Any, where: str) -> Hypothesis:
        missing = [k for k in ("id", "metric", "direction") if h.get(k) in (None, "???")]
        if missing:
            raise VerdictError(f"{where}: hypothesis block lacks {', '.join(missing)}")
        direction = str(getattr(h["direction"], "value", h["direction"]))
        if direction not in ("increase", "decrease"):
            raise VerdictError(f"{where}: hypothesis.direction={direction!r}, expected increase|decrease")
        return cls(
            id=str(h["id"]),
            title=str(h.get("title") or ""),
            priority=str(getattr(h.get("priority"), "value", h.get("priority")) or "medium"),
            metric=str(h["metric"]),
            direction=direction,
            min_effect=float(h.get("min_effect") or 0.0),
        )


@dataclass
class Run:
    """One job of the sweep: its arm, seed, state and (if it finished) the metric's value."""

    arm: str
    seed: int
    status: str  # FINISHED | FAILED | KILLED | RUNNING | SCHEDULED (MLflow) or FINISHED | FAILED (files)
    value: float | None
    source: str  # MLflow run id or job directory
    reason: str = ""  # why there is no value
    params: dict[str, str] | None = None  # the flattened resolved config (None: unknown)
    code: str | None = None  # git commit the job ran, "+dirty" with uncommitted changes (None: unknown)

    @property
    def usable(self) -> bool:
        return self.status == "FINISHED" and self.value is not None and math.isfinite(self.value)


@dataclass
class Sweep:
    hypothesis: Hypothesis
    runs: list[Run]
    seeds: list[int]  # the grid the sweep asked for (so a job that never started is named too)
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    source: dict[str, Any] = field(default_factory=dict)  # kind, sweep_dir, sweep_id, parent_run_id, ...


# ---------------------------------------------------------------- statistics
def bootstrap_mean_ci(
    diffs: np.ndarray, *, n_boot: int = 10_000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, np.ndarray]:
    """Percentile bootstrap of the mean of ``diffs``; returns (lo, hi, the resampled means)."""
    diffs = np.asarray(diffs, dtype=float)
    if diffs.size == 0:
        raise VerdictError("no paired differences to bootstrap")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diffs.size, size=(n_boot, diffs.size))
    means = diffs[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi), means


IGNORED_PARAMS = ("seed", "hypothesis.arm")  # what legitimately differs between the jobs of a sweep


def design_check(runs: list[Run]) -> tuple[dict[str, list[str]], list[str]]:
    """(keys the arms differ in -> [control value, treatment value], confounds as sentences).

    Confound: within one arm, runs disagree on a param other than the seed (or a param that
    merely repeats the seed), so the arm is not one configuration.
    """
    known = [r for r in runs if r.params is not None]
    confounds: list[str] = []
    canonical: dict[str, dict[str, str]] = {}
    for arm in ARMS:
        mine = [r for r in known if r.arm == arm]
        if not mine:
            continue
        keys = sorted(set().union(*(r.params for r in mine)) - set(IGNORED_PARAMS))
        varying = []
        for k in keys:
            values = {r.seed: r.params.get(k) for r in mine}
            if len(set(values.values())) > 1 and not _is_seed_key(k, mine):
                by_value: dict[str | None, list[int]] = {}
                for seed, v in sorted(values.items()):
                    by_value.setdefault(v, []).append(seed)
                varying.append(f"{k} (" + "; ".join(f"{v} on seed {','.join(map(str, ss))}" for v, ss in by_value.items()) + ")")
        if varying:
            confounds.append(f"the {arm} runs differ in " + ", ".join(varying))
        canonical[arm] = {k: mine[0].params.get(k) for k in keys}
    differ: dict[str, list[str]] = {}
    if len(canonical) == 2:
        c, t = canonical["control"], canonical["treatment"]
        for k in sorted(set(c) | set(t)):
            if c.get(k) != t.get(k) and not _is_seed_key(k, known):
                differ[k] = [str(c.get(k)), str(t.get(k))]
    return differ, confounds


def code_notes(runs: list[Run]) -> list[str]:
    """Warnings about the code the runs executed. Not a confound by itself (a docs-only commit
    changes nothing), but the reader should know the runs are not one code version."""
    notes = []
    commits = sorted({r.code.removesuffix("+dirty")[:7] for r in runs if r.code})
    if len(commits) > 1:
        notes.append(f"the runs span {len(commits)} commits ({', '.join(commits)}): check that the code between them "
                     "does not change training")
    dirty = sorted(f"{r.arm}/seed {r.seed}" for r in runs if r.code and r.code.endswith("+dirty"))
    if dirty:
        notes.append(f"{len(dirty)} run(s) ran with uncommitted changes ({', '.join(dirty)}): git cannot recover "
                     "their exact code")
    return notes


def _is_seed_key(key: str, runs: list[Run]) -> bool:
    """The param merely repeats each run's seed (e.g. a data seed set to ${seed})."""
    return all(r.params.get(key) == str(r.seed) for r in runs)


def judge(sweep: Sweep, *, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Apply the hypothesis' criterion to a sweep's runs. Returns the verdict as plain data."""
    hyp = sweep.hypothesis
    sign = 1.0 if hyp.direction == "increase" else -1.0
    by_cell: dict[tuple[str, int], Run] = {}
    duplicates: list[str] = []
    for run in sweep.runs:
        key = (run.arm, run.seed)
        if key in by_cell:
            duplicates.append(f"{run.arm}/seed {run.seed}")
            if by_cell[key].usable and not run.usable:
                continue  # keep the run that has a value
        by_cell[key] = run

    seeds = sorted(set(sweep.seeds) | {s for _, s in by_cell})
    pairs, missing = [], []
    for s in seeds:
        cells = {arm: by_cell.get((arm, s)) for arm in ARMS}
        for arm, run in cells.items():
            if run is None:
                missing.append({"arm": arm, "seed": s, "status": "MISSING", "reason": "no run (never started)"})
            elif not run.usable:
                missing.append({"arm": arm, "seed": s, "status": run.status, "reason": run.reason, "source": run.source})
        if all(r is not None and r.usable for r in cells.values()):
            c, t = cells["control"].value, cells["treatment"].value
            pairs.append({"seed": s, "control": c, "treatment": t, "diff": t - c})

    arm_means = {}
    for arm in ARMS:
        vals = [r.value for (a, _), r in by_cell.items() if a == arm and r.usable]
        arm_means[arm] = {"mean": float(np.mean(vals)) if vals else None, "n": len(vals)}

    notes: list[str] = []
    verdict: dict[str, Any] = {
        "hypothesis": asdict(hyp),
        "status": "Inconclusive",
        "confidence": None,
        "effect": None,
        "ci": None,
        "ci_level": level,
        "n_pairs": len(pairs),
        "n_seeds": len(seeds),
        "n_boot": n_boot,
        "bootstrap_seed": seed,
        "pairs": pairs,
        "missing": missing,
        "arm_means": arm_means,
        "source": sweep.source,
        "generated_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "notes": notes,
    }
    if missing:
        dropped = sorted({m["seed"] for m in missing})
        notes.append(
            "missing: "
            + "; ".join(f"{m['arm']} seed {m['seed']} {m['status']}" + (f" ({m['reason']})" if m["reason"] else "") for m in missing)
            + f". Seeds {dropped} are left out of the pairing; the verdict rests on {len(pairs)} of {len(seeds)} seeds."
        )
    if duplicates:
        notes.append(f"duplicate runs for {', '.join(sorted(set(duplicates)))}: kept the one with a value (the last seen)")
    differ, confounds = design_check(list(by_cell.values()))
    verdict["arms_differ_in"] = differ
    verdict["confounds"] = confounds
    if differ:
        notes.append("arms differ in " + ", ".join(f"{k} ({c} vs {t})" for k, (c, t) in differ.items()))
    notes.extend(code_notes(list(by_cell.values())))

    if len(pairs) < 2:
        if len(pairs) == 1:
            p = pairs[0]
            verdict["effect"] = p["diff"]
            notes.append(f"one complete seed pair (seed {p['seed']}): effect {p['diff']:+.4f}, no interval from one pair")
        else:
            partial = ", ".join(
                f"{a} mean {m['mean']:.4f} over {m['n']} seed(s)" for a, m in arm_means.items() if m["n"]
            )
            notes.append("no complete seed pair" + (f"; only {partial}" if partial else "; no run has the metric"))
        notes.append("Inconclusive: at least 2 complete seed pairs are needed for an interval")
        return verdict

    diffs = np.array([p["diff"] for p in pairs])
    lo, hi, means = bootstrap_mean_ci(diffs, n_boot=n_boot, level=level, seed=seed)
    effect = float(diffs.mean())
    # Signed so that the predicted direction is positive: one criterion for both directions.
    s_lo, s_hi = sorted((sign * lo, sign * hi))
    p_beyond = float(np.mean(sign * means > hyp.min_effect))
    agree = int(np.sum(sign * diffs > 0))
    verdict["seeds_in_predicted_direction"] = agree
    if s_lo > hyp.min_effect:
        status, confidence = "Validated", p_beyond
    elif s_hi < hyp.min_effect:
        status, confidence = "Invalidated", 1.0 - p_beyond
    else:
        status, confidence = "Inconclusive", max(p_beyond, 1.0 - p_beyond)
        if s_lo > 0:
            notes.append(
                f"the effect has the predicted sign (interval excludes 0; {agree}/{len(pairs)} seeds) but may be "
                f"smaller than the claimed {hyp.min_effect}: {p_beyond:.0%} of bootstrap means exceed it"
            )
        else:
            lean = "validated" if p_beyond >= 0.5 else "invalidated"
            notes.append(f"the {level:.0%} interval straddles min_effect {hyp.min_effect}; {confidence:.0%} of "
                         f"bootstrap means lean {lean}; {agree}/{len(pairs)} seeds in the predicted direction")
    if len(pairs) < 5:
        notes.append(f"only {len(pairs)} seed pairs: a bootstrap over so few values understates the uncertainty")
    if confounds:
        notes.insert(0, f"Confounded ({'; '.join(confounds)}): the numbers would have said {status}; rerun the sweep "
                        "on one configuration")
        status, confidence = "Inconclusive", 0.0
    verdict.update(status=status, confidence=round(confidence, 4), effect=effect, ci=[lo, hi])
    return verdict


# ---------------------------------------------------------------- reading a sweep: files
def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _grid_from_multirun_yaml(sweep_dir: Path) -> dict[str, list[str]]:
    """The sweep's requested values per key, expanded by Hydra's own override parser."""
    path = sweep_dir / "multirun.yaml"
    if not path.exists():
        return {}
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    texts = list(OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or [])
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    texts = [f"{k}={v}" for k, v in params.items()] + texts  # command line wins: parsed last
    grid: dict[str, list[str]] = {}
    for ov in OverridesParser.create().parse_overrides(texts):
        key = ov.get_key_element().lstrip("+~")
        grid[key] = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
    return grid


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
    """Why a job left no metrics: its traceback file (the launcher's), else its Hydra job log."""
    for f in [job_dir / "traceback.txt", job_dir / "error.txt", *sorted(job_dir.glob("*.log"))]:
        if f.exists() and (line := _exception_line(f.read_text(errors="replace"))):
            return line
    return "no metrics.json: the job failed or was killed (see its log)"


def load_multirun(sweep_dir: str | Path) -> Sweep:
    """Read a Hydra multirun directory: each job's .hydra/config.yaml and metrics.json."""
    from omegaconf import OmegaConf

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise VerdictError(f"sweep directory {sweep_dir} does not exist")
    job_cfgs = sorted(p for p in sweep_dir.glob("**/.hydra/config.yaml") if ".submitit" not in p.parts)
    grid = _grid_from_multirun_yaml(sweep_dir)
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
        metrics_path = job_dir / "metrics.json"
        if metrics_path.exists():
            metrics = _flatten(json.loads(metrics_path.read_text()))
            value = metrics.get(hyp.metric)
            if value is None:
                runs.append(Run(arm, seed, "FINISHED", None, str(job_dir),
                                f"metrics.json has no {hyp.metric!r} (has {', '.join(sorted(metrics)[:8])} ...)",
                                params=params))
            else:
                runs.append(Run(arm, seed, "FINISHED", float(value), str(job_dir), params=params))
        else:
            runs.append(Run(arm, seed, "FAILED", None, str(job_dir), _read_failure(job_dir), params=params))
    if hyp is None:
        if grid.get("+sweep") or grid.get("sweep") or grid.get("hypothesis"):
            name = (grid.get("+sweep") or grid.get("sweep") or grid.get("hypothesis"))[0]
            hyp = load_hypothesis_file(name)
        else:
            raise VerdictError(f"{sweep_dir} holds no job (no */.hydra/config.yaml) and names no hypothesis")
    seeds = [int(s) for s in grid.get("seed", [])]
    return Sweep(hyp, runs, seeds, source={"kind": "files", "sweep_dir": str(sweep_dir)})


def _job_params(cfg: Any) -> dict[str, str]:
    """A job's saved config as the params MLflow would hold (resolved where our resolvers can)."""
    from omegaconf import OmegaConf

    from musique_rl import schema, tracking

    schema.register()
    try:
        return tracking.config_params(cfg)
    except Exception:  # e.g. a ${hydra:...} interpolation outside a Hydra run: compare unresolved
        return {k: str(v) for k, v in tracking.flatten(OmegaConf.to_container(cfg, resolve=False)).items()}


def load_hypothesis_file(name: str) -> Hypothesis:
    from omegaconf import OmegaConf

    path = HYPOTHESIS_DIR / f"{name}.yaml"
    if not path.exists():
        raise VerdictError(f"no hypothesis {name!r}: expected {path}")
    return Hypothesis.from_mapping(OmegaConf.load(path).hypothesis, str(path))


# ---------------------------------------------------------------- reading a sweep: MLflow
def default_tracking_uri(explicit: str | None = None) -> str:
    """The jobs' store (tracking.tracking_uri): explicit, else $MLFLOW_TRACKING_URI, else ./mlflow.db."""
    from musique_rl.tracking import tracking_uri

    return explicit or tracking_uri(None, Path.cwd())


def sweep_ids_for_dir(sweep_dir: Path) -> list[str]:
    """The sweep_id tag of a multirun directory's runs: the `sweep_id` file tracking.SweepCallback
    leaves in it, else what tracking.sweep_id_of derives from the path."""
    from musique_rl.tracking import sweep_id_of

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


def _metric_from_job_dir(output_dir: str | None, metric: str) -> float | None:
    """A run that logged its summary only to metrics.json (job dir) still counts."""
    if not output_dir or not (Path(output_dir) / "metrics.json").exists():
        return None
    value = _flatten(json.loads((Path(output_dir) / "metrics.json").read_text())).get(metric)
    return None if value is None else float(value)


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
        ids = [latest]
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
    out: list[Run] = []
    for r in jobs:
        status = r.info.status
        if sweep_ended and status in ("RUNNING", "SCHEDULED"):
            status = "KILLED"
        value = r.data.metrics.get(hyp.metric)
        if value is None and status == "FINISHED":
            value = _metric_from_job_dir(r.data.tags.get("output_dir"), hyp.metric)
        reason = ""
        if status != "FINISHED":
            reason = f"run ended {status}" if status in ("FAILED", "KILLED") else f"run still {status}"
            if status == "KILLED" and r.info.status != "KILLED":
                reason = "its process died without ending the run (killed)"
            err = r.data.tags.get("error") or r.data.tags.get("exception")
            if err:
                reason += f": {err[:200]}"
        elif value is None:
            reason = f"run has no metric {hyp.metric!r}"
        sha = r.data.tags.get("git_commit")
        code = None if sha in (None, "unknown") else sha + ("+dirty" if r.data.tags.get("git_dirty") == "true" else "")
        out.append(Run(r.data.tags[TAG_ARM], int(r.data.tags[TAG_SEED]), status, value, r.info.run_id, reason,
                       params=dict(r.data.params) or None, code=code))
    seeds = sorted({int(r.data.tags[TAG_SEED]) for r in jobs})
    source = {
        "kind": "mlflow",
        "tracking_uri": uri,
        "sweep_id": jobs[0].data.tags.get(TAG_SWEEP),
        "parent_run_id": parents[0].info.run_id if parents else jobs[0].data.tags.get(TAG_PARENT),
        "experiment_id": jobs[0].info.experiment_id,
    }
    return Sweep(hyp, out, seeds, source=source)


def load_sweep(sweep: str | None = None, experiment: str | None = None, tracking_uri: str | None = None,
               prefer: str = "auto", sweep_ended: bool = False) -> Sweep:
    """MLflow first (it also knows jobs that died before writing files), the directory as fallback.

    The directory still supplies the requested grid, so a job that never started is named.
    """
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
        latest = _latest_multirun_for(experiment)
        if latest is not None:
            return load_multirun(latest)
    raise VerdictError(
        f"no runs found for {sweep or experiment!r}: not a directory, no MLflow runs tagged "
        f"{TAG_SWEEP}={sweep!r} in {default_tracking_uri(tracking_uri)}"
    )


def _latest_multirun_for(hyp_id: str, root: Path = Path("multirun")) -> Path | None:
    from omegaconf import OmegaConf

    best: tuple[float, Path] | None = None
    for cfg_path in root.glob("**/.hydra/config.yaml"):
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


# ---------------------------------------------------------------- writing
def summary_line(v: dict[str, Any]) -> str:
    h = v["hypothesis"]
    parts = []
    if v["ci"] is not None:
        parts.append(
            f"effect {v['effect']:+.4f} [{v['ci_level']:.0%} CI {v['ci'][0]:+.4f}, {v['ci'][1]:+.4f}] on {h['metric']}"
        )
    elif v["effect"] is not None:
        parts.append(f"effect {v['effect']:+.4f} on {h['metric']} (one pair)")
    parts.append(f"predicted {h['direction']} by > {h['min_effect']}")
    parts.append(f"{v['n_pairs']}/{v['n_seeds']} seed pairs")
    if v.get("seeds_in_predicted_direction") is not None:
        parts.append(f"{v['seeds_in_predicted_direction']}/{v['n_pairs']} in the predicted direction")
    return "; ".join(parts)


def table_row(v: dict[str, Any]) -> dict[str, str]:
    h = v["hypothesis"]
    where = v["source"].get("sweep_dir") or v["source"].get("sweep_id") or ""
    notes = summary_line(v)
    if v.get("confounds"):
        notes = "CONFOUNDED: " + "; ".join(v["confounds"]) + "; " + notes
    if v["missing"]:
        notes += "; missing " + ", ".join(f"{m['arm']}/seed {m['seed']} ({m['status']})" for m in v["missing"])
    notes += f"; {where} {v['generated_at'][:10]}".rstrip()
    return {
        "hypothesis": f"{h['id']} {h['title']}".strip(),
        "priority": h["priority"],
        "status": v["status"],
        "confidence": "" if v["confidence"] is None else f"{v['confidence']:.2f}",
        "notes": notes,
    }


COLUMNS = ("hypothesis", "priority", "status", "confidence", "notes")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def render_table(rows: dict[str, dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for hid in sorted(rows):
        lines.append("| " + " | ".join(_cell(rows[hid][c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def _all_hypotheses() -> dict[str, dict[str, str]]:
    """A "not run" row for every hypothesis in conf/hypothesis/, so the table lists them all."""
    rows = {}
    for path in sorted(HYPOTHESIS_DIR.glob("h*.yaml")):
        try:
            h = load_hypothesis_file(path.stem)
        except VerdictError:
            continue
        rows[h.id] = {"hypothesis": f"{h.id} {h.title}".strip(), "priority": h.priority,
                      "status": "Not run", "confidence": "", "notes": ""}
    return rows


def _existing_rows(text: str) -> dict[str, dict[str, str]]:
    """Rows of the previously generated table (this module wrote them; format known)."""
    rows = {}
    if MARK_START not in text or MARK_END not in text:
        return rows
    block = text.split(MARK_START, 1)[1].split(MARK_END, 1)[0]
    for line in block.splitlines():
        cells = _split_row(line) if line.startswith("|") else []
        # rows only: the header's first cell is "hypothesis", a row's starts with an id (h01 ...)
        if len(cells) == len(COLUMNS) and re.fullmatch(r"h\d+", cells[0].split()[0] if cells[0] else ""):
            rows[cells[0].split()[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def status_table(verdict: dict[str, Any], readme_text: str = "") -> str:
    rows = _all_hypotheses()
    rows.update(_existing_rows(readme_text))
    rows[verdict["hypothesis"]["id"]] = table_row(verdict)
    return render_table(rows)


def update_readme(table: str, readme: Path = README) -> None:
    """Replace only what lies between the markers; append the markers at the end if absent."""
    text = readme.read_text() if readme.exists() else ""
    block = f"{MARK_START}\n<!-- generated by `python -m musique_rl.verdict`; do not edit by hand -->\n{table}\n{MARK_END}"
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        tail = rest.split(MARK_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    readme.write_text(text)


def publish(verdict: dict[str, Any], *, out: Path | None = None, readme: Path | None = README) -> dict[str, str]:
    """Write verdict.json and status.md; update README's section; attach both to the parent run."""
    src = verdict["source"]
    out_dir = out if out is not None else Path(src["sweep_dir"]) if src.get("sweep_dir") else Path.cwd()
    out_dir.mkdir(parents=True, exist_ok=True)
    readme_text = readme.read_text() if readme is not None and readme.exists() else ""
    table = status_table(verdict, readme_text)
    written = {}
    (out_dir / "verdict.json").write_text(json.dumps({**verdict, "status_table": table}, indent=2) + "\n")
    (out_dir / "status.md").write_text(table + "\n")
    written["verdict.json"] = str(out_dir / "verdict.json")
    written["status.md"] = str(out_dir / "status.md")
    if readme is not None:
        update_readme(table, readme)
        written["readme"] = str(readme)
    parent = src.get("parent_run_id")
    if parent:
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=src.get("tracking_uri"))
            client.log_artifact(parent, written["verdict.json"])
            client.log_artifact(parent, written["status.md"])
            client.set_tag(parent, "verdict", verdict["status"])
            written["mlflow_parent_run"] = parent
        except Exception as exc:  # the files are written; a tracking hiccup must not lose them
            log.warning("could not attach the verdict to MLflow run %s: %s", parent, exc)
    return written


def report(verdict: dict[str, Any]) -> str:
    h = verdict["hypothesis"]
    conf = "" if verdict["confidence"] is None else f" (confidence {verdict['confidence']:.2f})"
    lines = [f"{h['id']} {h['title']}: {verdict['status']}{conf}", "  " + summary_line(verdict)]
    for p in verdict["pairs"]:
        lines.append(f"  seed {p['seed']}: control {p['control']:.4f}  treatment {p['treatment']:.4f}  diff {p['diff']:+.4f}")
    lines += [f"  note: {n}" for n in verdict["notes"]]
    return "\n".join(lines)


def run_verdict(sweep: str | None = None, experiment: str | None = None, *, tracking_uri: str | None = None,
                prefer: str = "auto", n_boot: int = 10_000, level: float = 0.95, seed: int = 0,
                out: Path | None = None, readme: Path | None = README, sweep_ended: bool = False) -> dict[str, Any]:
    swp = load_sweep(sweep, experiment, tracking_uri, prefer, sweep_ended)
    verdict = judge(swp, n_boot=n_boot, level=level, seed=seed)
    verdict["written"] = publish(verdict, out=out, readme=readme)
    return verdict


# ---------------------------------------------------------------- Hydra callback
try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a hard dependency
    Callback = object  # type: ignore[misc,assignment]


def _swept_values(config: Any, key: str) -> list[str]:
    """The values a multirun sweeps `key` over: the sweeper's params (named sweeps) or the
    command line's `key=a,b` (a grid written by hand)."""
    from omegaconf import OmegaConf

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    text = params.get(key)
    for override in OmegaConf.select(config, "hydra.overrides.task", default=None) or []:
        name, _, value = str(override).partition("=")
        if name.lstrip("+~") == key:
            text = value
    return [v.strip() for v in str(text).split(",")] if text is not None else []


class VerdictCallback(Callback):
    """Judges the sweep when it ends (``hydra.callbacks.verdict``: conf/train.yaml registers it for
    every multirun, README table off; sweeps/_base.yaml turns the README table on). It judges
    only a multirun of a hypothesis that sweeps both arms.

    Hydra calls ``on_multirun_end`` only when every job succeeded: the basic sweeper re-raises
    the first failed job's exception first. So the verdict is also registered at exit, which runs
    it once after a failed sweep too: a killed or failed job then shows up as a named gap.
    """

    def __init__(self, readme: bool = True, n_boot: int = 10_000, level: float = 0.95) -> None:
        self.readme, self.n_boot, self.level = readme, n_boot, level
        self._sweep_dir: str | None = None
        self._tracking_uri: str | None = None
        self._done = False

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        from musique_rl.tracking import tracking_uri

        if OmegaConf.select(config, "hypothesis", default=None) is None:
            return  # not a hypothesis sweep (safe to register for every multirun)
        if set(_swept_values(config, "hypothesis.arm")) != set(ARMS):
            log.info("verdict skipped: the multirun does not sweep hypothesis.arm=control,treatment")
            return
        self._sweep_dir = str(config.hydra.sweep.dir)
        self._tracking_uri = tracking_uri(config, Path.cwd())
        atexit.register(self._judge)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._judge()

    def _judge(self) -> None:
        if self._done or self._sweep_dir is None:
            return
        self._done = True
        try:
            v = run_verdict(self._sweep_dir, tracking_uri=self._tracking_uri, n_boot=self.n_boot,
                            level=self.level, readme=README if self.readme else None, sweep_ended=True)
            print("\n" + report(v) + f"\n  written: {v['written']}", flush=True)
        except Exception as exc:  # a verdict problem must not turn a finished sweep into an error
            log.error("verdict for %s failed: %s", self._sweep_dir, exc)
            print(f"verdict for {self._sweep_dir} failed: {exc}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m musique_rl.verdict", description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--sweep", help="multirun directory or MLflow sweep_id tag value")
    which.add_argument("--experiment", help="hypothesis id (hNN): judge its latest sweep")
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    ap.add_argument("--source", choices=["auto", "mlflow", "files"], default="auto")
    ap.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples")
    ap.add_argument("--level", type=float, default=0.95, help="interval level")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed")
    ap.add_argument("--out", type=Path, default=None, help="directory for verdict.json (default: the sweep dir)")
    ap.add_argument("--readme", type=Path, default=README, help="README whose verdicts section is rewritten")
    ap.add_argument("--no-readme", action="store_true", help="leave README untouched")
    args = ap.parse_args(argv)
    try:
        v = run_verdict(args.sweep, args.experiment, tracking_uri=args.tracking_uri, prefer=args.source,
                        n_boot=args.n_boot, level=args.level, seed=args.seed, out=args.out,
                        readme=None if args.no_readme else args.readme)
    except VerdictError as exc:
        print(f"verdict: {exc}", file=sys.stderr)
        return 2
    print(report(v))
    print(f"  written: {v['written']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
