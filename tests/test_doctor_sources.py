"""The doctor on logs it did not make: plain TRL GRPOTrainer runs (tests/fixtures/trl_runs/, made by
``python benchmarks/trl_fixture_runs.py``), read from trainer_state.json, W&B's CSV export, a JSONL
table and an MLflow run of transformers' MLflowCallback; and this project's own run directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from musique_rl.doctor import sources
from musique_rl.doctor.cli import main
from musique_rl.doctor.diagnose import diagnose_log

FIX = Path(__file__).resolve().parent / "fixtures" / "trl_runs"
HEALTHY = ("healthy_seed1", "healthy_seed2", "healthy_kl")
# What each defect's log shows: the top finding's (hypothesis, check). Built from what the defect
# does to TRL's metrics (docs/diagnostics.md), not from the doctor's output.
NAMED = {
    "lr_to_zero": ("h08", "learning_rate_zero"),
    "truncated": ("h04", "completions_truncated"),
    "constant_reward": ("h05", "reward_function_constant"),
}
# Defects TRL's logs cannot show: the doctor must say which musique_rl instrument would decide.
UNSEEN = {
    "shuffled_reward": ("h05", "reward audit"),
    "temperature_mismatch": ("h06", "+hypothesis=h06"),
}


def diagnosis(name: str, reader=sources.read_trainer_state) -> list[dict]:
    return diagnose_log(reader(FIX / name))


def flagged(diag: list[dict]) -> list[tuple[str, str]]:
    return [(d.hypothesis, d.check) for d in diag if d.flagged]


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_trl_runs_are_clean(name):
    diag = diagnosis(name)
    assert flagged(diag) == [], flagged(diag)
    assert diag.top is None


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_defect_the_log_can_show_is_the_top_finding(name):
    top = (diagnosis(name)).top
    assert top is not None and (top.hypothesis, top.check) == NAMED[name], top


def test_truncation_ranks_above_what_it_causes():
    """Cut completions score 0 under both reward functions and every group ties: those are the
    truncation's consequences, flagged below it and saying so."""
    diag = diagnosis("truncated")
    ranked = flagged(diag)
    assert ranked[0] == ("h04", "completions_truncated")
    for d in diag[1:]:
        if d.flagged:
            assert "consequence" in d.verdict.lower(), d


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_a_defect_trl_does_not_log_is_not_called_clean_silently(name):
    hyp, words = UNSEEN[name]
    diag = diagnosis(name)
    assert hyp not in {h for h, _ in flagged(diag)}  # nothing in the log names it ...
    said = " ".join(d.verdict for d in diag if d.hypothesis == hyp)
    assert words in said, said  # ... and the doctor says what would


def test_frozen_lora_shows_in_the_log_as_a_zero_gradient():
    """lora_alpha=0: the adapter's gradients are exactly 0; TRL logs grad_norm 0 at every step."""
    run = sources.read_trainer_state(FIX / "frozen_lora")
    assert max(v for _, v in run.histories["grad_norm"]) == 0.0
    assert min(v for _, v in sources.read_trainer_state(FIX / "healthy_seed1").histories["grad_norm"]) > 0


# The rule that reads grad_norm == 0 is the field alarm `gradient_zero` (doctor/stages/gradient.py). Its reward
# even "rises" at p = 0.044 by chance, so the flat-reward rule cannot be what names it.
def test_frozen_lora_is_flagged():
    diag = diagnosis("frozen_lora")
    assert flagged(diag), "a policy that never moves must not be called clean"
    assert flagged(diag)[0] == ("h01", "gradient_zero")


def test_the_three_readers_give_the_same_histories():
    """trainer_state.json, W&B's CSV (train/ names, _step, train/global_step) and a JSONL table of one
    run read to the same histories in TRL's names, keyed by the trainer's step."""
    state = sources.open_source(str(FIX / "healthy_seed1"))
    csv_ = sources.open_source(str(FIX / "healthy_seed1" / "wandb_export.csv"))
    jsonl = sources.open_source(str(FIX / "healthy_seed1" / "history.jsonl"))
    for key in ("reward", "frac_reward_zero_std", "rewards/answer_correct/std", "completions/clipped_ratio",
                "learning_rate"):
        assert state.histories[key] == csv_.histories[key] == jsonl.histories[key], key
    assert [s for s, _ in state.histories["reward"]] == list(range(1, 61))
    assert not any(k.startswith(("train/", "_")) for k in csv_.histories)


def test_trainer_state_found_in_file_checkpoint_and_output_dir(tmp_path):
    out = tmp_path / "out"
    for n in (5, 60):  # the newest checkpoint (most steps), not the last one listed
        (out / f"checkpoint-{n}").mkdir(parents=True)
    shutil.copy(FIX / "lr_to_zero" / "checkpoint-60" / "trainer_state.json", out / "checkpoint-60")
    old = json.loads((out / "checkpoint-60" / "trainer_state.json").read_text())
    old["log_history"] = old["log_history"][:5]
    (out / "checkpoint-5" / "trainer_state.json").write_text(json.dumps(old))
    assert sources.find_trainer_state(out) == out / "checkpoint-60" / "trainer_state.json"
    assert sources.find_trainer_state(out / "checkpoint-5") == out / "checkpoint-5" / "trainer_state.json"
    assert len(sources.read_trainer_state(out).histories["reward"]) == 60
    with pytest.raises(sources.SourceError, match=str(tmp_path / "empty")):
        (tmp_path / "empty").mkdir()
        sources.open_source(str(tmp_path / "empty"))


def test_mlflow_run_of_transformers_callback(tmp_path):
    """The run transformers' MLflowCallback logged (report_to="mlflow"): TRL's names survive its
    sanitiser, the TrainingArguments arrive as params; same verdict as the trainer_state."""
    store = tmp_path / "store.db"
    shutil.copy(FIX / "mlflow_store.db", store)  # the reader must not touch the fixture
    ids = json.loads((FIX / "mlflow_runs.json").read_text())
    uri = f"sqlite:///{store}"
    run = sources.open_source(f"mlflow:{ids['truncated']}", uri)
    assert run.name == "truncated" and run.params["max_completion_length"] == "6"
    assert run.histories["reward"] == sources.read_trainer_state(FIX / "truncated").histories["reward"]
    assert (diagnose_log(run)).top.check == "completions_truncated"
    assert sources.open_source(f"runs:/{ids['healthy_seed1']}/model", uri).name == "healthy_seed1"
    with pytest.raises(sources.SourceError, match="0123456789abcdef"):
        sources.open_source("mlflow:0123456789abcdef", uri)


def test_a_trl_0_16_log_reads_in_todays_names():
    """TRL 0.16.1 (made by the same script under that version) logged `completion_length`,
    `rewards/<f>` (the mean only) and one `clip_ratio`: read as today's names, same verdicts."""
    healthy = sources.open_source(str(FIX / "trl0161_healthy_seed1"))
    assert "completion_length" not in healthy.histories and "completions/mean_length" in healthy.histories
    assert "rewards/answer_correct/mean" in healthy.histories and "clip_ratio/region_mean" in healthy.histories
    assert any("pre-0.17" in n for n in healthy.notes)
    assert flagged(diagnose_log(healthy)) == []
    top = (diagnose_log(sources.open_source(str(FIX / "trl0161_lr_to_zero")))).top
    assert (top.hypothesis, top.check) == NAMED["lr_to_zero"]


def test_a_current_name_wins_over_its_legacy_twin():
    hist, notes = sources.normalise_names({"completion_length": [(1, 5.0)], "completions/mean_length": [(1, 7.0)],
                                           "train/reward": [(1, 1.0)]})
    assert hist == {"completions/mean_length": [(1, 7.0)], "reward": [(1, 1.0)]} and notes == []


def test_run_dir_copied_elsewhere_with_a_torn_last_line(tmp_path, caplog):
    """Our run dir (metrics.jsonl + .hydra/config.yaml) read where it was copied to; a run killed
    mid-write leaves a torn last line: dropped with a warning. A torn line in the middle is an error."""
    run_dir = tmp_path / "copied_run"
    (run_dir / ".hydra").mkdir(parents=True)
    lines = (FIX / "lr_to_zero" / "history.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 61, "rew')
    (run_dir / ".hydra" / "config.yaml").write_text("reward:\n  weights:\n    answer_em: 1.0\n")
    run = sources.read_run_dir(run_dir)
    assert len(run.histories["reward"]) == 60 and run.params["reward.weights.answer_em"] == "1.0"
    assert "torn" in caplog.text and str(run_dir / "metrics.jsonl") in caplog.text
    (run_dir / "metrics.jsonl").write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(sources.SourceError, match=r"metrics.jsonl: line 2"):
        sources.read_run_dir(run_dir)


def test_a_sweep_jobs_arm_dependent_params_read_as_the_job_resolved_them(tmp_path):
    """A paired sweep's job saves ``env.max_tokens_per_turn: ${arm:48,24}`` with its arm beside it: the
    doctor reads the value that arm ran with (its budget, learning-rate and beta expectations use it),
    not the text or a default."""
    lines = (FIX / "lr_to_zero" / "history.jsonl").read_text().splitlines()
    for arm, want in (("control", "48"), ("treatment", "24")):
        run_dir = tmp_path / arm
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run_dir / ".hydra" / "config.yaml").write_text(
            f"hypothesis:\n  arm: {arm}\nmodel:\n  learning_rate: 0.001\nenv:\n  max_tokens_per_turn: ${{arm:48,24}}\n"
            "loss:\n  learning_rate: ${arm:${model.learning_rate},${mul:10,${model.learning_rate}}}\n")
        params = sources.read_run_dir(run_dir).params
        assert params["env.max_tokens_per_turn"] == want
        assert float(params["loss.learning_rate"]) == (0.001 if arm == "control" else 0.01)


def test_cli_from_three_kinds_and_a_triage_table(tmp_path, capsys):
    store = tmp_path / "store.db"
    shutil.copy(FIX / "mlflow_store.db", store)
    ids = json.loads((FIX / "mlflow_runs.json").read_text())
    inputs = [str(FIX / n) for n in (*HEALTHY, *NAMED, *UNSEEN, "frozen_lora")]
    inputs += [str(FIX / "truncated" / "wandb_export.csv"), f"mlflow:{ids['truncated']}"]
    code = main(["--from", *inputs, "--tracking-uri", f"sqlite:///{store}", "--out", str(tmp_path / "diag")])
    assert code == 0
    out = capsys.readouterr().out
    table = out[out.index("run  "):].splitlines()

    def row(name: str) -> str:
        return next(line for line in table if line.startswith(name + " "))

    for name in HEALTHY:
        assert row(name).split()[1] == "clean"
    for name, (hyp, check) in NAMED.items():
        assert f"{hyp} {check}" in row(name)
    assert "h04 completions_truncated" in row("truncated/wandb_export.csv")
    assert "h04 completions_truncated" in row(f"truncated [mlflow:{ids['truncated']}]")
    written = sorted(p.parent.name for p in (tmp_path / "diag").glob("*/diagnosis.json"))
    assert len(written) == len(inputs)
    one = json.loads((tmp_path / "diag" / "truncated_wandb_export.csv" / "diagnosis.json").read_text())
    assert one[0]["check"] == "completions_truncated" and one[0]["rank"] == 1


def test_cli_run_dir_writes_beside_the_input_and_names_an_unreadable_path(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(FIX / "truncated" / "history.jsonl", run_dir / "metrics.jsonl")
    assert main(["--run-dir", str(run_dir)]) == 0
    assert json.loads((run_dir / "diagnosis.json").read_text())[0]["check"] == "completions_truncated"
    assert "h04" in capsys.readouterr().out
    missing = tmp_path / "nowhere" / "trainer_state.json"
    assert main(["--from", str(missing), "--no-write"]) == 2
    assert str(missing) in capsys.readouterr().err


@pytest.mark.parametrize("tracked", [False, True], ids=["tracking_off", "tracking_on"])
def test_every_training_run_writes_its_diagnosis(tmp_path, tracked):
    """A 2-step job through the real command: the doctor runs after training on the run dir's
    metrics.jsonl, writes diagnosis.json there and prints its flagged findings, tracking on or off;
    with tracking on, the job's MLflow run holds the metrics, the same diagnosis.json and the
    diagnosis tags. The result JSON is the last line of output, and printed once."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "musique_rl", "env=arith", "reward=answer_em", f"tracking.enabled={str(tracked).lower()}",
           "train.max_steps=2", "train.prompts_per_step=2", "train.num_generations=4", "train.eval_episodes=4",
           "env.arith.num_train=40", "env.arith.num_eval=8", "diagnostics.trajectory_views=0",
           f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diag = json.loads((run_dir / "diagnosis.json").read_text())
    assert [d["rank"] for d in diag] == list(range(1, len(diag) + 1))
    assert "doctor (" in proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["train/steps"] == 2 and summary == json.loads((run_dir / "metrics.json").read_text())
    assert sum('"train/reward_gain"' in line for line in lines) == 1  # the result line, once
    if not tracked:
        assert not (tmp_path / "mlflow.db").exists() and "mlflow/run_id" not in summary
        # the same diagnosis from the command line, on a copy of the run dir
        copy = shutil.copytree(run_dir, tmp_path / "copied")
        (copy / "diagnosis.json").unlink()
        assert main(["--run-dir", str(copy)]) == 0
        assert json.loads((copy / "diagnosis.json").read_text()) == diag
        return
    from mlflow.tracking import MlflowClient

    from musique_rl.doctor.diagnosis import Diagnosis
    from musique_rl.doctor.report import diagnosis_tags

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(summary["mlflow/run_id"])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward")) == [1, 2]
    assert run.data.metrics["train/reward_gain"] == pytest.approx(summary["train/reward_gain"], nan_ok=True)
    with open(client.download_artifacts(run.info.run_id, "diagnosis.json")) as fh:
        assert json.load(fh) == diag
    assert diagnosis_tags(Diagnosis.from_json(diag)).items() <= run.data.tags.items()
    assert "plots/reward_curves.png" in [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
