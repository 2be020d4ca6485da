"""The run directory's one contract (musique_rl/base/rundir.py): one torn-line policy for metrics.jsonl,
whichever module reads it, and the summary / jobs files read back as written."""

from __future__ import annotations

import datetime as dt
import json
import logging

import pytest

from musique_rl.base import rundir
from musique_rl.doctor import sources
from musique_rl.tracking.reward_curves import save_reward_curves
from musique_rl.verdict.load import read_metrics as verdict_summary
from musique_rl.verdict.plots import reward_history
from musique_rl.verdict.sweep import VerdictError


def _log(run_dir, tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 5))
    (run_dir / rundir.METRICS_LOG).write_text(rows + tail)


def test_a_torn_last_line_is_skipped_with_a_note_naming_file_and_line(tmp_path, caplog):
    _log(tmp_path, '{"step": 5, "rew')  # a job killed mid-write
    notes: list[str] = []
    with caplog.at_level(logging.WARNING):
        rows = rundir.read_metrics_log(tmp_path / rundir.METRICS_LOG, notes)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert notes == [f"{tmp_path / rundir.METRICS_LOG}: last line 5 is torn (Unterminated string starting at): "
                     "a write cut short; read the 4 rows before it"]
    assert notes[0] in caplog.text


def test_a_torn_line_in_the_middle_is_an_error_for_every_reader(tmp_path):
    """The doctor, the reward-curve plot and the verdict's curves read the same file the same way."""
    _log(tmp_path, '{"step": 5, "rew\n{"step": 6, "reward": 0.6}\n')
    where = f"{tmp_path / rundir.METRICS_LOG}: line 5"
    with pytest.raises(rundir.RunFileError, match=where):
        rundir.read_metrics_log(tmp_path / rundir.METRICS_LOG)
    with pytest.raises(sources.SourceError, match=where):
        sources.read_run_dir(tmp_path)
    with pytest.raises(rundir.RunFileError, match=where):
        save_reward_curves(tmp_path)
    with pytest.raises(rundir.RunFileError, match=where):
        reward_history(tmp_path)


def test_every_reader_skips_the_same_torn_last_line(tmp_path):
    _log(tmp_path, '{"step": 5, "rew')
    assert sources.read_run_dir(tmp_path).histories["reward"] == [(s, s / 10) for s in range(1, 5)]
    assert reward_history(tmp_path) == [(s, s / 10) for s in range(1, 5)]
    assert save_reward_curves(tmp_path) == tmp_path / rundir.PLOTS / "reward_curves.png"


def test_resuming_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    _log(tmp_path, '{"step": 5, "rew')
    path = tmp_path / rundir.METRICS_LOG
    rundir.start_metrics_log(path, str(tmp_path / rundir.CHECKPOINTS / "checkpoint-3"))
    rundir.append_metrics_row(path, 4, {"reward": float("nan")})
    rows = rundir.read_metrics_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["reward"] != rows[-1]["reward"]  # NaN kept


def test_the_summary_reads_back_and_a_cut_one_is_named(tmp_path):
    assert rundir.read_summary(tmp_path) is None and verdict_summary(tmp_path) is None
    rundir.write_summary(tmp_path, {"train/reward_gain": 0.25, "eval": {"after": 1.0}})
    assert rundir.read_summary(tmp_path) == {"train/reward_gain": 0.25, "eval": {"after": 1.0}}
    assert verdict_summary(tmp_path) == {"train/reward_gain": 0.25, "eval.after": 1.0}
    (tmp_path / rundir.SUMMARY).write_text('{"train/reward_gain": 0.2')
    with pytest.raises(VerdictError, match=r"metrics.json is not valid JSON"):
        verdict_summary(tmp_path)


def test_jobs_rows_read_back_in_job_order(tmp_path):
    rows = [rundir.JobRow(2, ["seed=3"], "DIED"), rundir.JobRow(0, ["seed=1"], "COMPLETED", 4.0)]
    rundir.write_jobs(tmp_path, rows)
    back = rundir.read_jobs(tmp_path)
    assert [r.num for r in back] == [0, 2] and back[1].failed and not back[0].failed
    (tmp_path / rundir.JOBS).write_text('[{"num": 0, "colour": "red"}]')
    with pytest.raises(rundir.RunFileError, match="jobs.json: not a list of job rows"):
        rundir.read_jobs(tmp_path)


def test_a_default_run_dir_is_dated_and_unique_per_process():
    now = dt.datetime(2026, 5, 1, 10, 0, 0, 123456)
    assert rundir.stamp(now, pid=42) == "10-00-00.123456-42"
    assert str(rundir.default_run_dir(now)).startswith("outputs/2026-05-01/10-00-00.123456-")
