"""The job table a multirun ends with, and its record in <sweep dir>/jobs.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musique_rl.sweep import jobs as sweep_jobs
from musique_rl.sweep.jobs import JobRow

ROOT = Path(__file__).resolve().parent.parent


def test_table_shows_what_differs_between_jobs_and_why_each_failed():
    rows = [
        JobRow(0, ["+sweep=h02", "seed=1", "hypothesis.arm=control"], "COMPLETED", 91.4),
        JobRow(1, ["+sweep=h02", "seed=1", "hypothesis.arm=treatment"], "FAILED", 12.0, "ValueError: bad key"),
        JobRow(2, ["+sweep=h02", "seed=2", "hypothesis.arm=control"], "DIED", None, "UncompletedJobError: killed"),
    ]
    text = sweep_jobs.table(rows)
    lines = text.splitlines()
    assert "+sweep=h02" not in text  # shared by every job: not the job's own
    assert lines[2].split()[:4] == ["0", "seed=1", "hypothesis.arm=control", "COMPLETED"] and lines[2].split()[4] == "91"
    assert "FAILED" in lines[3] and lines[3].endswith("ValueError: bad key")
    assert "DIED" in lines[4] and " - " in lines[4] and lines[4].endswith("UncompletedJobError: killed")
    assert lines[-1] == "3 jobs: 1 finished, 2 failed"


def test_error_line_is_the_last_line_of_the_message():
    assert sweep_jobs.error_line(ValueError("first\n\n  the real cause  \n")) == "ValueError: the real cause"
    assert sweep_jobs.error_line(KeyError()) == "KeyError"
    assert sweep_jobs.error_line(None) is None


def test_rows_of_a_resumed_launch_replace_the_earlier_ones(tmp_path):
    sweep_jobs.write(tmp_path, [JobRow(0, ["seed=1"], "COMPLETED", 5.0), JobRow(1, ["seed=2"], "FAILED", 1.0, "E: x")])
    sweep_jobs.write(tmp_path, [JobRow(1, ["seed=2"], "COMPLETED", 4.0)])
    rows = sweep_jobs.read(tmp_path)
    assert [(r.num, r.status) for r in rows] == [(0, "COMPLETED"), (1, "COMPLETED")]
    assert json.loads((tmp_path / "jobs.json").read_text())[1]["seconds"] == 4.0


@pytest.mark.slow
def test_a_multirun_whose_every_job_fails_exits_non_zero_with_the_table(tmp_path):
    """The issue's own command: float16 on a CPU fails at start-up in every job."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.run([sys.executable, "-m", "musique_rl", "-m", "model.dtype=float16", "train.max_steps=2",
                           "seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "2 jobs: 0 finished, 2 failed" in proc.stdout
    assert proc.stdout.count("ValueError: model.dtype=float16") == 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    parent = next(r for r in runs if r.data.tags.get("sweep_parent") == "true")
    assert parent.info.status == "FAILED" and parent.data.tags["failed_jobs"] == "2"
