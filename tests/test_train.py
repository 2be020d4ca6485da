"""``train(cfg)`` end to end on the tiny model: the result it returns, summary keys, metrics.json."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import with_keys

from musique_rl.job.train import reward_curve, same_random_numbers, summarise

ROOT = Path(__file__).resolve().parents[1]
ROOT_KEYS = ("train/reward_first10", "train/reward_last10", "train/reward_gain", "eval/gain/answer_em")


def test_summary_windows_and_gains():
    curve = [0.1] * 10 + [0.5] * 5 + [0.9] * 10
    before = {"reward": 0.4, "answer_em": 0.3}
    after = {"reward": 0.7, "answer_em": 0.6}
    s = summarise(curve, before, after, before, before)
    assert s["train/reward_first10"] == pytest.approx(0.1) and s["train/reward_last10"] == pytest.approx(0.9)
    assert s["train/reward_gain"] == pytest.approx(0.8)
    assert s["eval/gain/answer_em"] == pytest.approx(0.3) and s["eval/gain_greedy/answer_em"] == 0.0
    history = [{"reward": 0.2, "step": 1}, {"loss": 1.0, "step": 1}, {"reward": 0.4, "step": 2}, {"train_runtime": 3}]
    assert reward_curve(history) == [0.2, 0.4]


def test_held_out_evaluations_draw_the_same_random_numbers_and_training_keeps_its_stream():
    import torch

    saved: list = []
    torch.manual_seed(7)
    with same_random_numbers(saved):
        before = torch.rand(5)
    training = torch.rand(3)  # training continues from where the first evaluation left the stream
    torch.manual_seed(7)
    torch.rand(5)
    assert torch.equal(training, torch.rand(3))
    outer = torch.random.get_rng_state()
    with same_random_numbers(saved):
        after = torch.rand(5)
    assert torch.equal(before, after)
    next_draw = torch.rand(3)
    torch.random.set_rng_state(outer)
    assert torch.equal(next_draw, torch.rand(3))  # the replay left the outer stream where it was


def test_a_short_run_compares_disjoint_halves_and_never_reports_a_silent_zero():
    s = summarise([0.2] * 6 + [0.5] * 6, {}, {}, {}, {})  # 12 steps: steps 1-6 against 7-12
    assert s["train/reward_window"] == 6 and s["train/reward_gain"] == pytest.approx(0.3)
    s = summarise([0.2, 0.6, 0.4], {}, {}, {}, {})
    assert s["train/reward_window"] == 1 and s["train/reward_gain"] == pytest.approx(0.2)
    one = summarise([0.7], {}, {}, {}, {})
    assert one["train/reward_window"] == 0 and math.isnan(one["train/reward_gain"])


def test_train_runs_end_to_end_and_returns_the_summary(tiny_cfg, warm_tiny, tmp_path, capsys):
    from musique_rl.job.train import train

    cfg = with_keys(tiny_cfg, {"train.max_steps": 2, "train.prompts_per_step": 2, "train.num_generations": 4,
                               "train.eval_episodes": 8})
    result = train(cfg, run_dir=tmp_path)  # no tracker: not tracked
    out = capsys.readouterr().out.strip().splitlines()
    summary = result.summary
    assert json.loads((tmp_path / "metrics.json").read_text()) == summary
    assert result.objective == summary["train/reward_gain"] and result.diagnose
    assert "mlflow/run_id" not in summary
    # the result line is printed once, by the job pipe (app.run), not by train()
    assert not any(line.startswith("{") for line in out)
    for key in ROOT_KEYS:
        assert key in summary
    for part in ("before", "after", "gain", "before_greedy", "after_greedy"):
        for comp in ("reward", "answer_em", "answer_f1", "citation_f1"):
            assert f"eval/{part}/{comp}" in summary
    assert summary["train/steps"] == 2 and summary["train/reward_window"] == 1
    # the console: one line per step, not TRL's dict; every metric of every step in metrics.jsonl
    steps = [line for line in out if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1/2", "step 2/2"]
    assert not any("'completions/mean_length'" in line for line in out)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    assert "h02/env_tokens_with_loss" in rows[0] and "completions/mean_length" in rows[0]
    assert (tmp_path / "episodes_before.jsonl").exists() and (tmp_path / "checkpoints").is_dir()
    assert any("held-out sampled" in line for line in out)
    # the instruments report from the first step on, the sampler/trainer parity probe included
    state = json.loads(max((tmp_path / "checkpoints").glob("checkpoint-*/trainer_state.json")).read_text())
    first = next(h for h in state["log_history"] if h.get("step") == 1 and "reward" in h)
    for key in ("h01/adv_abs_max", "h02/env_tokens_with_loss", "h06/parity_sampler_trainer", "h08/update_weight_ratio"):
        assert key in first, sorted(first)
    assert first["h06/parity_stale"] == 0.0


def test_cli_help_lists_the_train_settings():
    """The entrypoint composes without training (a typo would fail before any compute)."""
    out = subprocess.run(
        [sys.executable, "-m", "musique_rl", "--cfg", "job", "train.max_steps=5"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "max_steps: 5" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "musique_rl", "train.max_stepz=5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "max_stepz" in bad.stderr


@pytest.mark.slow
def test_default_job_learns_on_three_seeds_and_the_shuffled_control_does_not(tmp_path):
    """Issue 4's bar, through the real command (benchmarks/bench_learning.py prints the same rows):
    `python -m musique_rl` gains >= 0.20 mean training reward (last 10 steps - first 10) with the
    held-out reward after > before on seeds 1, 2, 3; reward=shuffled gains at most +0.05."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "benchmarks" / "bench_learning.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import os

    def run(overrides, run_dir):
        return bench.run(overrides, run_dir, dict(os.environ))

    for seed in (1, 2, 3):
        s, wall = run([f"seed={seed}", "tracking.enabled=false"], tmp_path / f"seed{seed}")
        print(f"seed {seed}: gain {s['train/reward_gain']:+.3f}, held-out {s['eval/before/reward']:.3f} -> "
              f"{s['eval/after/reward']:.3f}, {wall / 60:.1f} min")
        assert s["train/reward_gain"] >= 0.20
        assert s["eval/after/reward"] > s["eval/before/reward"]
    s, _ = run(["reward=shuffled", "seed=1", "tracking.enabled=false"], tmp_path / "shuffled")
    print(f"shuffled: gain {s['train/reward_gain']:+.3f}")
    assert s["train/reward_gain"] <= 0.05
