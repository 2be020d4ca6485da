"""Every history the repository holds, diagnosed, one canonical JSON per case: proof that a
restructuring of the doctor changed no conclusion.

    python benchmarks/snapshot_diagnoses.py --out /tmp/snap-before              # at the old commit
    python benchmarks/snapshot_diagnoses.py --out /tmp/snap-after --compare /tmp/snap-before
    python benchmarks/snapshot_diagnoses.py --out DIR --runs 'faultruns/*/*'     # + run dirs of a fault grid

Cases (each read by the doctor's own readers, so the readers are re-judged too):

- every run dir under tests/fixtures/ (``metrics.jsonl``: doctor/, gpu_shaped/, healthy_runs/) and
  every ``trainer_state.json`` there (doctor/, trl_runs/: the checkpoint directory);
- trl_runs' other exports of the same runs (``history.jsonl``, ``wandb_export.csv``) and its two
  MLflow runs (read from a copy of ``mlflow_store.db``: the reader must not touch the fixture);
- the public logs, ``$MUSIQUE_RL_DATA/public_logs/<name>/trainer_state.json`` ($MUSIQUE_RL_DATA
  defaulting to shared/ inside or beside the checkout), or ``--public-logs DIR``, when present;
- ``--runs GLOB``: run dirs (``metrics.jsonl``) of jobs run elsewhere, e.g. a planted-fault grid.

Each case's file holds the diagnosis exactly as ``diagnosis.json`` writes it, the run tags it sets,
the text the doctor prints (``format_diagnosis`` with the hypotheses no instrument measured) and the
chain line's stage health; ``_triage.json`` holds the triage table of every case. ``--compare DIR``
diffs each file byte for byte against an earlier snapshot and exits 1 on any difference or any case
present on one side only.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's doctor, not the editable install's

FIXTURES = ROOT / "tests" / "fixtures"
# the public logs lie in public_logs/ of the folder of data outside this repository ($MUSIQUE_RL_DATA,
# default shared/ inside or beside the checkout: docs/howto/setup.md), as for benchmarks/false_alarms.py
PUBLIC_LOG_DIRS = tuple(Path(d) / "public_logs" for d in
                        ([os.environ["MUSIQUE_RL_DATA"]] if os.environ.get("MUSIQUE_RL_DATA") else [])
                        + [ROOT / "shared", ROOT.parent / "shared"])


def _doctor() -> tuple[Any, Any, Any]:
    """(the doctor's sources module, its diagnose function, its report module). Older checkouts held
    the doctor in ``diagnostics/``: a snapshot is taken at the commit before a change and compared with
    one after it, so the script reads whichever layout the checkout has."""
    for sources, run, report in (("musique_rl.doctor.sources", "musique_rl.doctor.diagnose", "musique_rl.doctor.report"),
                                 ("musique_rl.diagnostics.sources", "musique_rl.diagnostics.doctor",
                                  "musique_rl.diagnostics.report")):
        try:
            s, r, rep = (importlib.import_module(m) for m in (sources, run, report))
        except ModuleNotFoundError:
            continue
        return s, r.diagnose_log, rep
    raise SystemExit("no doctor found in this checkout")


def cases(public_logs: Path | None, runs: list[str]) -> Iterator[tuple[str, str, Callable[[Any], Any]]]:
    """(case name, what it reads, reader(sources module) -> RunLog), in a fixed order."""
    sources, _, _ = _doctor()  # the file names from the checkout's own readers (RUN_METRICS, TRAINER_STATE)
    for m in sorted(FIXTURES.rglob(sources.RUN_METRICS)):
        d = m.parent
        yield f"run_dir/{d.relative_to(FIXTURES)}", str(d.relative_to(ROOT)), lambda s, d=d: s.read_run_dir(d)
    for t in sorted(FIXTURES.rglob(sources.TRAINER_STATE)):
        yield (f"trainer_state/{t.parent.relative_to(FIXTURES)}", str(t.relative_to(ROOT)),
               lambda s, t=t: s.read_trainer_state(t))
    for name in ("history.jsonl", "wandb_export.csv"):
        for t in sorted(FIXTURES.rglob(name)):
            yield f"table/{t.relative_to(FIXTURES)}", str(t.relative_to(ROOT)), lambda s, t=t: s.read_table(t)
    ids_file = FIXTURES / "trl_runs" / "mlflow_runs.json"
    if ids_file.is_file():
        for name, run_id in sorted(json.loads(ids_file.read_text()).items()):
            yield f"mlflow/{name}", f"mlflow:{run_id}", lambda s, run_id=run_id: _read_mlflow(s, run_id)
    if public_logs is not None:
        for t in sorted(public_logs.glob("*/trainer_state.json")):
            yield f"public/{t.parent.name}", f"public_logs/{t.parent.name}", lambda s, t=t: s.read_trainer_state(t)
    for pattern in runs:
        for m in sorted(glob.glob(str(Path(pattern) / sources.RUN_METRICS))):
            d = Path(m).parent
            yield f"runs/{d.parent.name}/{d.name}", str(d), lambda s, d=d: s.read_run_dir(d)


_STORE: dict[str, str] = {}


def _read_mlflow(sources: Any, run_id: str) -> Any:
    if "uri" not in _STORE:  # one copy of the store per snapshot (MLflow may migrate what it opens)
        tmp = Path(tempfile.mkdtemp(prefix="snapshot-mlflow-"))
        shutil.copy(FIXTURES / "trl_runs" / "mlflow_store.db", tmp / "mlflow.db")
        _STORE["uri"] = f"sqlite:///{tmp / 'mlflow.db'}"
    return sources.read_mlflow(run_id, _STORE["uri"])


def _file_name(case: str) -> str:
    return case.replace("/", "__") + ".json"


def snapshot(out: Path, public_logs: Path | None, runs: list[str]) -> int:
    sources, diagnose_log, report = _doctor()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    n = 0
    for case, spec, read in cases(public_logs, runs):
        diagnosis = diagnose_log(read(sources))
        # a typed Diagnosis writes diagnosis.json with to_json(); older doctors returned that list itself
        as_json = diagnosis.to_json() if hasattr(diagnosis, "to_json") else diagnosis
        record = {"case": case, "source": spec, "diagnosis": as_json, "tags": report.diagnosis_tags(diagnosis),
                  "report": report.format_diagnosis(diagnosis, verbose_missing=True).splitlines(),
                  "stage_health": report.stage_health(diagnosis)}
        (out / _file_name(case)).write_text(json.dumps(record, indent=2) + "\n")
        rows.append((case, diagnosis))
        n += 1
    (out / "_triage.json").write_text(json.dumps({"triage": report.triage_table(rows).splitlines()}, indent=2) + "\n")
    print(f"{n} cases written to {out}")
    return n


def compare(new: Path, old: Path) -> int:
    a = {p.name for p in old.glob("*.json")}
    b = {p.name for p in new.glob("*.json")}
    bad = 0
    for name in sorted(a | b):
        if name not in a or name not in b:
            print(f"only in {'the earlier' if name in a else 'this'} snapshot: {name}")
            bad += 1
        elif (old / name).read_bytes() != (new / name).read_bytes():
            print(f"differs: {name}")
            bad += 1
    cases_n = len((a | b) - {"_triage.json"})
    print(f"{cases_n} cases (+ the triage table): {'all byte-identical' if not bad else f'{bad} differ'}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for one JSON per case")
    p.add_argument("--public-logs", type=Path, default=None,
                   help="DIR/<name>/trainer_state.json (default: $MUSIQUE_RL_DATA/public_logs, $MUSIQUE_RL_DATA "
                        "defaulting to shared/ inside or beside the checkout)")
    p.add_argument("--runs", nargs="*", default=[], metavar="GLOB",
                   help="run dirs to add (glob of directories holding metrics.jsonl)")
    p.add_argument("--compare", type=Path, default=None, metavar="DIR", help="an earlier snapshot to diff against")
    args = p.parse_args(argv)
    logs = args.public_logs or next((d for d in PUBLIC_LOG_DIRS if d.is_dir()), None)
    snapshot(args.out, logs, args.runs)
    return compare(args.out, args.compare) if args.compare else 0


if __name__ == "__main__":
    raise SystemExit(main())
