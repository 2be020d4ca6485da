"""A real single-node SLURM (launchers/slurm_local.sh) under hydra/launcher=slurm: sweeps, GPU-shaped
requests, cancelled jobs, requeue + resume. Slow: the script may install packages (root needed).

Every sweep runs under a subprocess timeout: without accounting submitit would wait forever on a
cancelled job, and nothing here may hang a CI run.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launchers" / "slurm_local.sh"


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("launchers/slurm_local.sh installs packages and starts daemons: needs root")
    was_up = subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode == 0
    t0 = time.time()
    up = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stderr
    print(f"slurm_local.sh up: {time.time() - t0:.1f} s")
    yield
    if not was_up:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=120)


@contextlib.contextmanager
def killed_if_left(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Kill ``proc`` if it still runs when the block ends (a wait timed out): nothing here may hang."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def sacct_state(job_id: str) -> str:
    out = sh("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State")
    return out.strip().splitlines()[0] if out.strip() else ""


def wait(pred, timeout: float, what: str, every: float = 0.5):
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_cluster_runs_gpu_shaped_jobs_and_accounts_for_them(slurm, tmp_path):
    assert "idle" in sh("sinfo", "-h", "-N", "-o", "%T") or "mixed" in sh("sinfo", "-h", "-N", "-o", "%T")
    assert "gpu:2" in sh("sinfo", "-h", "-N", "-o", "%G")
    out = tmp_path / "gpu.out"
    jid = sh("sbatch", "--parsable", f"--output={out}", "--gpus-per-node=1", "--wrap", "echo CUDA=$CUDA_VISIBLE_DEVICES").strip()
    wait(lambda: sacct_state(jid) == "COMPLETED", 60, f"job {jid} to complete")
    assert out.read_text().strip() == "CUDA=0"  # SLURM handed the job one (fake) GPU


def stand_in_sweep(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """tests/sweep_app.py through hydra/launcher=slurm, tracked in a private MLflow store."""
    cmd = [sys.executable, str(ROOT / "tests" / "sweep_app.py"), "-m", *overrides, "hydra/launcher=slurm",
           f"hydra.sweep.dir={tmp_path / 'sweep'}",
           "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=20"]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
                **(env or {})}
    return subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=open(tmp_path / "sweep.log", "w"),
                            stderr=subprocess.STDOUT, text=True)


def runs_of(tmp_path: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return list(client.search_runs([e.experiment_id for e in client.search_experiments()]))


def job_ids(job_dir: Path) -> list[str]:
    p = job_dir / "progress.json"
    return json.loads(p.read_text())["slurm_job_ids"] if p.exists() else []


def test_requeued_job_resumes_from_its_files_into_the_same_mlflow_run(slurm, tmp_path):
    proc = stand_in_sweep(tmp_path, "+sweep=h02", "seed=1", "hypothesis.arm=control",
                          env={"SWEEP_APP_STEPS": "10", "SWEEP_APP_STEP_S": "1"})
    job_dir = tmp_path / "sweep" / "0"
    with killed_if_left(proc):
        wait(lambda: (job_dir / "progress.json").exists() and json.loads((job_dir / "progress.json").read_text())["step"] >= 3,
             120, "the job to reach step 3")
        jid = job_ids(job_dir)[0]
        array_id = sh("squeue", "-h", "-o", "%i").split()[0]
        # what SLURM sends before a preemption/timeout (submitit's own _interrupt does the same)
        sh("scancel", "--signal=USR2", array_id)
        proc.wait(timeout=240)
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    progress = json.loads((job_dir / "progress.json").read_text())
    metrics = json.loads((job_dir / "metrics.json").read_text())
    assert progress["starts"] == 2 and progress["step"] == 10 and job_ids(job_dir) == [jid, jid]
    assert metrics["job/resumed_from_step"] >= 3  # continued, not restarted from 0
    submitit_log = "".join(p.read_text() for p in sorted((tmp_path / "sweep" / ".submitit").glob("*/*_log.*")))
    assert "this job is preempted" in submitit_log and f"Requeued job {jid}" in submitit_log
    children = [r for r in runs_of(tmp_path) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 1  # one job, one run, across both starts
    run = children[0]
    assert run.info.run_id == (job_dir / "mlflow_run_id").read_text().strip()
    assert run.info.status == "FINISHED" and run.data.metrics["job/starts"] == 2


def sweep_with_control_seed_2_cancelled(tmp_path):
    """A 2-seed h02 stand-in sweep on SLURM whose control seed 2 is scancel-ed once it starts; returns
    the finished launcher process and the cancelled job's directory."""
    proc = stand_in_sweep(tmp_path, "+sweep=h02", "seed=1,2", env={"SWEEP_APP_STEPS": "6", "SWEEP_APP_STEP_S": "1"})
    victim = tmp_path / "sweep" / "1"  # control, seed 2
    with killed_if_left(proc):
        wait(lambda: job_ids(victim), 120, "control seed 2 to start")
        task_id = [ln.split()[0] for ln in sh("squeue", "-h", "-o", "%i").splitlines() if ln.endswith("_1")][0]
        sh("scancel", task_id)
        # with accounting (slurmdbd) submitit sees the cancellation: the sweep ends, it does not hang
        proc.wait(timeout=300)
    return proc, victim


def test_cancelled_job_ends_killed_the_others_finish_and_the_verdict_names_it(slurm, tmp_path):
    proc, victim = sweep_with_control_seed_2_cancelled(tmp_path)
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode != 0  # the launcher reports the dead job after the others ended
    assert len(list((tmp_path / "sweep").glob("*/metrics.json"))) == 3, log[-3000:]
    v = json.loads((tmp_path / "sweep" / "verdict.json").read_text())
    assert [(m["arm"], m["seed"], m["status"]) for m in v["missing"]] == [("control", 2, "KILLED")]
    assert v["n_pairs"] == 1 and v["status"] == "Inconclusive"
    parent = [r for r in runs_of(tmp_path) if r.data.tags.get("sweep_parent") == "true"]
    assert len(parent) == 1 and parent[0].data.tags["verdict"] == "Inconclusive"


def test_a_cancelled_job_is_rerun_by_resuming_the_sweep_and_the_verdict_covers_every_pair(slurm, tmp_path):
    proc, victim = sweep_with_control_seed_2_cancelled(tmp_path)
    assert proc.returncode == 1 and not (victim / "metrics.json").exists()
    kept = {d.name: (d / "mlflow_run_id").read_text() for d in (tmp_path / "sweep").iterdir() if (d / "metrics.json").exists()}
    assert len(kept) == 3
    resumed = stand_in_sweep(tmp_path, "+sweep=h02", "seed=1,2", f"sweep.resume={tmp_path / 'sweep'}",
                             env={"SWEEP_APP_STEPS": "6", "SWEEP_APP_STEP_S": "1"})
    resumed.wait(timeout=300)
    log = (tmp_path / "sweep.log").read_text()
    assert resumed.returncode == 0, log[-3000:]
    rows = {r["num"]: r["status"] for r in json.loads((tmp_path / "sweep" / "jobs.json").read_text())}
    assert rows == {0: "SKIPPED", 1: "COMPLETED", 2: "SKIPPED", 3: "SKIPPED"}
    for job, run_id in kept.items():
        assert (tmp_path / "sweep" / job / "mlflow_run_id").read_text() == run_id
        assert json.loads((tmp_path / "sweep" / job / "progress.json").read_text())["starts"] == 1
    v = json.loads((tmp_path / "sweep" / "verdict.json").read_text())
    assert v["n_pairs"] == 2 and v["missing"] == []


# ---------------------------------------------------------------- the real tiny training
# Short runs: the point is the machinery (launcher, tracking, resume, verdict), not learning.
TINY_RUN = ["train.eval_episodes=8", "train.logging_steps=1"]


def real_sweep(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "musique_rl", "-m", *overrides, *TINY_RUN, "hydra/launcher=slurm",
           f"hydra.sweep.dir={tmp_path / 'sweep'}",
           "hydra.launcher.mem_gb=3", "hydra.launcher.timeout_min=60"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(tmp_path / "sweep.log", "w"),
                            stderr=subprocess.STDOUT, text=True)


def test_tiny_training_sweep_on_slurm_lands_in_mlflow_under_one_parent(slurm, tmp_path):
    proc = real_sweep(tmp_path, "+sweep=h02", "seed=1,2", "train.max_steps=2")
    with killed_if_left(proc):
        proc.wait(timeout=1800)
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    runs = runs_of(tmp_path)
    parents = [r for r in runs if r.data.tags.get("sweep_parent") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in children) == [
        ("control", "1"), ("control", "2"), ("treatment", "1"), ("treatment", "2")]
    for r in children:
        assert r.info.status == "FINISHED" and r.data.tags["hypothesis"] == "h02"
        assert "train/reward_gain" in r.data.metrics and "reward" in r.data.metrics  # summary + TRL's per-step
        assert r.data.tags["sweep_id"] == parent.data.tags["sweep_id"] and r.data.tags["git_commit"]
    v = json.loads((tmp_path / "sweep" / "verdict.json").read_text())
    assert v["source"]["kind"] == "mlflow" and v["n_pairs"] == 2 and v["missing"] == []
    assert v["status"] in ("Validated", "Invalidated", "Inconclusive") and "h02" in log
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"verdict.json", "status.md"}
    assert client.get_run(parent.info.run_id).data.tags["verdict"] == v["status"]


def test_requeued_training_job_resumes_from_its_checkpoint_into_the_same_run(slurm, tmp_path):
    proc = real_sweep(tmp_path, "+sweep=h02", "seed=1", "hypothesis.arm=control", "train.max_steps=10",
                      "train.save_steps=2")
    job_dir = tmp_path / "sweep" / "0"
    with killed_if_left(proc):
        wait(lambda: list(job_dir.glob("checkpoints/checkpoint-*")), 900, "the first checkpoint")
        array_id = sh("squeue", "-h", "-o", "%i").split()[0]
        sh("scancel", "--signal=USR2", array_id)  # preemption / timeout warning
        proc.wait(timeout=1200)
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    submitit_log = "".join(p.read_text() for p in sorted((tmp_path / "sweep" / ".submitit").glob("*/*_log.*")))
    assert "this job is preempted" in submitit_log and "Requeued job" in submitit_log
    metrics = json.loads((job_dir / "metrics.json").read_text())
    assert metrics["train/steps"] == 10
    children = [r for r in runs_of(tmp_path) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 1 and children[0].info.status == "FINISHED"  # one job, one run
    tags = children[0].data.tags
    assert "error" not in tags and "interrupted" not in tags and tags["resumes"] == "1", tags
    run_id = children[0].info.run_id
    assert run_id == (job_dir / "mlflow_run_id").read_text().strip() == metrics["mlflow/run_id"]
    from mlflow.tracking import MlflowClient

    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run_id, "reward")
    steps = [m.step for m in history]
    # resumed from a checkpoint (step >= 2): step 1 was trained once, not again from scratch
    assert steps.count(1) == 1 and max(steps) == 10, steps
