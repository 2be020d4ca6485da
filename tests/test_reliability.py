"""Nothing lost, nothing mixed: concurrent launches, tracking outages, damaged checkpoints, full
disks, SIGTERM, secrets in a tracking URI, impossible config values, malformed data lines.

Each test plants one fault and asserts what a user would see. The in-process jobs train the tiny
model for 2-4 steps of 2 prompts x 2 completions; the launches are real ``python -m musique_rl``
processes. The live-server outage (an MLflow server that dies mid-run) is ``slow``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_OVERRIDES, compose_cfg

from musique_rl import schema
from musique_rl.base import rundir
from musique_rl.job import launch
from musique_rl.schema import CONF_DIR
from musique_rl.tracking import store as tracking_store
from musique_rl.tracking.__main__ import main as tracking_main
from musique_rl.tracking.sink import open_run
from musique_rl.tracking.upload import upload_run_dir

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-planted-pw"
FAST = [*TEST_OVERRIDES, "train.prompts_per_step=2", "train.num_generations=2", "train.eval_episodes=0",
        "diagnostics.enabled=false", "loss.warmup_steps=0", "train.max_steps=4", "train.save_steps=2"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def _launch(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "musique_rl", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def _store_template(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, made once: creating its schema takes MLflow ~5-20 s."""
    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(tmp_path, _store_template) -> str:
    """The URI of a fresh sqlite store in this test's tmp dir."""
    shutil.copy(_store_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _train(cfg, run_dir: Path, tracker=None) -> float:
    from musique_rl.job.train import train

    return train(cfg, tracker=tracker, run_dir=run_dir).objective


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "reward" in json.loads(line)]


# ---------------------------------------------------------------- 1. every launch owns its dirs and its run
def test_two_runs_started_in_the_same_second_stay_apart(tmp_path, store):
    """Before: both used outputs/<date>/<HH-MM-SS>; the second adopted the first's MLflow run."""
    uri = store
    common = [*TEST_OVERRIDES, "mode=eval", "policy=oracle", "train.eval_episodes=2", "env.synthetic.num_train=20",
              "env.synthetic.num_eval=4", "tracking.enabled=true", f"tracking.tracking_uri={uri}"]
    tracking_store.ensure_experiment(uri, "musique_rl")  # the store exists: both launches only add runs
    procs = [_launch([*common, f"seed={s}"], tmp_path) for s in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    dirs = sorted(p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir())
    assert len(dirs) == 2, dirs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("musique_rl").experiment_id])
    assert sorted(r.data.params["seed"] for r in runs) == ["1", "2"]
    for r in runs:  # each run is its own launch's: its param and tag agree, its dir holds its id
        assert r.data.tags["seed"] == r.data.params["seed"]
        assert (Path(r.data.tags["output_dir"]) / "mlflow_run_id").read_text() == r.info.run_id
        # the eval's figures reach the run through the tracker app.run handed to evaluate()
        assert r.data.metrics["eval/answer_em"] == 1.0
        assert {"metrics.json", "episodes.jsonl"} <= {f.path for f in client.list_artifacts(r.info.run_id)}


def test_a_run_dir_in_use_or_of_another_config_is_refused(tmp_path):
    """Two launches given the same hydra.run.dir: the second is refused while the first holds it,
    and a later launch with another config is refused naming the keys that differ."""
    one, two = compose_cfg([*TEST_OVERRIDES, "seed=1"]), compose_cfg([*TEST_OVERRIDES, "seed=2"])
    with launch.claim(tmp_path, one):
        with pytest.raises(launch.RunDirError, match=r"in use by another launch \(pid \d+"):
            with launch.claim(tmp_path, one):
                pass
    with pytest.raises(launch.RunDirError, match=r"another config \(seed: 1 -> 2\)"):
        with launch.claim(tmp_path, two):
            pass
    # a requeue of the same job (same config, train.resume / tracking changed) is the same launch's
    with launch.claim(tmp_path, compose_cfg([*TEST_OVERRIDES, "seed=1", "train.resume=never", "tracking.enabled=true"])):
        pass
    assert json.loads((tmp_path / rundir.IDENTITY).read_text())["attempts"] == 2  # the refused launches left no trace


def test_a_job_never_adopts_the_run_of_another_config(tmp_path, monkeypatch, caplog, store):
    uri = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with open_run(compose_cfg(["mode=eval", "seed=1"]), tmp_path / "job") as first:
        pass
    with open_run(compose_cfg(["mode=eval", "seed=1"]), tmp_path / "job") as again:
        assert again.run_id == first.run_id  # a requeue of the same job continues its run
    with caplog.at_level(logging.WARNING), open_run(compose_cfg(["mode=eval", "seed=2"]), tmp_path / "job") as other:
        assert other.run_id != first.run_id
    assert "belongs to another config" in caplog.text
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(first.run_id)
    assert run.data.params["seed"] == run.data.tags["seed"] == "1"


@pytest.mark.parametrize("tracked", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_sweeps_started_together_stay_apart(tmp_path, store, tracked):
    """Before: `-m seed=1,2` and `-m seed=3,4` started together shared one multirun/... dir (jobs.json
    listing seeds 1-2, seeds 3-4 writing into the same job dirs and MLflow runs, a parent orphaned)."""
    common = [*TEST_OVERRIDES, "mode=eval", "policy=oracle", "train.eval_episodes=2", "env.synthetic.num_train=20",
              "env.synthetic.num_eval=4", f"tracking.enabled={str(tracked).lower()}"]
    procs = [_launch(["-m", *common, f"seed={s}"], tmp_path) for s in ("1,2", "3,4")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    sweeps = sorted(p for p in (tmp_path / "multirun").glob("*/*") if p.is_dir())
    assert len(sweeps) == 2, sweeps
    seeds = []
    for d in sweeps:
        rows = json.loads((d / "jobs.json").read_text())
        rows = rows["jobs"] if isinstance(rows, dict) else rows
        seeds.append(sorted(str(r["overrides"]) for r in rows))
        assert len(rows) == 2
    assert any("seed=1" in s for s in seeds[0] + seeds[1])
    assert not set(seeds[0]) & set(seeds[1])
    for d in sweeps:  # each job dir holds one job's identity, claimed by one launch
        assert {json.loads((j / rundir.IDENTITY).read_text())["config"]["seed"] for j in d.glob("[0-9]")} in (
            {"1", "2"}, {"3", "4"})
    if not tracked:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    parents = {r.info.run_id for r in runs if r.data.tags.get("sweep_parent") == "true"}
    jobs = [r for r in runs if r.info.run_id not in parents]
    assert len(parents) == 2 and len(jobs) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    for parent in parents:  # each parent holds exactly its own two jobs
        assert sum(r.data.tags.get("mlflow.parentRunId") == parent for r in jobs) == 2


# ---------------------------------------------------------------- 2. side services never cost the run
def test_a_store_that_fails_mid_run_costs_nothing(tmp_path, monkeypatch, caplog, store):
    """A full disk under the sqlite store from step 2 on: said once, training goes on, metrics.jsonl
    keeps every step, and the store gets the missed steps at the end once it answers again."""
    from mlflow.tracking import MlflowClient

    uri = store
    cfg = compose_cfg([*FAST, "tracking.enabled=true", f"tracking.tracking_uri={uri}"])
    real = MlflowClient.log_batch
    calls = {"n": 0, "down": True}

    def failing(self, run_id, metrics=(), *a, **kw):
        if metrics and calls["down"]:
            calls["n"] += 1
            if calls["n"] >= 2:
                raise sqlite3.OperationalError("database or disk is full")
        return real(self, run_id, metrics, *a, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    run_dir = tmp_path / "run"

    class Recover:  # the store comes back after training, before the job closes its run
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls["down"] = False

    with caplog.at_level(logging.WARNING), open_run(cfg, run_dir) as tracker:
        with Recover():
            gain = _train(cfg, run_dir, tracker)
    assert gain == gain  # a number: the job finished
    assert _steps(run_dir) == [1, 2, 3, 4]
    warnings = [r for r in caplog.records if "MLflow tracking failed" in r.getMessage()]
    assert len(warnings) == 1 and "database or disk is full" in warnings[0].getMessage()
    client = MlflowClient(uri)
    history = sorted(m.step for m in client.get_metric_history(tracker.run_id, "reward"))
    assert history == [1, 2, 3, 4]  # step 1 live, steps 2-4 sent from metrics.jsonl at the end
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_an_unreachable_tracking_uri_fails_in_seconds_with_the_way_out(tmp_path):
    cfg = compose_cfg(["mode=eval", f"tracking.tracking_uri=http://user:{PASSWORD}@127.0.0.1:{_free_port()}"])
    t0 = time.time()
    with pytest.raises(tracking_store.TrackingUnavailable) as err:
        with open_run(cfg, tmp_path):
            pytest.fail("the job must not start")
    assert time.time() - t0 < 20
    assert "tracking.enabled=false" in str(err.value) and PASSWORD not in str(err.value)


def test_the_first_error_is_the_one_reported(tmp_path, monkeypatch, store):
    """The job fails, then the store fails too while closing: the user sees the job's error."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg = compose_cfg(["mode=eval"])

    def broken(*a, **kw):
        raise sqlite3.OperationalError("database or disk is full")

    with pytest.raises(RuntimeError, match="the job's own error"):
        with open_run(cfg, tmp_path):
            for name in ("log_batch", "set_tag", "set_terminated", "log_text", "log_artifact"):
                monkeypatch.setattr(MlflowClient, name, broken)
            raise RuntimeError("the job's own error")


def test_upload_sends_a_run_dir_made_without_tracking(tmp_path, store):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2, 3)))
    uri = store
    assert tracking_main(["--upload", str(run_dir), "--uri", uri]) == 0
    from mlflow.tracking import MlflowClient

    run_id = (run_dir / "mlflow_run_id").read_text()
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "reward")) == [1, 2, 3]
    assert upload_run_dir(run_dir, uri=uri) == 0  # nothing sent twice


# ---------------------------------------------------------------- 3. checkpoints whole or not at all
@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A 4-step run (checkpoints 2 and 4), tracking off; tests copy it."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    _train(compose_cfg(FAST), run_dir)
    return run_dir


def _copy(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir, dst)
    return dst


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["model.safetensors", "optimizer.pt", "trainer_state.json", "missing_state"])
def test_resume_falls_back_from_a_damaged_newest_checkpoint(trained_dir, tmp_path, damage, caplog):
    """Before: SafetensorError / PytorchStreamReader failed / JSONDecodeError, checkpoint-2 unused."""
    from musique_rl.core.trainer import last_checkpoint

    run_dir = _copy(trained_dir, tmp_path / "run")
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    bad = ckpts / "checkpoint-4" / ("trainer_state.json" if damage == "missing_state" else damage)
    if damage == "missing_state":
        bad.unlink()
    else:
        _cut(bad)
    with caplog.at_level(logging.WARNING):
        assert last_checkpoint(ckpts, "auto") == str(ckpts / "checkpoint-2")
    assert str(bad) in caplog.text and "damaged" in caplog.text
    assert (ckpts / "damaged-checkpoint-4").is_dir()  # kept for a look, out of transformers' rotation
    with pytest.raises(ValueError, match="damaged"):
        last_checkpoint(ckpts, str(ckpts / "damaged-checkpoint-4"))


def test_resume_after_a_damaged_checkpoint_and_a_torn_metrics_line(trained_dir, tmp_path, caplog, capsys):
    run_dir = _copy(trained_dir, tmp_path / "run")
    _cut(run_dir / "checkpoints" / "checkpoint-4" / "model.safetensors", 0.9)
    torn = len((run_dir / "metrics.jsonl").read_text().splitlines()) + 1
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "rew')  # the torn last line of a killed job
    with caplog.at_level(logging.WARNING):
        _train(compose_cfg(FAST), run_dir)
    assert f"resuming from {run_dir / 'checkpoints' / 'checkpoint-2'}" in capsys.readouterr().out
    assert f"{run_dir / 'metrics.jsonl'}: last line {torn} is torn" in caplog.text  # rundir's one torn-line policy
    assert _steps(run_dir) == [1, 2, 3, 4]  # steps 1-2 kept, 3-4 trained again, nothing twice
    state = json.loads((run_dir / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_a_full_disk_at_a_save_says_so_and_leaves_the_run_resumable(tmp_path, monkeypatch):
    """Before: `basic_ios::clear: iostream error`, a checkpoint without trainer_state.json that then
    broke resume=auto. The model's weights are written, then the optimizer's write hits ENOSPC."""
    from musique_rl.core.checkpoints import DiskFullError
    from musique_rl.core.trainer import MusiqueGRPOTrainer, last_checkpoint

    real = MusiqueGRPOTrainer._save_optimizer_and_scheduler
    saves = {"n": 0}

    def full_disk(self, output_dir):
        saves["n"] += 1
        if saves["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.pt"))
        return real(self, output_dir)

    monkeypatch.setattr(MusiqueGRPOTrainer, "_save_optimizer_and_scheduler", full_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(DiskFullError) as err:
        _train(compose_cfg(FAST), run_dir)
    message = str(err.value)
    assert message.startswith("disk full: saving checkpoint-4") and "bytes free" in message
    assert str(run_dir / "checkpoints") in message and "resumes from checkpoint-2" in message
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("checkpoint-*")) == ["checkpoint-2"]  # no partial checkpoint-4
    assert not any((ckpts / ".staging").iterdir())
    monkeypatch.setattr(MusiqueGRPOTrainer, "_save_optimizer_and_scheduler", real)  # space again
    assert last_checkpoint(ckpts, "auto") == str(ckpts / "checkpoint-2")
    _train(compose_cfg(FAST), run_dir)
    assert _steps(run_dir) == [1, 2, 3, 4]


# ---------------------------------------------------------------- 4. SIGTERM like SIGINT
def test_sigterm_ends_the_run_killed_and_interrupted(tmp_path, store):
    """Before: rc 143 in 0.08 s with the MLflow run left RUNNING."""
    from mlflow.tracking import MlflowClient

    uri = store
    tracking_store.ensure_experiment(uri, "musique_rl")
    proc = _launch([*FAST, "train.max_steps=200", "tracking.enabled=true", f"tracking.tracking_uri={uri}",
                    "hydra.run.dir=run"], tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    run = MlflowClient(uri).get_run((tmp_path / "run" / "mlflow_run_id").read_text())
    assert run.info.status == "KILLED"
    assert run.data.tags["interrupted"] == "Terminated: SIGTERM received"


# ---------------------------------------------------------------- 5. secrets
def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_password_in_an_unreachable_tracking_uri_reaches_no_output(tmp_path):
    uri = f"http://user:{PASSWORD}@127.0.0.1:{_free_port()}"
    t0 = time.time()
    proc = _launch([*FAST, "tracking.enabled=true", f"tracking.tracking_uri={uri}"], tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and time.time() - t0 < 90
    assert "tracking.enabled=false" in out + err and "user:***@127.0.0.1" in out + err
    assert PASSWORD not in out + err
    assert (tmp_path / "outputs").is_dir() and not _files_holding(tmp_path, PASSWORD)


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow server on a free port (its store in tmp); yields (url, stop)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--default-artifact-root", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    procs = []

    def start():
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        import urllib.request

        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("mlflow server did not start")

    def stop():
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    start()
    yield port, start, stop
    stop()


@pytest.mark.slow
def test_a_password_in_a_live_tracking_uri_reaches_no_output(tmp_path, mlflow_server):
    port, _, _ = mlflow_server
    uri = f"http://user:{PASSWORD}@127.0.0.1:{port}"
    proc = _launch([*FAST, "tracking.enabled=true", f"tracking.tracking_uri={uri}", "hydra.run.dir=run"], tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["mlflow/uri"] == f"http://user:***@127.0.0.1:{port}"
    assert PASSWORD not in out + err
    assert not _files_holding(tmp_path / "run", PASSWORD)
    assert "user:***@" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_a_tracking_server_that_dies_mid_run_costs_nothing(tmp_path, mlflow_server):
    """Before: 12 min of MLflow retries, rc 1 from end_run, step 6 missing from metrics.jsonl."""
    port, start, stop = mlflow_server
    uri = f"http://127.0.0.1:{port}"
    proc = _launch([*FAST, "train.max_steps=6", "tracking.enabled=true", f"tracking.tracking_uri={uri}",
                    "hydra.run.dir=run"], tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    stop()
    t0 = time.time()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert time.time() - t0 < 180
    assert (out + err).count("MLflow tracking failed") == 1  # said once (Hydra logs to stdout)
    assert _steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]
    start()
    up = subprocess.run([sys.executable, "-m", "musique_rl.tracking", "--upload", str(tmp_path / "run"), "--uri", uri],
                        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr[-2000:]
    from mlflow.tracking import MlflowClient

    run_id = (tmp_path / "run" / "mlflow_run_id").read_text()
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, "reward")) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------- 6. impossible values
@pytest.mark.parametrize("override,key", [
    ("env.top_n=0", "env.top_n"), ("env.top_n=-1", "env.top_n"), ("train.max_steps=0", "train.max_steps"),
    ("train.num_generations=1", "train.num_generations"), ("loss.learning_rate=-1e-5", "loss.learning_rate"),
    ("train.prompts_per_step=0", "train.prompts_per_step"), ("train.temperature=0", "train.temperature"),
    ("train.top_p=1.5", "train.top_p"), ("env.max_completion_tokens=0", "env.max_completion_tokens"),
    ("train.save_steps=0", "train.save_steps"), ("loss.epsilon=0", "loss.epsilon"),
    ("train.vllm_gpu_memory_utilization=1.5", "train.vllm_gpu_memory_utilization"),
    ("gpu.vllm_gpu_memory_utilization=0", "gpu.vllm_gpu_memory_utilization"),
    ("gpu.vllm_max_model_len=0", "gpu.vllm_max_model_len"), ("gpu.vllm_health_timeout_s=0", "gpu.vllm_health_timeout_s"),
])
def test_impossible_values_are_refused_naming_the_key(override, key):
    with pytest.raises(schema.ConfigValueError, match=rf"{key}=\S+: must be"):
        schema.validate(compose_cfg([override]))


def test_every_shipped_config_passes_the_value_checks():
    schema.validate(compose_cfg([]))
    for h in sorted(p.stem for p in (CONF_DIR / "hypothesis").glob("*.yaml")):
        schema.validate(compose_cfg([f"+hypothesis={h}", "hypothesis.arm=control"]))


def test_an_impossible_value_fails_before_compute(tmp_path):
    proc = _launch(["env.top_n=0", "tracking.enabled=false"], tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "env.top_n=0: must be >= 1" in out + err
    assert "Loading weights" not in out + err


def test_skip_invalid_covers_malformed_lines(tmp_path, toy_record, caplog):
    from musique_rl.env.data import load_records

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(toy_record) + "\n{not json\n" + json.dumps({**toy_record, "id": "2hop__3_4"}) + "\n")
    env = compose_cfg([f"env.data={path}"]).env
    with pytest.raises(ValueError, match=r"line 2 is not valid JSON.*\n\(set env.skip_invalid=true"):
        load_records(str(path), env, 1)
    env = compose_cfg([f"env.data={path}", "env.skip_invalid=true"]).env
    stats: dict = {}
    with caplog.at_level(logging.WARNING):
        records = load_records(str(path), env, 1, stats=stats)
    assert len(records) == 2 and stats["invalid"] == 1 and stats["loaded"] == 3
    assert f"{path} line 2" in caplog.text


def test_a_sweeps_job_table_and_saved_configs_hold_no_password(tmp_path):
    from musique_rl.sweep import jobs as sweep_jobs
    from musique_rl.tracking.redact import redact_files

    uri = f"tracking.tracking_uri=http://user:{PASSWORD}@127.0.0.1:5000"
    sweep_jobs.write(tmp_path, [sweep_jobs.JobRow(0, [uri, "seed=1"], "FAILED", 1.0, f"MlflowException: {uri}")])
    assert PASSWORD not in (tmp_path / "jobs.json").read_text()
    assert sweep_jobs.read(tmp_path)[0].overrides == ["tracking.tracking_uri=http://user:***@127.0.0.1:5000", "seed=1"]
    saved = tmp_path / "overrides.yaml"
    saved.write_text(f"- {uri}\n- seed=1\n- hf_token=abc\n")
    redact_files([saved])
    assert saved.read_text() == "- tracking.tracking_uri=http://user:***@127.0.0.1:5000\n- seed=1\n- hf_token=<redacted>\n"


def test_a_full_disk_under_metrics_jsonl_is_named(tmp_path, monkeypatch):
    import builtins

    from transformers import TrainerControl, TrainerState, TrainingArguments

    from musique_rl.core.checkpoints import DiskFullError
    from musique_rl.job.console import StepLog

    real_open = builtins.open

    def full(path, mode="r", *a, **kw):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", full)
    state = TrainerState()
    state.global_step = 3
    with pytest.raises(DiskFullError, match=r"disk full: appending step 3 to metrics.jsonl at .* bytes free there"):
        StepLog(tmp_path / "metrics.jsonl").on_log(TrainingArguments(str(tmp_path), report_to="none"), state,
                                                   TrainerControl(), logs={"reward": 0.5})
