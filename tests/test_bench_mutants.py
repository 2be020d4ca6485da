"""The mutation benchmark (benchmarks/bench_mutants.py and benchmarks/mutants/): the draw is
reproducible and split by hash, the import hook applies exactly one mutant in a child process and
leaves the file on disk alone, the executed-line filter, the stage map, harm classes on synthetic
runs, the scores and steps to diagnosis, and bench_cases without the defect sets. No 20-step job here
(one slow test runs two real mutants end to end)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from mutants import harm, population, score, stages, targets  # noqa: E402
from mutants.hook import MutantError, Site, mutated_source  # noqa: E402

REWARDS = ROOT / "musique_rl" / "env" / "rewards.py"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _site(mutant_id: str) -> targets.Mutant:
    module, qual = mutant_id.split(":")[:2]
    return next(m for m in targets.sites((targets.Target(module, {qual: None}),)) if m.id == mutant_id)


# ---------------------------------------------------------------- the draw and the split
def _fake_pop(n: int) -> list[population.Drawn]:
    out = []
    for i in range(n):
        site = Site(f"m.mod:f{i % 7}:Op:{i}", "m.mod", "core/Op", i, 10 + i, "0" * 16)
        out.append(population.Drawn(targets.Mutant(site, "m/mod.py", f"f{i % 7}", 0, "x"), "default", "loss", ""))
    return out


def test_the_draw_is_reproducible_from_the_salt_and_stable_when_the_population_grows():
    pop = _fake_pop(400)
    a = [d.id for d in population.draw(pop, "dev0", 50)]
    assert a == [d.id for d in population.draw(list(reversed(pop)), "dev0", 50)]  # order of the population is irrelevant
    assert len(set(a)) == 50
    assert a != [d.id for d in population.draw(pop, "dev1", 50)]  # another salt, another sample
    grown = pop + _fake_pop(420)[400:]
    b = [d.id for d in population.draw(grown, "dev0", 50)]
    # a site added elsewhere can take a place in the draw, but never reshuffles the ones drawn before it
    assert [i for i in a if i in b] == [i for i in b if i in a] and len(set(a) & set(b)) >= 40


def test_the_split_is_a_hash_of_salt_and_id_into_two_halves():
    pop = _fake_pop(400)
    drawn = population.draw(pop, "dev0", 400)
    halves = {s: [d.id for d in drawn if d.split == s] for s in ("dev", "test")}
    assert 150 < len(halves["test"]) < 250  # about half each
    assert [d.id for d in population.draw(pop, "dev0", 400, "test")] == halves["test"]
    assert all(population.split_of("dev0", i) == "test" for i in halves["test"])
    assert {d.split for d in population.draw(pop, "other", 400)} == {"dev", "test"}
    moved = sum(population.split_of("dev0", d.id) != population.split_of("other", d.id) for d in drawn)
    assert moved > 100  # a fresh salt draws a fresh test half


def test_the_list_command_prints_the_drawn_mutants_with_their_site_and_split():
    proc = subprocess.run([sys.executable, "benchmarks/bench_mutants.py", "--salt", "t0", "--sample", "4", "--list"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("4 mutants (all) of 4 drawn with salt 't0'")
    sites = [line for line in lines[1:] if not line.startswith("    ")]
    assert len(sites) == 4 and all("split=" in s and "stage=" in s and "variant=" in s and ".py:" in s for s in sites)
    again = subprocess.run([sys.executable, "benchmarks/bench_mutants.py", "--salt", "t0", "--sample", "4", "--list"],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.stdout == proc.stdout


def test_studied_mutants_are_left_out_of_a_new_draw_before_it_is_drawn(tmp_path):
    """--exclude FILE: the ids a file lists (one per line, # comments) never enter the draw; the rest keep
    their order, so the draw is the next ones in line. --blind cannot record: it judges nothing."""
    def listed(*extra):
        proc = subprocess.run([sys.executable, "benchmarks/bench_mutants.py", "--salt", "t0", "--sample", "4", "--list",
                               *extra], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    def ids(lines):
        return [line.split()[-1] for line in lines[1:] if not line.startswith("    ")]

    first = ids(listed())
    studied = tmp_path / "studied.txt"
    studied.write_text(f"# read already\n{first[0]}\n{first[2]}  # and this one\n")
    lines = listed("--exclude", str(studied))
    assert "(2 studied left out)" in lines[0]
    again = ids(lines)
    assert first[0] not in again and first[2] not in again and again[:2] == [first[1], first[3]]
    bad = subprocess.run([sys.executable, "benchmarks/bench_mutants.py", "--salt", "t0", "--sample", "4", "--out",
                          str(tmp_path), "--blind", "--record", str(tmp_path / "r.json")],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--blind" in bad.stderr


# ---------------------------------------------------------------- the import hook
CHILD = r"""
import json, sys
sys.path.insert(0, "benchmarks")
from mutants.hook import Site, install, applied
site = Site(**json.loads(sys.argv[1])) if sys.argv[1] != "none" else None
if site:
    install(site)
from musique_rl.env import rewards
print(json.dumps({"scores": rewards.answer_scores("Paris", ["paris"]), "applied": bool(site and applied(site)),
                  "file": rewards.__file__}))
"""


def test_the_hook_applies_exactly_one_mutant_in_a_child_and_leaves_the_file_alone():
    m = _site("musique_rl.env.rewards:answer_scores:ReplaceComparisonOperator_Eq_NotEq:0")
    on_disk = REWARDS.read_bytes()
    site = json.dumps(m.site.__dict__)
    mutant = subprocess.run([sys.executable, "-c", CHILD, site], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=300)
    clean = subprocess.run([sys.executable, "-c", CHILD, "none"], cwd=ROOT, env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert mutant.returncode == 0 and clean.returncode == 0, mutant.stderr + clean.stderr
    got, ref = json.loads(mutant.stdout), json.loads(clean.stdout)
    assert ref["scores"] == [1.0, 1.0] and not ref["applied"]
    assert got["scores"] == [0.0, 1.0] and got["applied"]  # `p != g`: the exact match is missed, F1 still 1
    assert got["file"] == str(REWARDS)  # compiled under the module's own file name
    assert REWARDS.read_bytes() == on_disk  # nothing on disk changed
    src = on_disk.decode()
    mutated = mutated_source(m.site, src).splitlines()
    changed = [n for n, (a, b) in enumerate(zip(src.splitlines(), mutated, strict=True), 1) if a != b]
    assert changed == [m.site.line]  # one mutation, on the line the site names


def test_the_hook_refuses_a_changed_source_and_a_module_already_imported():
    m = _site("musique_rl.env.rewards:answer_scores:ReplaceComparisonOperator_Eq_NotEq:0")
    with pytest.raises(MutantError, match="changed since the mutant was drawn"):
        mutated_source(m.site, REWARDS.read_text() + "\n# edited\n")
    from mutants.hook import install

    import musique_rl.env.rewards  # noqa: F401

    with pytest.raises(MutantError, match="already imported"):
        install(m.site)


def test_the_wrapper_says_when_the_mutated_module_was_never_imported(tmp_path):
    m = _site("musique_rl.env.rewards:answer_scores:ReplaceComparisonOperator_Eq_NotEq:0")
    (tmp_path / "site.json").write_text(json.dumps(m.site.__dict__))
    proc = subprocess.run([sys.executable, "benchmarks/mutant_job.py", "--mutant", str(tmp_path / "site.json"),
                           "--status", str(tmp_path / "status.json"), "--", "--cfg", "job"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    status = json.loads((tmp_path / "status.json").read_text())
    assert proc.returncode == 3 and status["rc"] == 3 and not status["applied"]
    assert "never imported" in status["error"]


# ---------------------------------------------------------------- the sites and the coverage filter
def test_sites_skip_annotations_and_instrument_lines_and_keep_trl_to_its_functions():
    all_sites = targets.sites()
    assert not [m for m in all_sites if "grad_scale: Tensor | None" in m.text]  # an annotation
    trainer = [m for m in all_sites if m.site.module == "musique_rl.core.trainer"]
    assert not [m for m in trainer if "self.instruments" in m.text or "merge_metrics" in m.text]
    trl = {m.qualname for m in all_sites if m.site.module == "trl.trainer.grpo_trainer"}
    assert trl <= {"GRPOTrainer._compute_loss", "GRPOTrainer._compute_loss.masked_seq_mean",
                   "GRPOTrainer._compute_loss.global_masked_mean", "GRPOTrainer._get_per_token_logps_and_entropies",
                   "GRPOTrainer._generate_and_score_completions"}
    adv = [m for m in all_sites if m.qualname == "GRPOTrainer._generate_and_score_completions"]
    lines = targets.module_path("trl.trainer.grpo_trainer").read_text().splitlines()
    first = next(n for n, s in enumerate(lines, 1) if targets.TRL_ADVANTAGES[0] in s)
    last = next(n for n, s in enumerate(lines, 1) if targets.TRL_ADVANTAGES[1] in s)
    assert adv and all(first <= m.site.line <= last for m in adv)  # only the lines that make the advantages
    assert any("advantages / (std_rewards + 1e-4)" in m.text for m in adv)


def test_a_site_counts_as_executed_only_when_its_line_and_its_function_body_ran():
    site = Site("m:f:Op:0", "m", "core/Op", 0, 10, "0" * 16)
    on_def_line = targets.Mutant(site, "m.py", "f", 0, "def f(x=1):", body=(11, 20))
    assert not targets.executed(on_def_line, {10})  # the def ran at import; the function was never called
    assert targets.executed(on_def_line, {10, 12})
    assert not targets.executed(targets.Mutant(site, "m.py", "f", 0, "y = 1", body=(9, 20)), {9, 11})
    assert targets.executed(targets.Mutant(site, "m.py", "<module>", 0, "X = 1"), {10})


def test_the_population_keeps_only_sites_the_clean_job_executes():
    src = REWARDS.read_text().splitlines()
    start = next(n for n, s in enumerate(src, 1) if s.startswith("def answer_scores"))
    end = next(n for n, s in enumerate(src, 1) if n > start and s.startswith("def "))
    body = [n for n in range(start, end) if "return 1.0, 1.0" not in src[n - 1]]  # as if no exact match was ever seen
    pop = population.population({"default": {"musique_rl.env.rewards": body}})
    assert pop and {d.mutant.qualname for d in pop} == {"answer_scores"}
    assert not [d for d in pop if "return 1.0, 1.0" in d.mutant.text]
    assert {d.stage for d in pop} == {"reward"} and {d.variant for d in pop} == {"default"}
    lora_only = population.population({"default": {}, "lora": {"musique_rl.env.rewards": body}})
    assert {d.variant for d in lora_only} == {"lora"}


def test_the_committed_executed_lines_are_those_of_the_current_sources():
    """The population (and so every draw) is defined by the committed executed lines; when a target
    module changes, they are measured again: python benchmarks/bench_mutants.py --measure-coverage
    --out /tmp/coverage (three clean 20-step jobs), and the rewritten file committed."""
    try:
        cov = population.read_coverage()
    except population.StaleCoverage as e:
        pytest.fail(f"{e}: run `python benchmarks/bench_mutants.py --measure-coverage --out /tmp/coverage` "
                    "and commit benchmarks/mutants/executed_lines.json")
    assert set(cov) == {v.name for v in population.VARIANTS}
    assert len(population.population(cov)) > 1000


# ---------------------------------------------------------------- the stage map
def test_the_stage_map_places_every_target_function_in_a_doctor_stage():
    from mutants import doctor

    assert stages.STAGE_NAMES == doctor.stage_names()
    stages.check({m.function for m in targets.sites()})  # every function with a site, run or not
    with pytest.raises(stages.StageMapError, match="musique_rl.core.rollout:not_a_function"):
        stages.check(["musique_rl.core.rollout:not_a_function"])
    assert stages.lookup("musique_rl.core.rollout:Episode.add_environment")[0] == "loss"  # via its class
    assert stages.lookup("musique_rl.core.trainer:MusiqueGRPOTrainer._observe_batch") is None  # excluded


def test_every_stage_map_entry_names_a_real_function():
    modules = {t.module for t in targets.TARGETS}
    for key in [*stages.STAGES, *stages.EXCLUDED]:
        module, _, qual = key.partition(":")
        assert module in modules, key
        if qual:
            assert qual in targets.definitions(module), f"{key}: no such function (moved or renamed?)"
        assert key in stages.EXCLUDED or stages.STAGES[key][1], key  # a reason each


# ---------------------------------------------------------------- harm classes
def _facts(rewards, before=(0.5,) * 8, after=(0.7,) * 8, rc=0, error=None):
    return harm.RunFacts(rc, error, list(rewards), list(before), list(after), 60.0)


def _clean():
    base = [0.5 + 0.01 * k for k in range(20)]
    return {"default": {s: _facts([r + 0.002 * s * (k % 3) for k, r in enumerate(base)],
                                  after=[0.7 + 0.01 * s] * 8) for s in (1, 2, 3)}}


def test_harm_classes_on_synthetic_reward_series():
    clean = _clean()
    sp = harm.spread(clean)
    c = clean["default"]
    classify = lambda runs, **kw: harm.classify(runs, c, "default", sp, **kw).cls  # noqa: E731
    assert classify({1: _facts(c[1].rewards, c[1].eval_before, c[1].eval_after)}) == "equivalent"
    assert classify({1: _facts([0.5] * 20, after=[0.5] * 8)}) == "harmful"  # learns nothing: both witnesses low
    assert classify({1: _facts([0.5 + 0.01 * k for k in range(20)], after=[0.72] * 8)}) == "harmless"
    assert classify({1: _facts([0.5 + 0.03 * k for k in range(20)], after=[0.9] * 8)}) == "harmless"  # better: no harm
    gain_z = -2.5 * sp.sd["gain"]  # between the inside and harmful bars on the held-out gain
    assert classify({1: _facts([0.5 + 0.01 * k for k in range(20)],
                               after=[0.5 + sp.centre["default"]["gain"] + gain_z] * 8)}) == "ambiguous"
    crashed = harm.classify({1: _facts([], rc=1, error="TypeError: unsupported operand")}, c, "default", sp)
    assert crashed.cls == "crashed" and "TypeError" in crashed.why
    assert classify({1: _facts([float("nan")] * 20)}) == "harmful"  # NaN rewards
    # a mutant of the reward itself wrote the training series: only the re-scored held-out gain counts
    halved = _facts([r / 2 for r in c[1].rewards], after=[0.71] * 8)
    assert classify({1: halved}) == "harmful" and classify({1: halved}, trend_counts=False) == "harmless"


def test_a_mutant_that_moves_only_the_instruments_readings_is_counted_apart_not_scored(tmp_path):
    """Training bitwise the clean run's: a mutant whose only changed numbers are our instruments'
    (the statement fed a measurement, not the training) is instrument code the static filter missed,
    reported as instrument_only; one whose trainer logs moved too (or nothing moved) stays equivalent.
    Wall-clock timings never count."""
    clean = _clean()
    sp = harm.spread(clean)
    c = clean["default"]

    def log(name, rows):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"step": k, **r}) + "\n" for k, r in enumerate(rows)))
        return path

    base = [{"reward": 0.5, "grad_norm": 0.8, "h03/kl_model_mean": 0.01, "step_time": 1.0 + k} for k in range(3)]
    clean_log = log("clean", base)
    kl_read = log("kl_read", [{**r, "h03/kl_model_mean": 0.5, "step_time": 9.0} for r in base])
    trained = log("trained", [{**r, "h03/kl_model_mean": 0.5, "grad_norm": 0.9} for r in base])
    timing = log("timing", [{**r, "step_time": 7.0, "train_runtime": 3.0} for r in base])
    same = {1: _facts(c[1].rewards, c[1].eval_before, c[1].eval_after)}

    def classify(mutant_log):
        return harm.classify(same, c, "default", sp, logs={1: (mutant_log, clean_log)})

    only = classify(kl_read)
    assert only.cls == "instrument_only" and "h03/kl_model_mean" in only.why
    assert classify(trained).cls == "equivalent" and classify(timing).cls == "equivalent"
    judged = [score.Judged("instrument_only", "loss", None, None, None), score.Judged("equivalent", "loss", None, None, None)]
    s = score.summary(judged)
    assert s["instrument_only"] == 1 and s["of"]["harmless_clean"] == [1, 1]


def test_the_clean_runs_fall_inside_their_own_spread_and_a_failed_clean_run_stops_the_judging():
    clean = _clean()
    sp = harm.spread(clean)
    for s, f in clean["default"].items():  # each clean run, nudged so that it is not bitwise the same: harmless
        nudged = _facts(f.rewards, f.eval_before, [x + 1e-9 for x in f.eval_after])
        assert harm.classify({s: nudged}, clean["default"], "default", sp).cls == "harmless"
    with pytest.raises(ValueError, match="clean runs failed"):
        harm.spread({"default": {1: _facts([], rc=1, error="boom")}})
    assert math.isclose(harm.trend([0.0, 1.0, 2.0]), 2.0)


# ---------------------------------------------------------------- scores and steps to diagnosis
def test_the_summary_counts_and_rates():
    J = score.Judged
    judged = [J("harmful", "loss", "h02 x", "loss", 3), J("harmful", "reward", "h02 x", "loss", 5),
              J("harmful", "update", None, None, None), J("harmless", "loss", None, None, None),
              J("equivalent", "inputs", "h04 y", "inputs", 2), J("equivalent", "inputs", None, None, None),
              J("ambiguous", "loss", "h01 z", "signal", 1), J("crashed", "loss", None, None, None)]
    s = score.summary(judged)
    assert set(score.KEYS) <= set(s)
    assert (s["mutants"], s["harmful"], s["harmless"], s["equivalent"], s["ambiguous"], s["crashed"]) == (8, 3, 1, 2, 1, 1)
    assert s["detected"] == round(2 / 3, 4) and s["of"]["detected"] == [2, 3]
    assert s["right_stage"] == round(1 / 3, 4) and s["of"]["right_stage"] == [1, 3]
    assert s["harmless_clean"] == round(2 / 3, 4) and s["of"]["harmless_clean"] == [2, 3]
    assert s["steps_to_diagnosis_median"] == 4
    assert score.summary([])["detected"] is None and score.summary([])["interval"]["detected"] is None
    # each rate with its 95% interval: 2 of 3 is anywhere from ~21% to ~94%
    low, high = s["interval"]["detected"]
    assert 0.2 < low < 0.25 and 0.9 < high < 0.95
    # 11 of 15 (a typical right-stage count) does not establish 75%, nor rule it out
    low, high = score.wilson(11, 15)
    assert low < 0.75 < high and abs(low - 0.4805) < 1e-3 and abs(high - 0.891) < 1e-3


def test_steps_to_diagnosis_is_the_first_prefix_naming_the_final_cause():
    def diag(k):  # clean up to 3, another cause at 4-5, the final one from 6 on
        if k < 4:
            return [{"flagged": False, "hypothesis": "h01", "check": "ok"}]
        return [{"flagged": True, "hypothesis": "h04" if k < 6 else "h02", "check": "c"}]

    assert score.steps_to_diagnosis(diag, "h02 c", 20) == 6
    assert score.steps_to_diagnosis(diag, "h04 c", 20) == 4
    assert score.steps_to_diagnosis(diag, "clean", 20) is None


def _run_dir(tmp_path: Path, plant_from: int | None) -> Path:
    """A run directory from the shipped healthy 20-step run; with ``plant_from``, tool tokens are
    trained from that step on (an exact invariant the doctor reads: h02)."""
    import yaml

    src = ROOT / "tests" / "fixtures" / "healthy_runs" / "clean20-float32-s1"
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    rows = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for r in rows:
        if plant_from is not None and r.get("step", 0) >= plant_from and "h02/env_tokens_with_loss" in r:
            r["h02/env_tokens_with_loss"] = 400.0
            r["h02/loss_share_tool"] = 0.3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = json.loads((src / "params.json").read_text())
    nested: dict = {}
    for k, v in params.items():
        node = nested
        *path, leaf = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(nested))
    return run


def test_diagnosis_and_steps_on_small_run_dirs(tmp_path):
    from mutants import runner

    job = _run_dir(tmp_path / "healthy", None).parent
    assert runner.diagnosis(job) == (None, None)  # the shipped healthy run: clean, no steps
    job = _run_dir(tmp_path / "planted", 8).parent
    top, steps = runner.diagnosis(job)
    assert top is not None and top["hypothesis"] == "h02"
    assert steps is not None and 8 <= steps <= 20  # never before the defect appears


# ---------------------------------------------------------------- bench_cases without the defect sets
def test_bench_cases_says_not_run_without_the_shared_cases(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_cases.py", "--cases", str(tmp_path / "absent"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "nothing run" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"status": "not run", "reason": f"no {tmp_path / 'absent'}"}
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- end to end (slow)
@pytest.mark.slow
def test_two_real_mutants_end_to_end(tmp_path):
    """The CLI as a user runs it: 9 clean jobs and 2 mutants of 20 steps (about 12 minutes on 2 cores)."""
    cmd = [sys.executable, "benchmarks/bench_mutants.py", "--salt", "slowtest", "--sample", "2", "--seeds", "1",
           "--out", str(tmp_path), "--parallel", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(score.KEYS) <= set(last) and last["mutants"] == 2
    assert sum(last[c] for c in harm.CLASSES) == 2
    assert (tmp_path / "mutants.md").is_file() and len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
    again = subprocess.run([*cmd, "--rejudge"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert json.loads(again.stdout.strip().splitlines()[-1]) == last  # the same judgement, no training
