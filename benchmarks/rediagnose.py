"""Re-judge stored runs with the current doctor: every run of a tracking store gets a fresh
`diagnosis.json` and `diagnosis` tag from its logged metrics (nothing is re-trained).

    python benchmarks/rediagnose.py --tracking-uri sqlite:///multirun/bench.db

For tables whose runs were trained before the rules were final: the instruments' metrics are what
the runs logged; only the judgement is redone. `bench_faults.py --read-only` and
`heldout_faults.py --read-only` then print the tables from the new tags.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's doctor, not the editable install's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tracking-uri", required=True)
    args = ap.parse_args(argv)
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    from mlflow.tracking import MlflowClient
    from record import git_commit  # benchmarks/record.py

    from musique_rl.doctor.diagnose import diagnose_run, write_diagnosis

    judge = git_commit()

    client = MlflowClient(args.tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    n = 0
    for run in client.search_runs(exps, max_results=10_000):
        if run.data.tags.get("sweep_parent") == "true" or run.info.status != "FINISHED":
            continue
        diag = diagnose_run(run.info.run_id, args.tracking_uri)
        write_diagnosis(run.info.run_id, diag, args.tracking_uri)
        # which doctor judged the run (the run's own git_commit tag says which code trained it)
        client.set_tag(run.info.run_id, "diagnosis_commit", judge)
        n += 1
        print(f"{run.info.run_id} {run.data.tags.get('mlflow.runName', '')}: {diag.top_hypothesis}", flush=True)
    print(f"{n} runs re-diagnosed in {args.tracking_uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
