"""Where a step's time goes (core/step_time.py): the clock's accounting, and a short CPU run whose
metrics.jsonl holds every ``time/*`` part each step, adding up to the step's wall time, with the
share table in the closing summary."""

from __future__ import annotations

import json
import time

import pytest

from musique_rl.core.step_time import PARTS, STEP_KEY, STEP_TIME_METRICS, StepClock, part_key, summary, table


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_each_moment_goes_to_the_innermost_section_and_every_boundary_syncs():
    now, syncs = FakeTime(), []
    clock = StepClock(sync=lambda: syncs.append(now.t), now=now)
    with clock.section("generation"):  # outside a step: nothing timed, no sync
        now.t += 5
    assert syncs == []
    clock.begin_step()
    now.t += 1  # other
    with clock.section("generation"):
        now.t += 2
        with clock.section("environment"):
            now.t += 3
        now.t += 4  # generation again
    with pytest.raises(RuntimeError), clock.section("reward"):
        now.t += 0.5
        raise RuntimeError("a reward function failed")
    assert clock.failed_in == "reward"
    clock.set_base("backward_optimizer")
    now.t += 6
    out = clock.end_step()
    assert out[part_key("other")] == 1 and out[part_key("generation")] == 6 and out[part_key("environment")] == 3
    assert out[part_key("reward")] == 0.5 and out[part_key("backward_optimizer")] == 6
    assert out[STEP_KEY] == 16.5 == sum(out[part_key(p)] for p in PARTS)
    assert len(syncs) == 9  # begin, 2 per section (3 sections), set_base, end: CUDA synchronised at each read
    assert clock.end_step() == {}  # no step running


def test_the_metrics_are_declared_once_with_unit_and_meaning():
    names = [m.name for m in STEP_TIME_METRICS]
    assert names == [part_key(p) for p in PARTS] + [STEP_KEY]
    assert all(m.unit == "s" and len(m.meaning) > 20 for m in STEP_TIME_METRICS)


def test_the_summary_drops_the_first_step_and_gives_shares():
    rows = [{STEP_KEY: 10.0, **{part_key(p): 10.0 / len(PARTS) for p in PARTS}}]
    rows += [{STEP_KEY: 2.0, part_key("generation"): 1.5, part_key("backward_optimizer"): 0.5}] * 2
    s = summary(rows)
    assert s["time/steps_timed"] == 2 and s["time/mean/step_s"] == 2.0
    assert s["time/share/generation"] == 0.75 and s["time/share/reward"] == 0.0
    lines = table(s)
    assert "mean of 2 step(s) after the first" in lines[0] and any(" 75.0%" in line for line in lines)


def test_every_step_of_a_run_logs_its_time_parts_adding_up_to_its_wall_time(tiny_cfg, tmp_path, capsys):
    """A 3-step CPU run with the instruments on: each step's parts (less time/other_s, what no hook
    covered) add up to within 5% (+10 ms) of the step's wall time read by an independent callback;
    generation, environment, reward, the update and the instruments each took time."""
    from conftest import with_keys
    from transformers import TrainerCallback

    from musique_rl.job.train import train

    walls: list[float] = []

    class Wall(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            walls.append(time.perf_counter() - self.t)

    cfg = with_keys(tiny_cfg, {"train.max_steps": 3, "train.prompts_per_step": 2, "train.num_generations": 4,
                               "train.eval_episodes": 0, "train.save_steps": 100, "loss.warmup_steps": 0})
    result = train(cfg, run_dir=tmp_path, callbacks=[Wall()])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 3 == len(walls)
    for row, wall in zip(steps, walls, strict=True):
        parts = {p: row[part_key(p)] for p in PARTS}
        assert all(v >= 0 for v in parts.values()), parts
        named = sum(v for p, v in parts.items() if p != "other")
        assert abs(named - wall) <= 0.05 * wall + 0.01, (row["step"], parts, wall)
        assert row[STEP_KEY] >= wall  # the clock's callbacks enclose every other one
        assert abs(sum(parts.values()) - row[STEP_KEY]) < 1e-6
        for p in ("generation", "environment", "reward", "backward_optimizer", "instruments"):
            assert parts[p] > 0, (p, row["step"])
    s = result.summary
    assert s["time/steps_timed"] == 2
    assert abs(sum(s[f"time/share/{p}"] for p in PARTS) - 1) < 1e-9
    out = capsys.readouterr().out
    assert "where a step's time went, mean of 2 step(s) after the first" in out
    for p in PARTS:
        assert f"  {p} " in out
