"""The doctor's command line: ``python -m musique_rl.doctor``.

    python -m musique_rl.doctor --run-dir outputs/2026-11-24/01-00-00   # a run dir (metrics.jsonl)
    python -m musique_rl.doctor --from out/checkpoint-500               # a TRL run's trainer_state.json
    python -m musique_rl.doctor --from wandb_export.csv history.jsonl  # tables; several: a triage table
    python -m musique_rl.doctor --from mlflow:<run id> --tracking-uri sqlite:///mlflow.db
    python -m musique_rl.doctor --run-id <id>          # one run of this project in MLflow
    python -m musique_rl.doctor --experiment h02       # every run of an experiment

Reads each input (doctor/sources.py), diagnoses it (doctor/diagnose.py), writes its diagnosis.json and
prints what doctor/report.py makes of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from musique_rl.base import rundir
from musique_rl.doctor.diagnose import diagnose_log, diagnose_run, save_diagnosis, write_diagnosis
from musique_rl.doctor.report import format_diagnosis, triage_table


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
            print(f"== {name} ({run.source}): top = {diag.top_hypothesis}")
            for note in run.notes:
                print(f"   note: {note}")
            print(format_diagnosis(diag, verbose_missing=True))
            if dest is not None:
                print(f"   written: {dest}")
            print()
    if args.json or args.out == "-":
        as_json = {name: diag.to_json() for name, diag in results.items()}
        print(json.dumps(as_json if len(specs) > 1 else next(iter(as_json.values()), []), indent=2))
    elif len(rows) > 1:
        print(triage_table(rows))
    return 2 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    from musique_rl.doctor import diagnose

    p = argparse.ArgumentParser(prog="python -m musique_rl.doctor", description=diagnose.__doc__.split("\n")[0])
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
            print(f"== run {run.info.run_id} ({name}, {run.info.status}): top = {diag.top_hypothesis}")
            print(format_diagnosis(diag))
            print()
    if args.experiment and not args.json:
        counts: dict[str, int] = {}
        for diag in results.values():
            for h in dict.fromkeys(f.hypothesis for f in diag.flagged):
                counts[h] = counts.get(h, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        print(f"experiment {args.experiment}: {len(results)} runs; flagged: "
              + (", ".join(f"{h} in {n}" for h, n in ranked) or "none"))
    if args.json:
        as_json = {run_id: diag.to_json() for run_id, diag in results.items()}
        print(json.dumps(as_json if args.experiment else next(iter(as_json.values())), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
