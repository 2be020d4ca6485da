"""Real MuSiQue for a user's own machine: one command fetches MuSiQue-Ans through `datasets` into a
folder, and jobs reach that folder through one option (env.data_dir, default $MUSIQUE_RL_DATA).
The hub is stood in for by a local dataset folder (tests/fixtures/musique_hub): no network here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg, job_cfg

from musique_rl import data as fetch_cmd
from musique_rl.env.data import load_records

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "tests" / "fixtures" / "musique_hub"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), **extra}


def test_fetch_writes_the_files_env_musique_reads_and_a_job_reads_them_through_env_data_dir(tmp_path, monkeypatch):
    out = tmp_path / "musique"
    proc = subprocess.run([sys.executable, "-m", "musique_rl.data", "fetch", "--source", str(HUB), "--out", str(out)],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{out / 'musique_ans_train.jsonl'}: 3 records (train)" in proc.stdout
    assert f"next: python -m musique_rl env=musique env.data_dir={out}" in proc.stdout
    want = [json.loads(line) for line in (HUB / "answerable" / "train.jsonl").read_text().splitlines()]
    assert [json.loads(line) for line in (out / "musique_ans_train.jsonl").read_text().splitlines()] == want
    # env=musique reads them by name under env.data_dir: train, and the held-out slice of validation
    cfg = job_cfg(["env=musique", f"env.data_dir={out}"])
    assert {r["id"] for r in load_records(cfg.env.data, cfg.env, 1)} == {r["id"] for r in want}
    assert len(load_records(cfg.env.eval_data, cfg.env, 1)) == 2
    # the same folder through the environment variable, the option's default
    monkeypatch.setenv("MUSIQUE_RL_DATA", str(out))
    assert job_cfg(["env=musique"]).env.data_dir == str(out)
    monkeypatch.delenv("MUSIQUE_RL_DATA")
    assert job_cfg(["env=musique"]).env.data_dir is None


def test_a_job_without_the_files_says_where_it_looked_and_how_to_fetch_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MUSIQUE_RL_DATA", raising=False)
    cfg = job_cfg(["env=musique"])
    with pytest.raises(FileNotFoundError) as err:
        load_records(cfg.env.data, cfg.env, 1)
    assert "'musique_ans_train.jsonl' does not exist" in str(err.value)
    assert "env.data_dir is unset" in str(err.value) and fetch_cmd.__name__ + " fetch --out DIR" in str(err.value)
    cfg = job_cfg(["env=musique", f"env.data_dir={tmp_path / 'nowhere'}"])
    with pytest.raises(FileNotFoundError, match=f"read from env.data_dir={tmp_path / 'nowhere'}"):
        load_records(cfg.env.data, cfg.env, 1)


def test_fetch_offline_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "musique"
    proc = subprocess.run([sys.executable, "-m", "musique_rl.data", "fetch", "--out", str(out)], cwd=tmp_path,
                          env=_env(tmp_path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("musique_rl.data fetch: could not read 'bdsaglam/musique' (config 'answerable', split 'train')")
    assert "Offline, or the Hugging Face Hub unreachable from here?" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(out.glob("*.jsonl"))


def test_a_source_that_is_not_musique_is_refused_naming_the_record(tmp_path):
    bad = tmp_path / "hub"
    (bad / "answerable").mkdir(parents=True)
    (bad / "README.md").write_text((HUB / "README.md").read_text())
    for split in ("train", "validation"):
        (bad / "answerable" / f"{split}.jsonl").write_text(json.dumps({"id": "x1", "question": "q?"}) + "\n")
    with pytest.raises(fetch_cmd.FetchError, match="is not MuSiQue-schema data: .*x1"):
        fetch_cmd.fetch(tmp_path / "out", source=str(bad))
    assert not list((tmp_path / "out").glob("*"))


def test_the_eval_command_of_the_docs_runs_on_fetched_files(tmp_path):
    """docs/howto/train.md's eval example: the oracle over real-format files in env.data_dir."""
    out = tmp_path / "musique"
    fetch_cmd.fetch(out, source=str(HUB))
    cfg = compose_cfg(["mode=eval", "policy=oracle", "env.retriever=golden", "env=musique", f"env.data_dir={out}",
                       "tracking.enabled=false"])
    from musique_rl.job.evaluate import evaluate

    result = evaluate(cfg, run_dir=tmp_path / "run")
    assert result.summary["n_records"] == 3 and result.summary["answer_em"] == 1.0
