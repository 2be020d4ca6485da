"""``python -m musique_rl.tracking --upload <run dir> [--uri URI]``: send a run directory's metrics
to its MLflow run (after a tracking outage, or a run made with tracking.enabled=false)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from musique_rl.base import rundir
from musique_rl.tracking.store import RUN_ID_FILE
from musique_rl.tracking.upload import upload_run_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.tracking", description=__doc__)
    p.add_argument("--upload", metavar="RUN_DIR", nargs="+", required=True, help="run directories (with metrics.jsonl)")
    p.add_argument("--uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else the run's tracking.tracking_uri, "
                                 "else sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", help="experiment of a new run, for a run dir without mlflow_run_id")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for run_dir in args.upload:
        d = Path(run_dir)
        if not (d / rundir.METRICS_LOG).exists():
            p.error(f"{d}: no {rundir.METRICS_LOG} (not a run directory)")
        sent = upload_run_dir(d, uri=args.uri, experiment=args.experiment)
        run_id = (d / RUN_ID_FILE).read_text().strip()
        print(f"{d}: {sent} step(s) sent to MLflow run {run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
