"""MLflow tracking: runs, params, tags, nesting, failures, resume, and never a secret in a param or tag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers
from musique_rl.tracking import provenance, store
from musique_rl.tracking.redact import is_secret_key, redact, redact_tree, redact_value
from musique_rl.tracking.sink import open_run

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_PlantedSecretToken0123456789"
PASSWORD = "hunter2-planted-pw"
URI_WITH_PASSWORD = f"http://alice:{PASSWORD}@127.0.0.1:9/corpus.json"


@pytest.mark.parametrize(
    "text,secret",
    [
        (URI_WITH_PASSWORD, PASSWORD),
        (f"postgresql://bob:{PASSWORD}@db.local:5432/mlflow", PASSWORD),
        (r"env.corpus=http\://alice\:" + PASSWORD + r"@127.0.0.1\:9/c.json", PASSWORD),  # Hydra-escaped
        (f"model={TOKEN}", TOKEN),
        ("key sk-ant-api03-abcdefghijklmnopqrstuvwx", "sk-ant-api03-abcdefghijklmnopqrstuvwx"),
        ("ghp_abcdefghijklmnopqrstuvwxyz0123", "ghp_abcdefghijklmnopqrstuvwxyz0123"),
        ("https://h/x.json?token=abc123def&x=1", "abc123def"),
        ("Authorization: Bearer abcdefghijkl.mnop", "abcdefghijkl.mnop"),
        ("AKIAABCDEFGHIJKLMNOP", "AKIAABCDEFGHIJKLMNOP"),
    ],
)
def test_redact_masks_credential_shapes(text, secret):
    assert secret not in redact(text)


def test_redact_masks_secret_env_values_of_any_shape(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "plain-looking-value-42")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correcthorse")
    assert redact("path/plain-looking-value-42/x and correcthorse") == "path/***/x and ***"


def test_redact_keeps_innocent_values():
    for v in ["Qwen/Qwen2.5-7B-Instruct", "sqlite:///mlflow.db", "bdsaglam/musique,answerable,train[:256]",
              "http://127.0.0.1:5000", "1e-05", "[q_proj, v_proj]"]:
        assert redact(v) == v
    assert not is_secret_key("env.max_tokens_per_turn") and not is_secret_key("env.max_prompt_tokens")
    assert is_secret_key("hub.hf_token") and is_secret_key("db.password") and is_secret_key("openai.api_key")
    assert redact_value("hub.hf_token", "anything") == "<redacted>"
    assert redact_tree({"a": {"api_key": "x1234567"}, "b": [URI_WITH_PASSWORD]}) == {
        "a": {"api_key": "<redacted>"}, "b": ["http://alice:***@127.0.0.1:9/corpus.json"]}


def test_flatten_and_run_name():
    assert provenance.flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+hypothesis=h01", "hypothesis.arm=control", "seed=2"])
        assert provenance.run_name(cfg) == "h01-control-s2"
        assert store.experiment_name(cfg) == "h01"
        cfg = compose(config_name="train", overrides=["+fault=stale_sampler"])
        assert provenance.run_name(cfg) == "fault-stale_sampler-s1"
        assert store.experiment_name(cfg) == "musique_rl"


def test_tracking_uri_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert store.tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////x/env.db")
    assert store.tracking_uri(None, tmp_path) == "sqlite:////x/env.db"


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_job_logs_params_tags_config_and_resumes(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = _compose(["+hypothesis=h02", "hypothesis.arm=treatment", "seed=3", "mode=eval"])
    with open_run(cfg, tmp_path / "job") as t:
        t.log_metrics({"reward": 0.5, "skip": None, "flag": True, "note": "x"}, step=4)
        first = t.run_id
    client = MlflowClient(uri)
    run = client.get_run(first)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "h02"
    assert run.data.params["train.mask_env_tokens"] == "False"  # resolved ${arm:...}
    assert run.data.params["seed"] == "3"
    tags = run.data.tags
    assert (tags["hypothesis"], tags["arm"], tags["seed"], tags["fault"]) == ("h02", "treatment", "3", "none")
    assert len(tags["git_commit"]) == 40
    assert set(run.data.metrics) == {"reward"}
    assert [a.path for a in client.list_artifacts(first, "config")] == ["config/resolved.yaml"]
    # same job dir again (a requeued SLURM job): the same run continues
    with open_run(cfg, tmp_path / "job") as t:
        assert t.run_id == first


def test_preempted_job_ends_killed_and_its_resume_clears_the_interruption(tmp_path, monkeypatch):
    """submitit exits a preempted job with SystemExit after requeueing it: KILLED, not FAILED; the
    requeued attempt resumes the same run and leaves no stale error/interrupted tag behind."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = _compose(["mode=eval"])
    client = MlflowClient(uri)
    with pytest.raises(SystemExit):
        with open_run(cfg, tmp_path / "job") as t:
            raise SystemExit(-1)
    run = client.get_run(t.run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["interrupted"] == "SystemExit: -1" and "error" not in run.data.tags
    client.set_tag(t.run_id, "error", "RuntimeError: from an older attempt")
    with open_run(cfg, tmp_path / "job") as resumed:
        assert resumed.run_id == t.run_id
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert "interrupted" not in run.data.tags and "error" not in run.data.tags
    assert run.data.tags["resumes"] == "1"


def test_job_failure_ends_run_failed_with_traceback(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = _compose(["mode=eval"])
    with pytest.raises(RuntimeError, match="boom"):
        with open_run(cfg, tmp_path / "job") as t:
            raise RuntimeError(f"boom {TOKEN}")
    client = MlflowClient(uri)
    run = client.get_run(t.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("RuntimeError: boom") and TOKEN not in run.data.tags["error"]
    text = open(client.download_artifacts(t.run_id, "error/traceback.txt")).read()
    assert "RuntimeError" in text and TOKEN not in text


def test_the_job_pipe_ends_a_failing_jobs_run_failed_and_raises(tmp_path, monkeypatch):
    """app.run outside a multirun: the work's error ends its MLflow run FAILED and goes on to the caller."""
    from mlflow.tracking import MlflowClient

    from musique_rl.job.app import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # outside Hydra the run dir is outputs/<date>/<stamp> here

    def work(cfg, tracker, run_dir):
        assert tracker is not None and (run_dir / "mlflow_run_id").read_text() == tracker.run_id
        raise ValueError("planted")

    with pytest.raises(ValueError, match="planted"):
        run(_compose(["mode=eval"]), work)
    client = MlflowClient(uri)
    (failed,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert failed.info.status == "FAILED" and failed.data.tags["error"] == "ValueError: planted"


def test_tracking_disabled_yields_none(tmp_path):
    cfg = _compose(["tracking.enabled=false"])
    with open_run(cfg, tmp_path) as t:
        assert t is None


def test_multirun_nests_jobs_survives_a_failure_and_never_logs_a_secret(tmp_path):
    """The real launcher (parallel local processes) racing on a fresh sqlite store, a failing job,
    a planted HF_TOKEN and a URI with a password in a config value and in the override string."""
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(PYTHONPATH=str(ROOT), HF_TOKEN=TOKEN, TRACKING_APP_FAIL="2")
    cmd = [sys.executable, str(ROOT / "tests" / "tracking_app.py"), "-m", "seed=1,2",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", f"env.corpus={URI_WITH_PASSWORD}",
           f"model.name_or_path={TOKEN}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # one failed job: the others finish, the multirun says so
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    parents = [r for r in runs if r.data.tags.get("sweep_parent") == "true"]
    jobs = [r for r in runs if r not in parents]
    assert len(parents) == 1 and len(jobs) == 2
    parent = parents[0]
    assert parent.info.status == "FAILED" and parent.data.tags["failed_jobs"] == "1" and parent.data.tags["jobs"] == "2"
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == {parent.info.run_id}
    assert {r.data.tags["sweep_id"] for r in jobs} == {parent.data.tags["sweep_id"]}
    status = {r.data.tags["seed"]: r.info.status for r in jobs}
    assert status == {"1": "FINISHED", "2": "FAILED"}
    ok = next(r for r in jobs if r.info.status == "FINISHED")
    assert "diagnosis.json" in [a.path for a in client.list_artifacts(ok.info.run_id)]
    job_dir = tmp_path / "sweep" / "0"  # seed=1: a copy beside metrics.json, the same ranked list
    with open(client.download_artifacts(ok.info.run_id, "diagnosis.json")) as fh:
        assert json.loads((job_dir / "diagnosis.json").read_text()) == json.load(fh)
    assert "plots" in [a.path for a in client.list_artifacts(ok.info.run_id)]
    for r in runs:
        for k, v in {**r.data.params, **r.data.tags}.items():
            assert TOKEN not in v and PASSWORD not in v, (k, v)
    assert "seed=1,2" in parent.data.tags["overrides"] and "alice:***@" in parent.data.tags["overrides"]
    assert ok.data.params["env.corpus"] == "http://alice:***@127.0.0.1:9/corpus.json"
    for r in jobs:  # the config artifact is redacted too
        text = open(client.download_artifacts(r.info.run_id, "config/resolved.yaml")).read()
        assert TOKEN not in text and PASSWORD not in text


def test_a_docs_edit_does_not_make_the_code_dirty(tmp_path):
    """A sweep's verdict rewrites docs/STATUS.md: the next sweep's runs must still record clean code,
    while an edit to the package or a config marks them dirty."""
    import subprocess

    from musique_rl.tracking.provenance import git_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "musique_rl").mkdir()
    (tmp_path / "musique_rl" / "x.py").write_text("a = 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "STATUS.md").write_text("rows\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "init", "--allow-empty")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "files")
    (tmp_path / "docs" / "STATUS.md").write_text("new rows\n")
    sha, dirty = git_commit(tmp_path)
    assert len(sha) == 40 and not dirty
    (tmp_path / "musique_rl" / "x.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == (sha, True)
