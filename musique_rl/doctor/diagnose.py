"""The doctor: reads a run's metrics and names the broken part, reasoning along the GRPO step.

    python -m musique_rl.doctor --run-dir outputs/2026-11-24/01-00-00   # a run dir (metrics.jsonl)
    python -m musique_rl.doctor --from out/checkpoint-500               # a TRL run's trainer_state.json
    python -m musique_rl.doctor --from wandb_export.csv history.jsonl  # tables; several: a triage table
    python -m musique_rl.doctor --from mlflow:<run id> --tracking-uri sqlite:///mlflow.db
    python -m musique_rl.doctor --run-id <id>          # one run of this project in MLflow
    python -m musique_rl.doctor --experiment h02       # every run of an experiment

How it reasons (docs/diagnostics.md, "The chain"):

1. every rule judges its metrics (rules live one module per stage, doctor/stages/: the
   invariants, field alarms and TRL-name rules in the stage they judge), against thresholds from the metric catalogue
   (base/catalogue.py) and expectations from the run's own context (doctor/context.py:
   learning-rate schedule, backend, dtype floor, materiality);
2. claims another stage's evidence contradicts are withdrawn, with the reason (context.py);
3. the chain (doctor/chain.py) places every finding in its stage of the step and names the
   causes (rank 1: the one to act on) with the consequences each explains listed under it.

severity = tier + magnitude, tier 3 = direct proof (a count that must be 0 is not, a sign that
cannot be negative is), tier 2 = a quantitative fingerprint past a principled threshold, tier 1 =
a symptom with other possible causes; magnitude in [0, 1) = how far past the threshold, in orders
of magnitude / 3. A clean run must produce no flagged finding. The readers of each place logs live
(run dir, trainer_state.json, MLflow, CSV/JSONL) are in doctor/sources.py; the text a user
reads is doctor/report.py. Every training run writes `diagnosis.json` into its run directory
after training, from its own metrics.jsonl (musique_rl.job.app), tracking on or off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from musique_rl import rundir
from musique_rl.base.catalogue import (  # noqa: F401  (re-exported: the thresholds' old home)
    AMPLIFICATION_MAX,
    BUDGET_SHARE_MAX,
    CHECKSUM_DRIFT_MAX,
    HYPOTHESES,
    KL_NEGATIVE_MAX,
    LOGP_GAP_MAX,
    TOOL_FAILURE_MAX,
    UPDATE_RATIO_MIN,
)

# Rules registered in their own modules (@rule): imported for their registration. stages: one
# module per stage of the step (the checks read where the loss consumes its inputs among them).
# (stages first, then reward_power: the rules run in the order they register)
from musique_rl.doctor import reward_power, stages  # noqa: F401  (imported for their @rule registrations)
from musique_rl.doctor.chain import reason, stage_of
from musique_rl.doctor.context import FLOOR_MULTIPLE, GAP_ABS_MIN, gap_threshold, withdraw  # noqa: F401
from musique_rl.doctor.findings import RULES, Finding, History, rule  # noqa: F401
from musique_rl.doctor.report import (  # noqa: F401  (the doctor's public API since its first version)
    diagnosis_tags,
    format_diagnosis,
    stage_health,
    top_finding,
    top_flagged,
    triage_table,
)
from musique_rl.doctor.reward_power import NEXT_SWEEPS  # noqa: F401
from musique_rl.doctor.stages.loss import IS_WEIGHT_KEY  # noqa: F401
from musique_rl.doctor.trend import FLAT_MIN_POINTS, FLAT_P, reward_trend  # noqa: F401


def _consequence_words(f: Finding, cause: Finding, via: Finding) -> str:
    through = "" if via is cause else f" (through {via.hypothesis} {via.check})"
    return (f"A consequence of {cause.hypothesis} {cause.check} ({stage_of(cause)} stage){through}, not a "
            f"separate cause: fix that first. {f.verdict}")


def diagnose_metrics(metrics: Mapping[str, History], params: Mapping[str, str] | None = None,
                     strict: bool = False) -> list[dict[str, Any]]:
    """Ranked diagnosis from metric histories {key: [(step, value), ...]} and the run's params.

    Each entry: hypothesis, check, flagged, severity, verdict, evidence, rank (the contract of
    diagnosis.json), and stage, role (cause / consequence / note / withdrawn / ok / no_data),
    explained_by + cause_rank (a consequence's root cause), consequences (a cause's), reason (why a
    claim was withdrawn). ``strict``: a rule that reads a metric by name it did not declare
    (``@rule(reads=...)``) raises (the tests run every stored history so)."""
    params = params or {}
    findings: list[Finding] = []
    for r in RULES:
        if not r.last:
            findings.extend(r(metrics, params, strict=strict))
    withdraw(findings, metrics, params)
    for r in RULES:
        if r.last:  # the rules over the others' findings (the flat reward), after the withdrawals
            findings.extend(r(metrics, params, findings, strict=strict))
    seen = {f.hypothesis for f in findings}
    for h in HYPOTHESES:
        if h.unmeasured and h.id not in seen:
            findings.append(Finding(h.id, "no_data", False, 0.0, "No data for this hypothesis in this log: "
                                    + h.unmeasured + "."))
    ordered, roles = reason(findings)
    rank_of = {id(f): r for r, f in enumerate(ordered, start=1)}
    out = []
    for f in ordered:
        role = roles[id(f)]
        verdict = f.verdict
        d: dict[str, Any] = {"hypothesis": f.hypothesis, "check": f.check, "flagged": f.flagged,
                             "severity": round(f.severity, 3), "verdict": verdict,
                             "evidence": {k: (float(v) if v is not None else None) for k, v in f.evidence.items()},
                             "rank": rank_of[id(f)], "stage": stage_of(f), "role": role.role}
        if role.role == "consequence" and role.explained_by is not None:
            d["verdict"] = _consequence_words(f, role.explained_by, role.via or role.explained_by)
            d["explained_by"] = f"{role.explained_by.hypothesis} {role.explained_by.check}"
            d["cause_rank"] = rank_of[id(role.explained_by)]
        if role.role == "cause":
            d["consequences"] = [f"{c.hypothesis} {c.check}" for c in ordered
                                 if roles[id(c)].role == "consequence" and roles[id(c)].explained_by is f]
        if f.reason:
            d["reason"] = f.reason
        out.append(d)
    return out


# ---------------------------------------------------------------- MLflow I/O (reader: sources.read_mlflow)
def read_run_metrics(run_id: str, uri: str | None = None) -> tuple[dict[str, History], dict[str, str], Any]:
    """Histories of every metric, the params and the run name of one MLflow run (sources.read_mlflow)."""
    from musique_rl.doctor.sources import read_mlflow

    run = read_mlflow(run_id, uri)
    return run.histories, run.params, run


def diagnose_run(run_id: str, uri: str | None = None) -> list[dict[str, Any]]:
    """The ranked diagnosis of one MLflow run (see module docstring)."""
    hist, params, _ = read_run_metrics(run_id, uri)
    return diagnose_metrics(hist, params)


def write_diagnosis(run_id: str, diagnosis: list[dict[str, Any]], uri: str | None = None) -> None:
    """Save `diagnosis.json` as an artifact of the run and tag the run with its top flagged hypothesis."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.log_text(run_id, json.dumps(diagnosis, indent=2), rundir.DIAGNOSIS)
    for key, value in diagnosis_tags(diagnosis).items():
        client.set_tag(run_id, key, value)


def diagnose_log(run: Any) -> list[dict[str, Any]]:
    """The ranked diagnosis of a ``sources.RunLog`` (any place a run's logs live)."""
    return diagnose_metrics(run.histories, run.params)


def save_diagnosis(diagnosis: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``diagnosis.json`` at ``path`` (written whole, then moved into place: a reader never sees half)."""
    return rundir.write_diagnosis(path, list(diagnosis))


def _default_uri(arg: str | None) -> str:
    # The default of tracking.tracking_uri() outside a Hydra job, spelled here so that the doctor
    # (diagnostics layer) does not import the experiment layer that runs it.
    return arg or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


# Where --from writes when not told (--out): one folder per input under the working directory, never
# beside the input (several logs in one folder would overwrite each other's diagnosis.json) and
# never over another input's result (SOURCE_NOTE names the input each folder's result is for).
RESULTS_DIR = "doctor_results"
SOURCE_NOTE = "source.txt"


def _own_run_dir(run: Any) -> bool:
    """A run directory of this project: its diagnosis.json belongs in it (one run per directory)."""
    from musique_rl.doctor.sources import RUN_METRICS

    return run.home is not None and (Path(run.home) / RUN_METRICS).is_file()


def _slug(text: str) -> str:
    return re.sub(r"[^\w.-]+", "_", text).strip("_") or "run"


def result_path(run: Any, name: str, spec: str, kind: str, out: str | None, several: bool) -> Path:
    """Where one input's diagnosis.json goes: a run dir of this project: inside it (unless --out);
    --out DIR: DIR/diagnosis.json (one input) or DIR/<run name>/diagnosis.json (several);
    otherwise ./doctor_results/<run name>/diagnosis.json, with -2, -3... when that folder already
    holds the result of another input."""
    if out:
        return (Path(out) / _slug(name) if several else Path(out)) / rundir.DIAGNOSIS
    if kind == "run-dir" or _own_run_dir(run):
        return Path(run.home) / rundir.DIAGNOSIS
    base = Path.cwd() / RESULTS_DIR / _slug(name)
    home, n = base, 1
    while (home / SOURCE_NOTE).is_file() and (home / SOURCE_NOTE).read_text().strip() != spec:
        n += 1
        home = base.with_name(f"{base.name}-{n}")
    return home / rundir.DIAGNOSIS


def _from_files(args: argparse.Namespace) -> int:
    """--from / --run-dir: read each input, diagnose, write diagnosis.json; several: a triage table."""
    from musique_rl.doctor.sources import SourceError, open_source, read_run_dir

    specs = [("run-dir", d) for d in args.run_dir or []] + [("from", f) for f in args.sources or []]
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    rows, results, bad = [], {}, 0
    for kind, spec in specs:
        try:
            run = read_run_dir(spec) if kind == "run-dir" else open_source(spec, uri)
        except (SourceError, OSError) as e:
            print(f"doctor: cannot read --{kind} {spec}: {e}", file=sys.stderr)
            bad += 1
            continue
        diag = diagnose_log(run)
        name = run.name if run.name not in results else f"{run.name} [{spec}]"
        results[name] = diag
        rows.append((name, diag))
        dest = None
        if not args.no_write and args.out != "-":
            dest = result_path(run, name, spec, kind, args.out, several=len(specs) > 1)
            try:
                save_diagnosis(diag, dest)
                if run.home is None or dest.parent.resolve() != Path(run.home).resolve():
                    (dest.parent / SOURCE_NOTE).write_text(spec + "\n")
            except OSError as e:
                print(f"doctor: cannot write {dest}: {e} (use --out DIR, or --out - for stdout)", file=sys.stderr)
                dest = None
        if not args.json and args.out != "-":
            print(f"== {name} ({run.source}): top = {top_flagged(diag)}")
            for note in run.notes:
                print(f"   note: {note}")
            print(format_diagnosis(diag, verbose_missing=True))
            if dest is not None:
                print(f"   written: {dest}")
            print()
    if args.json or args.out == "-":
        print(json.dumps(results if len(specs) > 1 else next(iter(results.values()), []), indent=2))
    elif len(rows) > 1:
        print(triage_table(rows))
    return 2 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.doctor", description=__doc__.split("\n")[0])
    g = p.add_argument_group("what to diagnose (one or more)")
    g.add_argument("--from", dest="sources", nargs="+", metavar="PATH_OR_RUN",
                   help="a run directory, trainer_state.json (or a checkpoint / output dir), a CSV or JSONL "
                        "metrics table, or mlflow:<run id> / runs:/<run id>; several give a triage table")
    g.add_argument("--run-dir", nargs="+", metavar="DIR", help="a run directory of this project (its metrics.jsonl)")
    g.add_argument("--run-id", help="diagnose one MLflow run of this project")
    g.add_argument("--experiment", help="diagnose every finished or failed run of an MLflow experiment (name)")
    p.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    p.add_argument("--out", default=None, help="--from/--run-dir: write diagnosis.json into this directory (several "
                                               "inputs: one subdirectory each); '-': print the JSON to stdout. "
                                               f"Default: a run dir's own directory; any other input: ./{RESULTS_DIR}/<run>/")
    p.add_argument("--no-write", action="store_true", help="--from/--run-dir: print only")
    p.add_argument("--write", action="store_true", help="--run-id/--experiment: also save diagnosis.json to each run")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    args = p.parse_args(argv)
    chosen = [bool(args.sources or args.run_dir), bool(args.run_id), bool(args.experiment)]
    if sum(chosen) != 1:
        p.error("give --from/--run-dir, or --run-id, or --experiment")
    if args.sources or args.run_dir:
        return _from_files(args)

    from mlflow.tracking import MlflowClient

    uri = _default_uri(args.tracking_uri)
    client = MlflowClient(uri)
    if args.run_id:
        runs = [client.get_run(args.run_id)]
    else:
        exp = client.get_experiment_by_name(args.experiment)
        if exp is None:
            print(f"no experiment named {args.experiment!r} in {uri}", file=sys.stderr)
            return 2
        runs = [r for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
                if r.data.tags.get("sweep_parent") != "true"]
    results = {}
    for run in runs:
        diag = diagnose_run(run.info.run_id, uri)
        results[run.info.run_id] = diag
        if args.write:
            write_diagnosis(run.info.run_id, diag, uri)
        if not args.json:
            name = run.data.tags.get("mlflow.runName", "")
            print(f"== run {run.info.run_id} ({name}, {run.info.status}): top = {top_flagged(diag)}")
            print(format_diagnosis(diag))
            print()
    if args.experiment and not args.json:
        counts: dict[str, int] = {}
        for diag in results.values():
            for h in dict.fromkeys(d["hypothesis"] for d in diag if d["flagged"]):
                counts[h] = counts.get(h, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        print(f"experiment {args.experiment}: {len(results)} runs; flagged: "
              + (", ".join(f"{h} in {n}" for h, n in ranked) or "none"))
    if args.json:
        print(json.dumps(results if args.experiment else next(iter(results.values())), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
