"""Named sweeps: each composes on Hydra's search path as `+sweep=hNN` with the paired grid, and
a sweep through the local launcher runs both arms x seeds in parallel and judges itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from musique_rl.schema import CONF_DIR, SWEEPS_DIR  # importing it registers the schema and resolvers

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted(p.stem for p in (CONF_DIR / "hypothesis").glob("h*.yaml"))  # one named sweep each


def test_every_hypothesis_has_a_named_sweep_file_a_user_can_copy():
    assert len(SWEEPS) >= 8
    # sweeps/ at the top of the checkout: one readable file per named sweep, real files (a wheel drops links)
    assert SWEEPS_DIR.parent == ROOT and (SWEEPS_DIR / "_base.yaml").is_file()
    files = sorted(p.stem for p in SWEEPS_DIR.glob("h*.yaml"))
    assert files == SWEEPS and not any(p.is_symlink() for p in SWEEPS_DIR.iterdir())
    for name in files:  # each names its hypothesis, arms and seeds where a reader sees them
        text = (SWEEPS_DIR / f"{name}.yaml").read_text()
        assert f"/hypothesis: {name}" in text and "hypothesis.arm:" in text and "seed:" in text, name


def test_a_new_hypothesis_is_one_file_and_its_sweep_comes_with_it(tmp_path):
    """The recipe of docs/architecture.md, done: copy conf/, add conf/hypothesis/h99.yaml, and
    `+sweep=h99` composes the shared grid; a hypothesis with its own sweeps file keeps its grid."""
    import shutil

    from musique_rl.schema import register_sweeps

    conf, sweeps = tmp_path / "conf", tmp_path / "sweeps"
    shutil.copytree(CONF_DIR, conf, symlinks=False)
    shutil.copytree(SWEEPS_DIR, sweeps, symlinks=False)
    text = (conf / "hypothesis" / "h02.yaml").read_text().replace("id: h02", "id: h99")
    (conf / "hypothesis" / "h99.yaml").write_text(text)
    (conf / "hypothesis" / "h98.yaml").write_text(text.replace("id: h99", "id: h98"))
    (sweeps / "h98.yaml").write_text((sweeps / "h02.yaml").read_text().replace("h02", "h98").replace("1,2,3,4,5", "1,2"))
    added = register_sweeps(conf, sweeps)
    assert "h99" in added and "h98" not in added
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        new = compose("train", overrides=["+sweep=h99"], return_hydra_config=True)
        own = compose("train", overrides=["+sweep=h98"], return_hydra_config=True)
    assert new.hypothesis.id == "h99" and own.hypothesis.id == "h98"
    assert OmegaConf.to_container(new.hydra.sweeper.params) == {"hypothesis.arm": "control,treatment", "seed": "1,2,3,4,5"}
    assert OmegaConf.to_container(own.hydra.sweeper.params) == {"hypothesis.arm": "control,treatment", "seed": "1,2"}
    register_sweeps()  # the real tree again, for the tests after this one


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes_with_paired_grid_and_verdict(hydra_conf, name):
    arms = {}
    for arm in ("control", "treatment"):
        cfg = compose("train", overrides=[f"+sweep={name}", f"hypothesis.arm={arm}"], return_hydra_config=True)
        assert OmegaConf.to_container(cfg.hydra.sweeper.params) == {"hypothesis.arm": "control,treatment", "seed": "1,2,3,4,5"}
        assert cfg.hydra.callbacks.sweep._target_ == "musique_rl.sweep.callback.SweepCallback"
        assert "status_file" not in cfg.hydra.callbacks.sweep  # a sweep writes its sweep dir and MLflow only
        assert cfg.hydra.sweep.dir.startswith(f"multirun/{name}/")  # resolves ${hypothesis.id}
        with open_dict(cfg):
            del cfg["hydra"]  # hydra.job.num exists only inside a running sweep
        job = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        assert job["hypothesis"]["id"] == name
        job["hypothesis"].pop("arm")
        arms[arm] = job
    # the arms differ (the hypothesis' knob), and only through config, never the seed or the data
    assert arms["control"] != arms["treatment"]
    assert arms["control"]["seed"] == arms["treatment"]["seed"] and arms["control"]["env"]["data"] == arms["treatment"]["env"]["data"]


def run_sweep(tmp_path: Path, *overrides: str, env: dict | None = None, timeout: int = 120):
    """The stand-in app (tests/sweep_app.py) through the real conf tree, launcher and callback."""
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "tests" / "sweep_app.py"), "-m", *overrides,
           f"hydra.sweep.dir={sweep_dir}", "tracking.enabled=false"]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'none.db'}",
                **(env or {})}
    proc = subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc, sweep_dir


def test_local_sweep_runs_arms_in_parallel_capped_and_prints_its_verdict(tmp_path):
    proc, sweep_dir = run_sweep(tmp_path, "+sweep=h01", "seed=1,2", env={"SWEEP_APP_STEPS": "2", "SWEEP_APP_STEP_S": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "h01 Advantage scaling by group std amplifies near-ties: Validated" in proc.stdout
    jobs = [json.loads(p.read_text()) for p in sweep_dir.glob("*/metrics.json")]
    assert len(jobs) == 4 and {j["job/omp_threads"] for j in jobs} == {"1"}
    # at most max_parallel=2 jobs at once, and more than one at once (parallel, not sequential)
    events = sorted([(j["job/started"], 1) for j in jobs] + [(j["job/ended"], -1) for j in jobs])
    running, peak = 0, 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2
    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert v["status"] == "Validated" and v["n_pairs"] == 2 and v["effect"] == pytest.approx(0.10)
    # the sweep's two pictures, and the verdict's row links them
    from musique_rl.verdict.plots import sweep_curves

    curves = sweep_curves(sweep_dir)
    assert sorted(curves) == ["control", "treatment"] and sorted(curves["control"]) == [1, 2]
    assert curves["treatment"][1] == [(1, pytest.approx(0.41 / 3)), (2, pytest.approx(0.82 / 3)), (3, pytest.approx(0.41))]
    for name in ("reward_curves.png", "paired_differences.png"):
        png = sweep_dir / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert v["plots"][name] == str(png)
    assert f"[reward curves]({sweep_dir / 'plots' / 'reward_curves.png'})" in v["status_table"]


def _repository_record() -> dict[str, str]:
    """What a user's sweep must never change: the status file, the published plots, and (in a git
    checkout) every tracked file, as git sees them."""
    import hashlib

    files = [ROOT / "docs" / "STATUS.md", *sorted((ROOT / "docs" / "verdicts").rglob("*"))]
    record = {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}
    git = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode == 0:
        record["git status"] = git.stdout
        record["git diff"] = hashlib.sha256(subprocess.run(["git", "diff"], cwd=ROOT, capture_output=True).stdout).hexdigest()
    return record


def test_a_short_sweep_says_too_short_to_judge_and_leaves_the_repository_unchanged(tmp_path):
    """The newcomer's short grid (every step inside the 10-step warm-up): a verdict in the sweep dir
    that says it is too short, and not one tracked file of the checkout changed (docs/STATUS.md and
    docs/verdicts/ change only through `python -m musique_rl.verdict publish`)."""
    before = _repository_record()
    proc, sweep_dir = run_sweep(tmp_path, "+sweep=h02", "seed=1,2", "train.max_steps=4", "train.eval_episodes=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "h02 Environment tokens in the loss: Inconclusive, too short to judge [4 steps x 2 seeds]" in proc.stdout
    assert f"python -m musique_rl.verdict publish --sweep {sweep_dir}" in proc.stdout
    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert v["status"] == "Inconclusive" and v["confidence"] is None and v["budget"]["too_short"]
    assert (sweep_dir / "plots" / "paired_differences.png").is_file()
    assert _repository_record() == before


def test_a_grid_written_by_hand_is_judged_only_when_it_sweeps_both_arms(tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    proc, sweep_dir = run_sweep(both, "+hypothesis=h01", "hypothesis.arm=control,treatment", "seed=1,2",
                                env={"SWEEP_APP_STEPS": "1", "SWEEP_APP_STEP_S": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert v["hypothesis"]["id"] == "h01" and v["n_pairs"] == 2
    one = tmp_path / "one"
    one.mkdir()
    proc, sweep_dir = run_sweep(one, "+hypothesis=h01", "seed=1,2", env={"SWEEP_APP_STEPS": "1", "SWEEP_APP_STEP_S": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(sweep_dir.glob("*/metrics.json"))) == 2
    assert not (sweep_dir / "verdict.json").exists()  # one arm: nothing to pair, no verdict pretending otherwise


@pytest.mark.slow
def test_killed_job_leaves_the_others_finished_and_the_verdict_names_it(tmp_path):
    proc, sweep_dir = run_sweep(tmp_path, "+sweep=h02", "seed=1,2", env={"SWEEP_APP_KILL": "control:1"})
    assert proc.returncode != 0
    assert len(list(sweep_dir.glob("*/metrics.json"))) == 3
    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert [(m["arm"], m["seed"]) for m in v["missing"]] == [("control", 1)]
    assert v["status"] == "Inconclusive" and v["n_pairs"] == 1


def test_an_interrupted_sweep_resumes_only_its_unfinished_jobs(tmp_path):
    """A sweep whose launcher and jobs die half-way (a dead node, an allocation that ran out) is
    finished by the same command with sweep.resume=<its dir>: the finished jobs are kept with
    their MLflow runs, the others resume from their own files into their own runs, and the
    verdict covers every seed pair."""
    import signal
    import time

    from mlflow.tracking import MlflowClient

    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "tests" / "sweep_app.py"), "-m", "+sweep=h02", "seed=1,2",
           f"hydra.sweep.dir={sweep_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "SWEEP_APP_STEPS": "6", "SWEEP_APP_STEP_S": "0.5"}
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)

    def started(job: str) -> bool:
        p = sweep_dir / job / "progress.json"
        return p.exists() and json.loads(p.read_text())["step"] >= 1

    deadline = time.time() + 120
    while not ((sweep_dir / "0" / "metrics.json").exists() and started("2")) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every job it started, mid-run
    first.wait()
    import psutil  # accelerate's dependency: the job processes, whatever session submitit gave them

    for p in psutil.process_iter(["cmdline"]):
        if "submitit" in " ".join(p.info["cmdline"] or []) and str(sweep_dir) in " ".join(p.info["cmdline"] or []):
            p.kill()
    finished = {p.parent.name for p in sweep_dir.glob("*/metrics.json")}
    assert "0" in finished and "2" not in finished
    run_ids = {d.name: (d / "mlflow_run_id").read_text() for d in sweep_dir.iterdir() if (d / "mlflow_run_id").exists()}
    parent = (sweep_dir / "mlflow_parent_run_id").read_text()

    proc = subprocess.run([*cmd, f"sweep.resume={sweep_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["num"]: r["status"] for r in json.loads((sweep_dir / "jobs.json").read_text())}
    assert {rows[int(j)] for j in finished} == {"SKIPPED"}
    assert {rows[n] for n in range(4) if str(n) not in finished} == {"COMPLETED"}
    for job in finished:  # kept: trained once, same run
        assert json.loads((sweep_dir / job / "progress.json").read_text())["starts"] == 1
    resumed = json.loads((sweep_dir / "2" / "progress.json").read_text())
    assert resumed["starts"] == 2 and json.loads((sweep_dir / "2" / "metrics.json").read_text())["job/resumed_from_step"] >= 1
    for job, run_id in run_ids.items():
        assert (sweep_dir / job / "mlflow_run_id").read_text() == run_id
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert len(children) == 4 and {r.info.status for r in children} == {"FINISHED"}
    assert client.get_run(parent).info.status == "FINISHED" and (sweep_dir / "mlflow_parent_run_id").read_text() == parent
    v = json.loads((sweep_dir / "verdict.json").read_text())
    assert v["n_pairs"] == 2 and v["missing"] == [] and v["status"] == "Validated"
