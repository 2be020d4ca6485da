"""mode=eval (musique_rl/job/evaluate.py): the metrics it returns (the last output line of the command), metrics.json, episodes.jsonl."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REAL_MUSIQUE_DIR
from hydra import compose, initialize_config_dir

from musique_rl.job.evaluate import evaluate
from musique_rl.schema import CONF_DIR  # importing it registers the schema and resolvers

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REAL_MUSIQUE_DIR / "train_sample_60.jsonl"


def cfg_for(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=["mode=eval", "tracking.enabled=false", *overrides])


@pytest.fixture
def sample(real_records):
    return str(SAMPLE)


def test_oracle_golden_eval_reports_the_ceiling(sample, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = evaluate(cfg_for("policy=oracle", "env.retriever=golden", f"env.data={sample}"))
    m, reward = result.summary, result.objective
    assert m == json.loads((tmp_path / "metrics.json").read_text())
    assert m["answer_em"] == m["citation_recall"] == m["retrieval_recall"] == 1.0
    assert m["reward"] == pytest.approx(m["reward_max"]) == pytest.approx(reward)
    assert m["reward/hops_2"] == pytest.approx(1.0) and m["reward/hops_3"] == pytest.approx(1.5) and m["reward/hops_4"] == pytest.approx(2.0)
    assert m["n_records"] == m["n_scored"] == 60 and m["reward_errors"] == 0
    rows = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and all(r["components"]["answer_em"] == 1.0 for r in rows)


def test_replay_of_episodes_jsonl_reproduces_the_metrics(sample, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = evaluate(cfg_for("policy=oracle", "env.retriever=bm25", f"env.data={sample}")).summary
    assert 0 < first["retrieval_recall"] < 1
    (tmp_path / "episodes.jsonl").rename(tmp_path / "old.jsonl")
    again = evaluate(cfg_for("policy=replay", f"replay_path={tmp_path / 'old.jsonl'}", f"env.data={sample}")).summary
    for k in ("reward", "answer_em", "retrieval_recall", "retrieval_precision", "citation_f1", "tool_calls_mean"):
        assert again[k] == pytest.approx(first[k]), k


def test_no_tool_floor_and_reward_preset(sample, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = evaluate(cfg_for("policy=no_tool", "reward=answer_only", f"env.data={sample}")).summary
    assert m["reward"] == 0.0 and m["format"] == 1.0 and m["reward_name"] == "answer_only"


def test_replay_needs_a_path(sample):
    with pytest.raises(ValueError, match="replay_path"):
        evaluate(cfg_for("policy=replay", f"env.data={sample}"))


def test_cli_last_line_is_json_and_metrics_land_in_the_run_dir(sample, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "musique_rl", "mode=eval", "policy=oracle", "env.retriever=golden",
         f"env.data={sample}", "tracking.enabled=false", f"hydra.run.dir={run}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.stdout.count('"answer_em":') == 1  # the result line, printed once
    assert m["answer_em"] == 1.0 and json.loads((run / "metrics.json").read_text()) == m
    assert (run / "episodes.jsonl").exists()
