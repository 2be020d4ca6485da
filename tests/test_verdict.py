"""Verdict math and I/O on synthetic run tables: paired effects, criterion, gaps, the status file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from musique_rl import verdict as V

ROOT = Path(__file__).resolve().parent.parent
H_UP = V.Hypothesis("h01", "Advantage scaling", "high", "train/reward_gain", "increase", 0.02)
H_DOWN = V.Hypothesis("h02", "Environment tokens in the loss", "high", "train/reward_gain", "decrease", 0.02)


def sweep(hyp, control, treatment, seeds=None, **statuses):
    """control/treatment: {seed: value or None}; statuses: {'treatment_3': 'FAILED'}."""
    runs = []
    for arm, table in (("control", control), ("treatment", treatment)):
        for seed, value in table.items():
            status = statuses.get(f"{arm}_{seed}", "FINISHED" if value is not None else "FAILED")
            runs.append(V.Run(arm, seed, status, value, f"{arm}-{seed}", "" if value is not None else "boom"))
    return V.Sweep(hyp, runs, seeds or sorted(set(control) | set(treatment)), source={"kind": "test"})


def test_clear_increase_is_validated_with_interval_above_threshold():
    v = V.judge(sweep(H_UP, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.61, 2: 0.64, 3: 0.57}))
    assert v["status"] == "Validated"
    assert v["effect"] == pytest.approx((0.11 + 0.09 + 0.12) / 3)
    lo, hi = v["ci"]
    assert 0.02 < lo <= v["effect"] <= hi
    assert v["interval"] == "t" and v["t_df"] == 2
    # the t-distribution's mass above 0.02: 1/2 + t/(2 sqrt(2 + t^2)) at t = (0.1067 - 0.02) / 0.00882, df 2
    assert v["confidence"] == pytest.approx(0.9949, abs=1e-4)
    assert v["sign_flip_p"] == pytest.approx(0.25)  # 3 pairs, all up: 2 of 8 sign assignments
    assert [p["seed"] for p in v["pairs"]] == [1, 2, 3] and v["missing"] == []


def test_decrease_direction_flips_the_criterion():
    runs = ({1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: 0.33})
    assert V.judge(sweep(H_DOWN, *runs))["status"] == "Validated"
    # the same drop contradicts a hypothesis that predicted an increase
    assert V.judge(sweep(H_UP, *runs))["status"] == "Invalidated"


def test_knob_that_does_not_matter_is_invalidated():
    v = V.judge(sweep(H_UP, {1: 0.50, 2: 0.55, 3: 0.45, 4: 0.52}, {1: 0.502, 2: 0.548, 3: 0.453, 4: 0.519}))
    assert v["status"] == "Invalidated"
    assert v["ci"][1] < 0.02 and v["confidence"] > 0.95


def test_noisy_effect_is_inconclusive_and_says_which_way_it_leans():
    v = V.judge(sweep(H_UP, {1: 0.5, 2: 0.5, 3: 0.5}, {1: 0.70, 2: 0.35, 3: 0.56}))
    assert v["status"] == "Inconclusive"
    assert v["ci"][0] < 0.02 < v["ci"][1]
    assert any("straddles" in n and "2/3 seeds in the predicted direction" in n for n in v["notes"])


def test_three_drops_smaller_than_claimed_do_not_make_the_drop_certain():
    # H02's first CPU sweep: every seed drops, by less than the claimed 0.02 on average. The
    # bootstrap's interval excluded 0 here; the t-interval over 3 pairs does not (t_{0.975,2} = 4.3).
    v = V.judge(sweep(H_DOWN, {1: 0.0366, 2: 0.0337, 3: 0.0258}, {1: 0.0143, 2: 0.0164, 3: 0.0205}))
    assert v["status"] == "Inconclusive" and v["seeds_in_predicted_direction"] == 3
    assert v["ci"][0] < 0 < v["ci"][1]
    assert any("straddles min_effect 0.02" in n for n in v["notes"])
    assert any("only 3 seed pairs" in n and "cannot go below 0.25" in n for n in v["notes"])


def test_right_sign_but_smaller_than_claimed_is_inconclusive_and_says_so():
    # five seeds drop by ~0.02: the drop is certain, its size is not
    control = {1: 0.50, 2: 0.52, 3: 0.47, 4: 0.51, 5: 0.49}
    drops = {1: 0.010, 2: 0.030, 3: 0.020, 4: 0.015, 5: 0.025}
    v = V.judge(sweep(H_DOWN, control, {s: c - drops[s] for s, c in control.items()}))
    assert v["status"] == "Inconclusive" and v["seeds_in_predicted_direction"] == 5
    assert v["ci"][1] < 0  # the drop itself is certain ...
    assert any("predicted sign (interval excludes 0; 5/5 seeds) but may be smaller than the claimed 0.02" in n
               for n in v["notes"])  # ... its size is not
    assert not any("only 5 seed pairs" in n for n in v["notes"])  # the small-n note is for fewer than 5


def test_interval_is_deterministic_and_level_widens_it():
    s = sweep(H_UP, {1: 0.5, 2: 0.52, 3: 0.47, 4: 0.5}, {1: 0.58, 2: 0.55, 3: 0.56, 4: 0.61})
    a, b = V.judge(s), V.judge(s)
    assert a["ci"] == b["ci"] and a["sign_flip_p"] == b["sign_flip_p"]
    narrow, wide = V.judge(s, level=0.5)["ci"], V.judge(s, level=0.99)["ci"]
    assert wide[0] < narrow[0] and wide[1] > narrow[1]


def test_failed_job_is_named_and_the_rest_still_judged():
    v = V.judge(sweep(H_UP, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.61, 2: 0.64, 3: None}))
    assert v["n_pairs"] == 2 and v["n_seeds"] == 3
    assert v["missing"] == [{"arm": "treatment", "seed": 3, "status": "FAILED", "reason": "boom", "source": "treatment-3"}]
    # two pairs (+0.11, +0.09) are judged: an interval with 1 degree of freedom (t = 12.7), too wide
    # to validate; the bootstrap of 2 values (3 distinct means) had called this Validated
    assert v["status"] == "Inconclusive" and v["t_df"] == 1
    assert v["ci"][0] < 0.02 < 0.1 < v["ci"][1]
    assert any("treatment seed 3 FAILED" in n and "2 of 3 seeds" in n for n in v["notes"])


def test_job_that_never_started_is_named_from_the_grid():
    v = V.judge(sweep(H_UP, {1: 0.5, 2: 0.5}, {1: 0.6, 2: 0.6}, seeds=[1, 2, 3]))
    assert {"arm": "control", "seed": 3, "status": "MISSING", "reason": "no run (never started)"} in v["missing"]
    assert len(v["missing"]) == 2


def test_one_pair_is_inconclusive_and_reports_what_it_has():
    v = V.judge(sweep(H_UP, {1: 0.5, 2: None}, {1: 0.7, 2: None}))
    assert v["status"] == "Inconclusive" and v["ci"] is None
    assert v["effect"] == pytest.approx(0.2)
    assert any("one complete seed pair (seed 1)" in n for n in v["notes"])


def test_whole_arm_missing_reports_the_other_arm():
    v = V.judge(sweep(H_UP, {1: 0.5, 2: 0.6}, {1: None, 2: None}))
    assert v["status"] == "Inconclusive" and v["n_pairs"] == 0
    assert any("control mean 0.5500 over 2 seed(s)" in n for n in v["notes"])


def test_arms_that_differ_in_more_than_the_knob_are_named_and_a_drifting_arm_is_confounded():
    """The h03 sweep of session 1: the learning-rate default was edited while it ran, so two control
    seeds trained at 2e-4 and everything else at 1e-3. The numbers said Invalidated; the design
    check must refuse to judge and name the key and the seeds."""
    values = ({1: 0.17, 2: 0.22, 3: 0.30}, {1: 0.29, 2: 0.32, 3: 0.38})
    clean = sweep(H_DOWN, *values)
    for r in clean.runs:
        r.params = {"seed": str(r.seed), "env.seed": str(r.seed), "hypothesis.arm": r.arm,
                    "loss.beta": "0.04" if r.arm == "treatment" else "0.0", "loss.learning_rate": "0.001"}
    v = V.judge(clean)
    assert v["status"] == "Invalidated" and v["confounds"] == []
    assert v["arms_differ_in"] == {"loss.beta": ["0.0", "0.04"]}  # seed-derived keys are not a difference
    assert "arms differ in loss.beta (0.0 vs 0.04)" in v["notes"]
    drifted = sweep(H_DOWN, *values)
    for r, c in zip(drifted.runs, clean.runs, strict=True):
        r.params = dict(c.params)
        if r.arm == "control" and r.seed in (1, 2):
            r.params["loss.learning_rate"] = "0.0002"
    v = V.judge(drifted)
    assert v["status"] == "Inconclusive" and v["confidence"] == 0.0
    assert v["confounds"] == ["the control runs differ in loss.learning_rate (0.0002 on seed 1,2; 0.001 on seed 3)"]
    assert v["notes"][0].startswith("Confounded") and "would have said Invalidated" in v["notes"][0]
    assert V.table_row(v)["notes"].startswith("CONFOUNDED: the control runs differ in loss.learning_rate")


def test_runs_from_several_commits_or_a_dirty_tree_are_pointed_out_without_overruling_the_numbers():
    s = sweep(H_DOWN, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: 0.33})
    for r in s.runs:
        r.code = "a" * 40
    assert not any("commit" in n for n in V.judge(s)["notes"])
    s.runs[0].code = "b" * 40 + "+dirty"
    v = V.judge(s)
    assert v["status"] == "Validated"
    assert "the runs span 2 commits (aaaaaaa, bbbbbbb)" in " ".join(v["notes"])
    assert "1 run(s) ran with uncommitted changes (control/seed 1)" in " ".join(v["notes"])


def test_runs_from_different_warm_starts_are_confounded_and_the_hashes_named():
    s = sweep(H_DOWN, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: 0.33})
    for r in s.runs:
        r.warm_start, r.machine = "3f2a9c1b0d4e", "AMD EPYC 7B13 | 1 threads | cpu"
    clean = V.judge(s)
    assert clean["status"] == "Validated" and clean["warm_start"] == ["3f2a9c1b0d4e"] and clean["confounds"] == []
    s.runs[4].warm_start = "77aa00bb11cc"  # treatment/seed 2 started from other weights
    v = V.judge(s)
    assert v["status"] == "Inconclusive" and v["confidence"] == 0.0
    assert v["warm_start"] == ["3f2a9c1b0d4e", "77aa00bb11cc"]
    assert v["confounds"] == ["the runs start from different warm starts: 3f2a9c1b0d4e (control/seed 1, control/seed 2, "
                              "control/seed 3, treatment/seed 1, treatment/seed 3); 77aa00bb11cc (treatment/seed 2)"]
    assert v["notes"][0].startswith("Confounded") and "would have said Validated" in v["notes"][0]
    row = V.table_row(v)["notes"]
    assert row.startswith("CONFOUNDED: the runs start from different warm starts") and "warm starts 3f2a9c1b0d4e, 77aa00bb11cc" in row


def test_arms_whose_knob_is_the_warm_start_may_differ_in_it_but_not_within_an_arm():
    """An arm whose knob is a model.* setting (a model.tiny recipe) starts from its own start: one
    hash per arm is the design; two hashes inside an arm are still a confound."""
    s = sweep(H_DOWN, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: 0.33})
    for r in s.runs:
        share = "0.25" if r.arm == "control" else "1.0"
        r.params = {"seed": str(r.seed), "hypothesis.arm": r.arm, "model.tiny.sft_single_step_share": share}
        r.warm_start = "aaaaaaaaaaaa" if r.arm == "control" else "bbbbbbbbbbbb"
    v = V.judge(s)
    assert v["status"] == "Validated" and v["confounds"] == [] and v["warm_start"] == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    s.runs[4].warm_start = "cccccccccccc"
    assert V.judge(s)["confounds"][0].startswith("the runs start from different warm starts")


def test_arms_that_differ_in_the_episode_shape_may_start_from_their_shapes_warm_starts():
    """h07 varies env.supporting_in_prompt, and a single-step run starts from the single-step start
    (tiny_model.shape_knobs): one hash per arm is the knob, said in the notes; a second hash inside
    an arm stays a confound, and so does any other knob that came with different weights."""
    s = sweep(H_UP, {1: 0.30, 2: 0.35, 3: 0.25}, {1: 0.40, 2: 0.46, 3: 0.33})
    for r in s.runs:
        r.params = {"seed": str(r.seed), "hypothesis.arm": r.arm,
                    "env.supporting_in_prompt": "False" if r.arm == "control" else "True"}
        r.warm_start = "aaaaaaaaaaaa" if r.arm == "control" else "bbbbbbbbbbbb"
    v = V.judge(s)
    assert v["status"] == "Validated" and v["confounds"] == [] and v["warm_start"] == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    assert ("the arms start from different warm starts by design, the start being part of the knob "
            "(env.supporting_in_prompt): control aaaaaaaaaaaa, treatment bbbbbbbbbbbb") in v["notes"]
    s.runs[4].warm_start = "cccccccccccc"
    assert V.judge(s)["confounds"][0].startswith("the runs start from different warm starts")
    s.runs[4].warm_start = "bbbbbbbbbbbb"
    for r in s.runs:  # the same weights story under a knob no start is keyed by: a confound
        r.params = {"seed": str(r.seed), "hypothesis.arm": r.arm, "env.top_n": "1" if r.arm == "control" else "3"}
    assert V.judge(s)["confounds"][0].startswith("the runs start from different warm starts")


def test_h07s_composed_arms_differ_only_in_the_knob_and_its_warm_start():
    """The pair `make sweep SWEEP=h07` runs, as its jobs record it (the resolved config as MLflow
    params, the warm start each job trains from): the arms differ in env.supporting_in_prompt
    alone, each arm has one start (the common one, the single-step one), and the design check
    accepts that as the knob."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import compose_cfg

    from musique_rl.core import tiny_model, warm_start_builder
    from musique_rl.schema import job_config
    from musique_rl.tracking.provenance import config_params

    runs = []
    for arm, value in (("control", 0.30), ("treatment", 0.40)):
        for seed in (1, 2, 3):
            cfg = compose_cfg(["tracking.enabled=false", "+hypothesis=h07", f"hypothesis.arm={arm}", f"seed={seed}"])
            path = tiny_model.locate(job_config(cfg))
            prov = warm_start_builder.provenance(job_config(cfg), path)  # refuses a start that did not pass this arm's shape
            runs.append(V.Run(arm, seed, "FINISHED", value + 0.01 * seed, f"{arm}-{seed}", params=config_params(cfg),
                              warm_start=prov["warm_start/hash"], machine="cpu"))
    differ, confounds = V.design_check(runs)
    assert differ == {"env.supporting_in_prompt": ["False", "True"]} and confounds == []
    v = V.judge(V.Sweep(V.load_hypothesis_file("h07"), runs, [1, 2, 3], source={"kind": "test"}))
    assert v["confounds"] == [] and len(v["warm_start"]) == 2
    assert any(n.startswith("the arms start from different warm starts by design") for n in v["notes"])


def test_a_failed_run_on_other_weights_does_not_confound_the_pairs_it_is_not_in():
    s = sweep(H_DOWN, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: None})
    for r in s.runs:
        r.warm_start = "77aa00bb11cc" if r.value is None else "3f2a9c1b0d4e"
    v = V.judge(s)
    assert v["confounds"] == [] and v["warm_start"] == ["3f2a9c1b0d4e"]


def test_several_machines_and_unknown_provenance_are_noted_not_confounded():
    s = sweep(H_DOWN, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: 0.33})
    for r in s.runs:
        r.warm_start, r.machine = "3f2a9c1b0d4e", "AMD EPYC 7B13 | 1 threads | cpu"
    s.runs[3].machine = "Intel Xeon | 2 threads | cpu"
    s.runs[5].warm_start = s.runs[5].machine = "unknown"
    v = V.judge(s)
    assert v["status"] == "Validated" and v["confounds"] == []
    assert v["machine"] == ["AMD EPYC 7B13 | 1 threads | cpu", "Intel Xeon | 2 threads | cpu", "unknown"]
    notes = " ".join(v["notes"])
    assert "the runs ran on 2 machines" in notes and "Intel Xeon | 2 threads | cpu: treatment/seed 1" in notes
    assert "1 of 6 runs record no warm-start hash (treatment/seed 3)" in notes


def test_status_row_names_warm_start_machine_and_commit():
    s = sweep(H_DOWN, {1: 0.50, 2: 0.55, 3: 0.45}, {1: 0.40, 2: 0.46, 3: 0.33})
    for r in s.runs:
        r.warm_start, r.machine, r.code = "3f2a9c1b0d4e", "AMD EPYC 7B13 | 1 threads | cpu", "25917a6" + "0" * 33
    v = V.judge(s)
    assert v["commits"] == ["25917a6"]
    row = V.table_row(v)["notes"]
    assert "; warm start 3f2a9c1b0d4e; AMD EPYC 7B13 x1 thread, cpu; commit 25917a6;" in row
    assert "95% t-interval" in row and "sign-flip p 0.25" in row
    bare = V.table_row(V.judge(sweep(H_DOWN, {1: 0.5, 2: 0.5}, {1: 0.4, 2: 0.4})))["notes"]
    assert "; warm start unknown; unknown machine; commit unknown;" in bare


# ---------------------------------------------------------------- multirun directories
PROVENANCE = {"warm_start/hash": "3f2a9c1b0d4e", "machine/cpu": "AMD EPYC 7B13", "machine/torch_threads": 1,
              "machine/device": "cpu", "machine/torch": "2.13.0"}


CLEAN = "8e3285c" + "0" * 33  # a clean commit (metrics.json's git/commit)


def make_job(sweep_dir: Path, num: int, hyp: str, arm: str, seed: int, metrics: dict | None, **config):
    job = sweep_dir / str(num)
    (job / ".hydra").mkdir(parents=True)
    hyp_block = yaml.safe_load((V.HYPOTHESIS_DIR / f"{hyp}.yaml").read_text())["hypothesis"]
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"hypothesis": {**hyp_block, "arm": arm}, "seed": seed,
                                                                **config}))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))
    return job


BUDGET = {"train": {"max_steps": 60}, "loss": {"warmup_steps": 10}}  # what a job's saved config says


@pytest.fixture
def multirun(tmp_path):
    """A +sweep=h02 directory over the default 5 seeds of 60 steps at a clean commit; treatment seed 5
    died before writing metrics."""
    d = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    d.mkdir(parents=True)
    (d / "multirun.yaml").write_text(yaml.safe_dump({
        "hydra": {"sweeper": {"params": {"hypothesis.arm": "control,treatment", "seed": "1,2,3,4,5"}},
                  "overrides": {"task": ["+sweep=h02"]}}}))
    values = {("control", 1): 0.30, ("control", 2): 0.25, ("control", 3): 0.28, ("control", 4): 0.27,
              ("control", 5): 0.29, ("treatment", 1): 0.10, ("treatment", 2): 0.08, ("treatment", 3): 0.09,
              ("treatment", 4): 0.12}
    num = 0
    for (arm, seed), val in values.items():
        make_job(d, num, "h02", arm, seed, {"train/reward_gain": val, "train/reward_start": 0.5, **PROVENANCE,
                                            "git/commit": CLEAN}, **BUDGET)
        num += 1
    failed = make_job(d, num, "h02", "treatment", 5, None, **BUDGET)  # started, never wrote metrics
    (failed / "traceback.txt").write_text("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    return d


def test_multirun_directory_is_read_with_grid_failure_reason_and_provenance(multirun):
    s = V.load_multirun(multirun)
    assert s.hypothesis.id == "h02" and s.seeds == [1, 2, 3, 4, 5]
    finished = [r for r in s.runs if r.usable]
    assert {(r.warm_start, r.machine) for r in finished} == {("3f2a9c1b0d4e", "AMD EPYC 7B13 | 1 threads | cpu")}
    assert [(r.warm_start, r.machine) for r in s.runs if not r.usable] == [("unknown", "unknown")]
    v = V.judge(s)
    assert v["n_pairs"] == 4 and v["status"] == "Validated"
    assert v["warm_start"] == ["3f2a9c1b0d4e"] and v["machine"] == ["AMD EPYC 7B13 | 1 threads | cpu"]
    assert v["missing"][0]["arm"] == "treatment" and v["missing"][0]["seed"] == 5
    assert v["missing"][0]["reason"] == "RuntimeError: CUDA out of memory"


def test_the_jobs_table_is_the_record_of_a_failed_job(multirun):
    """jobs.json, when the sweep has one, says which jobs failed and why: over the job dir's traceback,
    and over a metrics.json the job wrote before it failed."""
    from musique_rl.sweep import jobs

    jobs.write(multirun, [jobs.JobRow(9, ["hypothesis.arm=treatment", "seed=5"], "DIED", None, "UncompletedJobError: killed"),
                          jobs.JobRow(0, ["hypothesis.arm=control", "seed=1"], "FAILED", 3.0, "ValueError: after the metrics"),
                          jobs.JobRow(1, ["hypothesis.arm=control", "seed=2"], "COMPLETED", 3.0)])
    v = V.judge(V.load_sweep(str(multirun), prefer="files"))
    missing = {(m["arm"], m["seed"]): (m["status"], m["reason"]) for m in v["missing"]}
    assert missing == {("treatment", 5): ("KILLED", "UncompletedJobError: killed"),
                       ("control", 1): ("FAILED", "ValueError: after the metrics")}
    assert v["n_pairs"] == 3
    # a sweep without a jobs table still names the job dir's traceback
    (multirun / "jobs.json").unlink()
    v = V.judge(V.load_sweep(str(multirun), prefer="files"))
    assert [(m["status"], m["reason"]) for m in v["missing"]] == [("FAILED", "RuntimeError: CUDA out of memory")]


def test_missing_metric_key_is_named(tmp_path):
    d = tmp_path / "sw"
    make_job(d, 0, "h01", "control", 1, {"train/reward": 0.5})
    s = V.load_multirun(d)
    assert "has no 'train/reward_gain'" in s.runs[0].reason and "train/reward" in s.runs[0].reason


def test_cut_off_metrics_file_is_named_and_the_other_jobs_still_read(tmp_path):
    d = tmp_path / "sw"
    make_job(d, 0, "h01", "control", 1, {"train/reward_gain": 0.5})
    bad = make_job(d, 1, "h01", "treatment", 1, None)
    (bad / "metrics.json").write_text('{"train/reward_gain": 0.')
    s = V.load_multirun(d)
    assert s.runs[0].usable and s.runs[1].status == "FAILED"
    assert str(bad / "metrics.json") in s.runs[1].reason and "not valid JSON" in s.runs[1].reason


def test_provenance_prefers_the_job_dir_over_mlflow_tags():
    from musique_rl.verdict.load import provenance

    tags = {"warm_start_hash": "aaaaaaaaaaaa", "machine": "Tagged CPU | 4 threads | cpu"}
    assert provenance(PROVENANCE, tags) == ("3f2a9c1b0d4e", "AMD EPYC 7B13 | 1 threads | cpu")
    assert provenance({"train/reward_gain": 0.1}, tags) == ("aaaaaaaaaaaa", "Tagged CPU | 4 threads | cpu")
    assert provenance(None, None) == ("unknown", "unknown")


def test_swept_values_come_from_hydras_override_parser():
    from omegaconf import OmegaConf

    from musique_rl.verdict.load import swept_values

    cfg = OmegaConf.create({"hydra": {"sweeper": {"params": {"hypothesis.arm": "control,treatment", "seed": "1,2"}},
                                      "overrides": {"task": ["+sweep=h02", "seed=range(1,6)",
                                                             "env.data='a,b,c'"]}}})
    grid = swept_values(cfg)
    assert grid["hypothesis.arm"] == ["control", "treatment"] and grid["sweep"] == ["h02"]
    assert grid["seed"] == ["1", "2", "3", "4", "5"]  # the command line wins over the sweeper's params
    assert grid["env.data"] == ["a,b,c"]  # quoted: one value, not a sweep


def _complete(multirun: Path) -> Path:
    """The fixture's sweep with treatment seed 5 finished too (nothing failed)."""
    import shutil

    failed = next(p for p in multirun.iterdir() if p.is_dir() and not (p / "metrics.json").exists())
    shutil.rmtree(failed)
    make_job(multirun, int(failed.name), "h02", "treatment", 5,
             {"train/reward_gain": 0.11, "train/reward_start": 0.5, **PROVENANCE, "git/commit": CLEAN}, **BUDGET)
    return multirun


def _status(tmp_path: Path) -> Path:
    status = tmp_path / "docs" / "STATUS.md"
    status.parent.mkdir(exist_ok=True)
    status.write_text("# title\n\nintro\n\n<!-- verdicts:start -->\nold\n<!-- verdicts:end -->\n\n## After\nkept\n")
    return status


def test_judging_writes_the_sweep_dir_only_and_states_the_budget(multirun, tmp_path, capsys, monkeypatch):
    status = _status(tmp_path)
    before = status.read_text()
    monkeypatch.setattr("musique_rl.verdict.sweep.STATUS", status)  # even a checkout's status file is not touched
    assert V.main(["--sweep", str(multirun), "--source", "files"]) == 0
    out = capsys.readouterr().out
    assert "h02 Environment tokens in the loss: Validated (confidence" in out and "[60 steps x 5 seeds]" in out
    assert f"to publish it: python -m musique_rl.verdict publish --sweep {multirun}" in out
    assert status.read_text() == before and not (status.parent / "verdicts").exists()
    data = json.loads((multirun / "verdict.json").read_text())
    assert data["status"] == "Validated" and data["n_pairs"] == 4
    assert data["budget"] == {"steps": 60, "steps_differ": None, "warmup_steps": 10, "seeds": 5, "pairs": 4,
                              "min_steps": 30, "too_short": None}
    assert data["interval"] == "t" and data["t_df"] == 3 and data["sign_flip_p"] == pytest.approx(2 / 16)
    assert data["warm_start"] == ["3f2a9c1b0d4e"] and data["machine"] == ["AMD EPYC 7B13 | 1 threads | cpu"]
    table = (multirun / "status.md").read_text()
    assert "| h02 Environment tokens in the loss | high | Validated |" in table
    assert "| 60 steps x 5 seeds; effect -0." in table  # every verdict line opens with its budget
    assert "missing treatment/seed 5 (FAILED)" in table
    assert "warm start 3f2a9c1b0d4e; AMD EPYC 7B13 x1 thread, cpu; commit 8e3285c" in table
    assert (multirun / "plots" / "paired_differences.png").read_bytes()[:4] == b"\x89PNG"


def test_publish_rewrites_only_its_row_and_links_the_copied_plots(multirun, tmp_path, capsys):
    status = _status(tmp_path)
    assert V.main(["publish", "--sweep", str(_complete(multirun)), "--status-file", str(status), "--source", "files"]) == 0
    assert "h02 Environment tokens in the loss: Validated" in capsys.readouterr().out
    text = status.read_text()
    assert text.startswith("# title\n\nintro\n\n<!-- verdicts:start -->") and text.endswith("## After\nkept\n")
    assert "old" not in text
    section = text.split("<!-- verdicts:start -->")[1].split("<!-- verdicts:end -->")[0]
    assert "| hypothesis | priority | status | confidence | notes |" in section
    assert sum(line.startswith("| h0") for line in section.splitlines()) == 8  # every hypothesis has a row
    assert "| h02 Environment tokens in the loss | high | Validated | 1.00 | 60 steps x 5 seeds; effect" in section
    # the row links the paired-differences plot, copied beside the status file (the sweep dir is not committed)
    assert "[paired differences](verdicts/h02/paired_differences.png)" in section
    assert (status.parent / "verdicts/h02/paired_differences.png").read_bytes()[:4] == b"\x89PNG"
    assert V.status_file_problems(status) == {}  # the page's check holds for what publish wrote
    assert V.main(["check", "--status-file", str(status)]) == 0

    # a later verdict on another hypothesis keeps this row
    other = tmp_path / "other"
    for i, (arm, seed, val) in enumerate([("control", 1, 0.1), ("treatment", 1, 0.1), ("control", 2, 0.2), ("treatment", 2, 0.2)]):
        make_job(other, i, "h03", arm, seed, {"train/reward_gain": val, **PROVENANCE, "git/commit": CLEAN},
                 train={"max_steps": 60}, loss={"warmup_steps": 10})
    assert V.main(["publish", "--sweep", str(other), "--status-file", str(status), "--source", "files"]) == 0
    section = status.read_text().split("<!-- verdicts:start -->")[1]
    assert "| h02 Environment tokens in the loss | high | Validated |" in section
    assert "| h03 KL penalty to the reference | medium | Invalidated |" in section  # identical diffs: a point at 0
    table = section.split("<!-- verdicts:end -->")[0]
    assert table.count("| hypothesis | priority |") == 1  # rewriting keeps one header, 8 rows
    assert sum(line.startswith("| h0") for line in table.splitlines()) == 8


def test_publish_refuses_a_failed_dirty_mixed_or_short_sweep_and_says_why(multirun, tmp_path, capsys):
    status = _status(tmp_path)
    before = status.read_text()
    # the fixture as it is: treatment seed 5 FAILED
    assert V.main(["publish", "--sweep", str(multirun), "--status-file", str(status), "--source", "files"]) == 2
    err = capsys.readouterr().err
    assert "not published" in err and "failed or missing jobs: treatment/seed 5 (FAILED)" in err and "--force" in err
    assert status.read_text() == before and not (status.parent / "verdicts").exists()

    def sweep_of(name: str, steps: int, commits=(CLEAN,) * 4, cpus=("AMD EPYC 7B13",) * 4) -> Path:
        d = tmp_path / name
        for i, (arm, seed, val) in enumerate([("control", 1, 0.30), ("treatment", 1, 0.10), ("control", 2, 0.28),
                                              ("treatment", 2, 0.07)]):
            make_job(d, i, "h02", arm, seed, {"train/reward_gain": val, **PROVENANCE, "machine/cpu": cpus[i],
                                             "git/commit": commits[i]},
                     train={"max_steps": steps}, loss={"warmup_steps": 10})
        return d

    refusals = {
        "short": (sweep_of("short", 4), "too short to judge: the runs' 4 steps end inside the 10-step warm-up"),
        "below_min": (sweep_of("below_min", 20), "the runs have 20 steps; h02 needs at least 30 (hypothesis.min_steps"),
        "dirty": (sweep_of("dirty", 60, commits=(CLEAN, CLEAN + "+dirty", CLEAN, CLEAN)), "runs from a dirty tree (8e3285c+dirty)"),
        "mixed": (sweep_of("mixed", 60, cpus=("AMD EPYC 7B13", "Intel Xeon") * 2), "the runs mix 2 machine types"),
    }
    for name, (d, why) in refusals.items():
        assert V.main(["publish", "--sweep", str(d), "--status-file", str(status), "--source", "files"]) == 2, name
        assert why in capsys.readouterr().err, name
        assert status.read_text() == before, name
    # a short sweep's verdict says so wherever it is read, and is no verdict
    v = json.loads((refusals["short"][0] / "verdict.json").read_text())
    assert v["status"] == "Inconclusive" and v["confidence"] is None
    assert v["notes"][0].startswith("too short to judge: the runs' 4 steps end inside the 10-step warm-up")
    assert "the numbers would have said Validated" in v["notes"][0] and "train.max_steps>=30" in v["notes"][0]
    assert "4 steps x 2 seeds; too short to judge (" in (refusals["short"][0] / "status.md").read_text()
    # --force publishes it, and the page's check then names what is wrong with the row
    assert V.main(["publish", "--force", "--sweep", str(refusals["mixed"][0]), "--status-file", str(status),
                   "--source", "files"]) == 0
    capsys.readouterr()
    assert V.main(["check", "--status-file", str(status)]) == 1
    assert "h02: mixes machine types (AMD EPYC 7B13 x1 thread, cpu + Intel Xeon x1 thread, cpu)" in capsys.readouterr().out


def test_the_row_check_names_a_dirty_tree_mixed_machines_a_failed_job_and_a_missing_budget():
    good = ("60 steps x 5 seeds; effect -0.4292 [95% t-interval -0.5410, -0.3173] on train/reward_gain; predicted "
            "decrease by > 0.02; 5/5 seed pairs; warm start 615d2d0e1c69; AMD EPYC x1 thread, cpu; commit 8e3285c; "
            "multirun/h02/2026-11-24 2026-11-24")
    row = {"hypothesis": "h02 x", "priority": "high", "status": "Validated", "confidence": "1.00", "notes": good}
    assert V.row_problems(row) == []
    assert V.row_problems({**row, "status": "Not run", "notes": ""}) == []
    bad = good.replace("commit 8e3285c", "commits 1951e5d+dirty, 25917a6+dirty").replace(
        "AMD EPYC x1 thread, cpu;", "AMD EPYC x1 thread, cpu + Intel(R) Xeon(R) Processor x1 thread, cpu;")
    bad = bad.replace("5/5 seed pairs;", "4/5 seed pairs; missing treatment/seed 1 (FAILED);").replace("60 steps x 5 seeds; ", "")
    assert V.row_problems({**row, "notes": bad}) == [
        "states no budget (steps x seeds)", "from a dirty tree (+dirty)",
        "mixes machine types (AMD EPYC x1 thread, cpu + Intel(R) Xeon(R) Processor x1 thread, cpu)",
        "carries failed jobs (treatment/seed 1 FAILED)"]


def test_python_dash_m_judges_a_sweep_directory_end_to_end(multirun, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'none.db'}"}
    proc = subprocess.run([sys.executable, "-m", "musique_rl.verdict", "--sweep", str(multirun)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "h02 Environment tokens in the loss: Validated" in proc.stdout
    assert "warm start 3f2a9c1b0d4e; AMD EPYC 7B13 x1 thread, cpu" in proc.stdout
    assert json.loads((multirun / "verdict.json").read_text())["status"] == "Validated"
    assert not (tmp_path / "none.db").exists()  # a missing store is not created by looking for runs


def test_a_status_file_without_markers_gets_them_appended(multirun, tmp_path):
    status = tmp_path / "STATUS.md"
    status.write_text("# project\n")
    V.publish_status(V.run_verdict(str(_complete(multirun)), prefer="files"), status)
    text = status.read_text()
    assert text.startswith("# project\n\n<!-- verdicts:start -->") and text.rstrip().endswith("<!-- verdicts:end -->")


def test_cli_names_an_unknown_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert V.main(["--sweep", "no-such-sweep"]) == 2
    assert "no-such-sweep" in capsys.readouterr().err


# ---------------------------------------------------------------- MLflow
def test_mlflow_runs_are_judged_and_the_verdict_attached_to_the_parent(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("h01")
    sid = "multirun/2025-01-01/12-00-00"
    with mlflow.start_run(run_name="sweep", tags={V.TAG_SWEEP: sid, V.TAG_HYPOTHESIS: "h01", V.TAG_SWEEP_PARENT: "true"}) as parent:
        for arm, seed, val, status in [("control", 1, 0.10, "FINISHED"), ("treatment", 1, 0.20, "FINISHED"),
                                       ("control", 2, 0.12, "FINISHED"), ("treatment", 2, 0.21, "FINISHED"),
                                       ("control", 3, 0.11, "FINISHED"), ("treatment", 3, None, "FAILED")]:
            tags = {V.TAG_SWEEP: sid, V.TAG_HYPOTHESIS: "h01", V.TAG_ARM: arm, V.TAG_SEED: str(seed),
                    "git_commit": "25917a6" + "0" * 33, "git_dirty": "false",
                    V.TAG_WARM_START: "3f2a9c1b0d4e", V.TAG_MACHINE: "AMD EPYC 7B13 | 1 threads | cpu"}
            with mlflow.start_run(nested=True, tags=tags) as child:
                if val is not None:
                    mlflow.log_metric("train/reward_gain", val)
            if status == "FAILED":
                mlflow.tracking.MlflowClient().set_terminated(child.info.run_id, "FAILED")
    v = V.run_verdict(sid, tracking_uri=uri, out=tmp_path)
    assert v["source"]["kind"] == "mlflow" and v["source"]["parent_run_id"] == parent.info.run_id
    assert v["status"] == "Validated" and v["n_pairs"] == 2
    assert v["missing"][0]["status"] == "FAILED" and v["missing"][0]["seed"] == 3
    assert v["warm_start"] == ["3f2a9c1b0d4e"] and v["machine"] == ["AMD EPYC 7B13 | 1 threads | cpu"]
    assert v["commits"] == ["25917a6"]
    assert "warm start 3f2a9c1b0d4e; AMD EPYC 7B13 x1 thread, cpu; commit 25917a6" in V.table_row(v)["notes"]
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"verdict.json", "status.md", "plots"}
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == ["plots/paired_differences.png"]
    assert client.get_run(parent.info.run_id).data.tags["verdict"] == "Validated"
    # --experiment finds the same (latest) sweep
    assert V.run_verdict(experiment="h01", tracking_uri=uri, out=tmp_path)["n_pairs"] == 2
