"""The sweep's one callback: parent run before the jobs; after them the jobs table, the verdict,
its plots and the parent's end, in that order; a failed job recorded once (jobs.json); nothing
passed through the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from musique_rl.schema import CONF_DIR
from musique_rl.sweep import jobs
from musique_rl.sweep.callback import SweepCallback
from musique_rl.tracking import provenance, store
from musique_rl.tracking import sweep as parent_run
from musique_rl.verdict import HYPOTHESIS_DIR

ROOT = Path(__file__).resolve().parent.parent


def _runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def test_a_sweep_opens_its_parent_first_judges_after_its_jobs_table_and_closes_the_parent_last(tmp_path):
    """The stand-in app (tests/sweep_app.py) through the real conf tree, launcher and callback, tracked."""
    sweep_dir, uri = tmp_path / "sweep", f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri, "SWEEP_APP_FAIL": "treatment:2"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sweep_app.py"), "-m", "+sweep=h02", "seed=1,2",
                           f"hydra.sweep.dir={sweep_dir}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a job failed: scripts and CI see it
    # on the console: the jobs table, then the verdict naming the failed job with the table's error line
    table_at, verdict_at = proc.stdout.index(" job  overrides"), proc.stdout.index("h02 Environment tokens in the loss:")
    assert table_at < verdict_at
    table = proc.stdout[table_at:verdict_at]
    assert "hypothesis.arm=treatment seed=2" in table and table.count("COMPLETED") == 3
    assert "RuntimeError: planted failure in treatment:2" in table and "4 jobs: 3 finished, 1 failed" in table
    assert "treatment seed 2 FAILED (RuntimeError: planted failure in treatment:2)" in proc.stdout[verdict_at:]
    assert len(list(sweep_dir.glob("*/metrics.json"))) == 3  # the other jobs finished
    rows = json.loads((sweep_dir / "jobs.json").read_text())
    assert [r["status"] for r in rows] == ["COMPLETED"] * 3 + ["FAILED"]
    assert rows[3]["error"] == "RuntimeError: planted failure in treatment:2" and rows[3]["seconds"] >= 0
    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert v["missing"] == [{"arm": "treatment", "seed": 2, "status": "FAILED",
                             "reason": "RuntimeError: planted failure in treatment:2",
                             "source": (sweep_dir / "3" / "mlflow_run_id").read_text()}]  # judged from MLflow
    assert v["n_pairs"] == 1

    runs = _runs(uri)
    parent = next(r for r in runs if r.data.tags.get("sweep_parent") == "true")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 5 and len(children) == 4  # every job nested under the parent, found from its sweep dir
    assert {r.data.tags["sweep_id"] for r in children} == {parent.data.tags["sweep_id"]}
    assert parent.info.start_time <= min(r.info.start_time for r in children)  # opened before the jobs
    jobs_written = (sweep_dir / "jobs.json").stat().st_mtime
    verdict_written = (sweep_dir / "verdict.json").stat().st_mtime
    assert jobs_written <= verdict_written  # judged after the jobs table
    # closed last: after every job's run and after the verdict, FAILED, with the table's counts
    assert parent.info.end_time >= max(r.info.end_time for r in children)
    assert parent.info.end_time >= verdict_written * 1000
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["jobs"], parent.data.tags["failed_jobs"], parent.data.tags["verdict"]) == ("4", "1", "Inconclusive")  # one pair left
    # the sweep passed its jobs nothing through the environment: each saw only the MUSIQUE_RL_*
    # variables the test's own process had (CI sets MUSIQUE_RL_CACHE, for one)
    launching = sorted(k for k in os.environ if k.startswith("MUSIQUE_RL_"))
    for m in sweep_dir.glob("*/metrics.json"):
        assert json.loads(m.read_text())["job/musique_rl_env"] == launching


def _job(sweep_dir: Path, num: int, arm: str, seed: int, value: float | None, uri: str) -> str:
    """One job as a real one leaves it: its saved config, metrics.json, and its MLflow run nested
    under the parent its sweep dir names (what tracking.job does); returns the run id."""
    from mlflow.tracking import MlflowClient

    job = sweep_dir / str(num)
    (job / ".hydra").mkdir(parents=True)
    hyp = yaml.safe_load((HYPOTHESIS_DIR / "h02.yaml").read_text())["hypothesis"]
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"hypothesis": {**hyp, "arm": arm}, "seed": seed}))
    if value is not None:
        (job / "metrics.json").write_text(json.dumps({"train/reward_gain": value}))
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("h02").experiment_id
    tags = {"mlflow.parentRunId": parent_run.parent_run_id(sweep_dir), "sweep_id": provenance.sweep_id_of(sweep_dir),
            "hypothesis": "h02", "arm": arm, "seed": str(seed), "output_dir": str(job)}
    run_id = client.create_run(exp, tags=tags).info.run_id
    (job / store.RUN_ID_FILE).write_text(run_id)
    return run_id


def test_a_failed_job_is_read_from_the_jobs_table_and_the_environment_is_left_as_it_was(tmp_path, monkeypatch):
    """In the launching process: the callback sets no environment variable, and the jobs table alone
    says which jobs failed: a job that wrote its metrics and ended its run FINISHED but that the
    table records FAILED is a gap in the verdict and a failed job of the parent; a job that died
    (its run left RUNNING) ends KILLED."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    sweep_dir, uri = (tmp_path / "sweep").resolve(), f"sqlite:///{tmp_path / 'mlflow.db'}"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["+sweep=h02", "hydra.sweeper.params.seed='1,2'", f"hydra.sweep.dir={sweep_dir}",
                                          f"tracking.tracking_uri={uri}"], return_hydra_config=True)
    environ = dict(os.environ)
    cb = SweepCallback()
    cb.on_multirun_start(cfg)
    assert dict(os.environ) == environ
    client = MlflowClient(uri)
    assert client.get_run(parent_run.parent_run_id(sweep_dir)).info.status == "RUNNING"

    ids = {(arm, seed): _job(sweep_dir, n, arm, seed, value, uri) for n, (arm, seed, value) in
           enumerate([("control", 1, 0.30), ("treatment", 1, 0.10), ("control", 2, 0.31), ("treatment", 2, None)])}
    client.set_terminated(ids["control", 1], "FINISHED")  # its process ended it; the table says it failed after
    client.set_terminated(ids["treatment", 1], "FINISHED")
    client.set_terminated(ids["control", 2], "FINISHED")  # treatment 2: killed, its run left RUNNING
    jobs.write(sweep_dir, [jobs.JobRow(0, [], "FAILED", 5.0, "ValueError: after the metrics"),
                           jobs.JobRow(1, [], "COMPLETED", 5.0), jobs.JobRow(2, [], "COMPLETED", 5.0),
                           jobs.JobRow(3, [], "DIED", None, "UncompletedJobError: killed")])
    with pytest.raises(SystemExit) as exit_:
        cb.on_multirun_end(cfg)
    assert exit_.value.code == 1
    assert dict(os.environ) == environ

    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert {(m["arm"], m["seed"], m["status"], m["reason"]) for m in v["missing"]} == {
        ("control", 1, "FAILED", "ValueError: after the metrics"), ("treatment", 2, "KILLED", "UncompletedJobError: killed")}
    assert v["n_pairs"] == 0 and v["status"] == "Inconclusive"
    parent = client.get_run(parent_run.parent_run_id(sweep_dir))
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["jobs"], parent.data.tags["failed_jobs"], parent.data.tags["verdict"]) == ("4", "2", "Inconclusive")
    assert client.get_run(ids["treatment", 2]).info.status == "KILLED"
    assert client.get_run(ids["control", 1]).info.status == "FINISHED"  # a job's own ended run is left as it is
