"""The case-study report (musique_rl/case_study.py) judged from job directories: the claims follow the
numbers in the jobs, a broken story is reported as broken, and a missing job is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from musique_rl import case_study as cs
from musique_rl.schema import CONF_DIR

SEEDS = (1, 2, 3)
STEPS = 12


def _job(root: Path, num: int, arm: str, seed: int, gain: float, *, blind: bool, baseline: float = 0.55) -> Path:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+case={arm}", f"seed={seed}"]))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "fault": "blind_context" if blind else "none",
                                                               "case_arm": arm}))
    rows = []
    for s in range(STEPS):
        rows.append({
            "step": s + 1,
            "reward": baseline + gain * s / (STEPS - 1) + 0.01 * ((s + seed) % 3 - 1),
            "h06/logp_gap_mean": 5.7 if blind else 1e-6,
            "h02/attention_coverage": 0.23 if blind else 1.0,
            "sampling/importance_sampling_ratio/mean": 0.0 if blind else 1.0,
            "h08/update_weight_ratio": 0.0 if blind else 6e-4,
        })
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (job / "metrics.json").write_text(json.dumps({
        "eval/gain/reward": gain, "train/reward_gain": gain + 0.01 * (seed - 2), "train/reward_first10": baseline,
        "warm_start/hash": "abc123def456", "machine/cpu": "test cpu", "machine/torch_threads": 1,
        "machine/device": "cpu", "git/commit": "0000000",
    }))
    return job


def _sweep(root: Path, gains: dict[str, float], skip: tuple[tuple[str, int], ...] = ()) -> Path:
    num = 0
    for arm in cs.ARM_NAMES:
        for seed in SEEDS:
            if (arm, seed) in skip:
                continue
            jitter = 0.0 if arm.startswith("defect") else 0.02 * (seed - 2)
            blind = arm.startswith("defect")
            _job(root, num, arm, seed, gains.get(arm, 0.0) + jitter, blind=blind)
            num += 1
    return root


STORY = {"cure": 0.30, "arith_defect": 0.35, "arith_shuffled": 0.0}


def test_the_story_holds_when_the_runs_show_it(tmp_path):
    sweep = _sweep(tmp_path / "sweep", STORY)
    assert cs.main([str(sweep)]) == 0
    result = json.loads((sweep / "case_study.json").read_text())
    assert all(c["holds"] for c in result["claims"]), [c for c in result["claims"] if not c["holds"]]
    assert {v["status"] for k, v in result["verdicts"].items() if v["comparison"]["claim"] == "2a"} == {"Invalidated"}
    assert result["verdicts"]["cure"]["status"] == "Validated"
    assert result["verdicts"]["control_task"]["status"] == "Validated"
    assert {d["top"] for d in result["doctor"]} == {"h02"} and len(result["doctor"]) == len(cs.FLAT_ARMS) * len(SEEDS)
    report = (sweep / "case_study.md").read_text()
    assert f"**{len(result['claims'])} of {len(result['claims'])} claims hold.**" in report
    for png in (cs.REWARD_PNG, cs.ARITH_PNG, cs.GAP_PNG, cs.COVERAGE_PNG):
        assert (sweep / "plots" / png).stat().st_size > 1000 and f"plots/{png}" in report
    assert "| LoRA ranks (8 / 16 / 64) |" in report and "abc123def456" in report
    o = result["observations"]
    assert o["defect_curves_identical"] is True and o["importance_weight"] == {"defect": 0.0, "cure": 1.0}
    assert "identical step for step" in report and "still reads" in report


def test_a_knob_that_moves_reward_under_the_defect_breaks_the_story_and_says_where(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep", {**STORY, "defect_lr10": -0.3})
    assert cs.main([str(sweep)]) == 1
    result = json.loads((sweep / "case_study.json").read_text())
    failed = [c["text"] for c in result["claims"] if not c["holds"]]
    assert "`defect_lr10` stays flat: |mean gain| <= 0.03" in failed
    assert result["verdicts"]["learning_rate"]["status"] == "Invalidated"  # lower, not higher: still "no gain"
    assert "[NO] 2a `defect_lr10` stays flat" in capsys.readouterr().out


def test_a_missing_job_is_named_and_its_claims_do_not_pass_on_fewer_seeds(tmp_path):
    sweep = _sweep(tmp_path / "sweep", STORY, skip=(("cure", 2),))
    assert cs.main([str(sweep)]) == 1
    result = json.loads((sweep / "case_study.json").read_text())
    assert result["verdicts"]["cure"]["n_pairs"] == 2
    cure_claims = [c for c in result["claims"] if c["claim"] == "2d"]
    assert not cure_claims[0]["holds"]  # seed 2 of the cure never ran


def test_arms_run_apart_are_read_as_one_study(tmp_path):
    whole = _sweep(tmp_path / "whole", STORY)
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    for job in sorted(whole.iterdir()):
        arm = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())[0].split("=")[1]
        job.rename((second if arm.startswith("arith") else first) / job.name)
    assert cs.main([str(first), str(second)]) == 0


def test_every_arm_is_a_config_and_no_config_is_left_out():
    conf = CONF_DIR / "case"
    assert sorted(p.stem for p in conf.glob("*.yaml")) == sorted(cs.ARM_NAMES)
    arms_in_comparisons = {a for c in cs.COMPARISONS for a in (c.control, c.treatment)}
    assert arms_in_comparisons <= set(cs.ARM_NAMES)


def test_no_sweep_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        cs.main([str(tmp_path / "nowhere")])


@pytest.mark.parametrize("arm", cs.ARM_NAMES)
def test_each_arm_composes_and_differs_from_its_reference_only_where_it_says(arm):
    """Every arm is a real config; the defect is on in each multi-turn defect arm and inert in the
    single-turn control task (the fault's attention_mask hook); the cure differs from `defect` in the fault only."""
    import torch
    from conftest import compose_cfg

    from musique_rl.core import faults

    cfg = compose_cfg([f"+case={arm}"])
    assert str(cfg.train.importance_sampling) == "sequence_mask"
    attention = torch.ones(1, 8, dtype=torch.long)
    blind = not torch.equal(faults.of(cfg).attention_mask(attention, 5, None), attention)
    assert blind == arm.startswith("defect")
    assert str(cfg.fault) == ("none" if arm == "cure" else "blind_context")
    if arm.startswith("arith"):
        assert str(cfg.env.task) == "arith" and cfg.train.max_steps == 150
    if arm == "cure":
        from musique_rl.tracking.provenance import config_params

        ref = config_params(compose_cfg(["+case=defect"]))
        differ = {k for k, v in config_params(cfg).items() if ref.get(k) != v}
        assert differ == {"fault"}
