"""The compact console line and metrics.jsonl (musique_rl/job/console.py, written through musique_rl/base/rundir.py), and the per-step bounds."""

from __future__ import annotations

import json
from types import SimpleNamespace

from musique_rl.base.rundir import start_metrics_log as start_metrics_file
from musique_rl.doctor.bounds import out_of_bounds
from musique_rl.job.console import StepLog


def test_the_line_names_only_what_is_out_of_bounds():
    log = StepLog(None)
    first = log.line(1, 60, {"reward": 0.5, "kl": 0.0012, "h02/env_tokens_with_loss": 0.0, "h06/logp_gap_mean": 1e-6})
    assert first.startswith("step 1/60 | reward 0.500 | kl 0.0012") and first.endswith("instruments in bounds")
    line = log.line(2, 60, {"reward": 0.7, "h02/env_tokens_with_loss": 12.0, "h06/logp_gap_mean": 0.21})
    assert "reward 0.700 trend +0.200" in line
    assert line.endswith("out of bounds: h02/env_tokens_with_loss=12, h06/logp_gap_mean=0.21")
    assert log.line(60, 60, {"train_runtime": 12.5}).startswith("done: train_runtime 12.5")


def test_updates_are_not_judged_during_the_warmup():
    tiny = {"h08/update_weight_ratio": 1e-6}
    assert out_of_bounds(tiny) == ["h08/update_weight_ratio=1e-06"]
    assert out_of_bounds(tiny, skip=("h08/",)) == []
    assert out_of_bounds({"h02/attention_coverage": 1.0, "h04/budget_cap_share": float("nan")}) == []


def test_metrics_file_gets_every_numeric_metric_and_full_mode_prints_trls_dict(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    start_metrics_file(path)
    state = SimpleNamespace(is_world_process_zero=True, global_step=3, max_steps=5)
    StepLog(path).on_log(None, state, None, logs={"reward": 0.4, "h01/adv_abs_max": 2.0, "note": "text"})
    assert json.loads(path.read_text()) == {"step": 3, "reward": 0.4, "h01/adv_abs_max": 2.0}
    assert capsys.readouterr().out.startswith("step 3/5 | reward 0.400")
    full, written = StepLog(path, full=True), []
    full.training_bar = SimpleNamespace(write=written.append)
    full.on_log(None, state, None, logs={"reward": 0.4, "h01/adv_abs_max": 2.0})
    assert written == [str({"reward": "0.4", "h01/adv_abs_max": "2"})]  # transformers' own formatting
    assert len(path.read_text().splitlines()) == 2  # the file gets every step in both modes


def test_a_resumed_run_keeps_the_steps_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 8)))
    start_metrics_file(path, str(tmp_path / "checkpoints" / "checkpoint-5"))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    start_metrics_file(path)  # a fresh run starts a fresh file
    assert path.read_text() == ""
