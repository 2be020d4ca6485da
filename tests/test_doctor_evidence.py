"""The doctor weighs evidence: causes ranked by what was measured against the healthy runs,
a measurement refuted only by a measurement, every check run, no single-step proof, reward roles from
the values, and the healthy null table the grades stand on kept up to date."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.doctor.evidence import BOUND_SPREADS, Measure, Null, effect, grade

ROOT = Path(__file__).resolve().parents[1]


def steps(vals, start=1):
    return [(start + i, float(v)) for i, v in enumerate(vals)]


def flagged(d):
    return [(f.hypothesis, f.check, str(f.role)) for f in d if f.flagged]


# ---------------------------------------------------------------- the grade
def test_a_statistic_just_past_its_bound_is_weak_and_one_no_healthy_run_comes_near_is_decisive():
    null = Null(n=12, center=0.01, spread=0.02)
    at_bound = Measure("x", 0.11, 0.1)
    assert abs(effect(at_bound, null) - BOUND_SPREADS * 0.1 / 0.09) < 1e-9
    assert int(grade(at_bound, null)) == 1
    far = Measure("x", 0.95, 0.1)  # 31 healthy spreads out
    assert int(grade(far, null)) == 3
    # the healthy spread, when larger than the bound's third, is the unit: the same value weighs less
    assert effect(far, Null(12, 0.01, 0.2)) < effect(far, null)


def test_a_share_at_its_worst_end_is_a_proof_and_an_exact_invariant_is_one_however_small():
    null = Null(n=12, center=0.007, spread=0.035)
    every_call = Measure("h07/tool_failure_rate (mean)", 1.0, 0.5, share=True)
    most_calls = Measure("h07/tool_failure_rate (mean)", 0.9, 0.5, share=True)
    assert every_call.categorical and not most_calls.categorical
    assert int(grade(every_call, null)) == 3 and int(grade(most_calls, null)) < 3
    assert int(grade(Measure("count", 1.0, 0.0, exact=True), Null(12, 0.0, 0.0))) == 3


def test_a_log_measure_counts_orders_of_magnitude():
    null = Null(n=9, center=-1.7, spread=0.5)  # log10 of a healthy KL median ~0.02
    m = Measure("kl (median)", 0.0016, 0.01, worse="below", log=True)
    e = effect(m, null)
    assert 2.0 < e < 2.5  # (log10 0.02 - log10 0.0016) / 0.5: about one order of magnitude, two spreads


# ---------------------------------------------------------------- no single-step proof
def test_one_negative_kl_step_in_a_run_whose_kl_is_positive_is_no_sign_error_and_the_runaway_still_runs():
    kl = [0.03] * 40
    kl[17] = -4e-5
    d = diagnose_metrics({"kl": steps(kl), "reward": steps([0.5 + 0.01 * i for i in range(40)])}, {"beta": "0.04"})
    assert not any(f.flagged for f in d if f.check == "kl_negative")
    assert d.find("kl_runaway") is not None  # judged, not pre-empted by the single step
    neg = diagnose_metrics({"kl": steps([-0.01] * 40)}, {"beta": "0.04"})
    assert neg.find("kl_negative").flagged


# ---------------------------------------------------------------- every check runs
def _flat_run(n=300, kl=0.0016, clipped=0.11):
    import random

    rng = random.Random(0)
    return {
        "reward": steps([0.46 + rng.uniform(-0.05, 0.05) for _ in range(n)]),
        "kl": steps([0.0] + [kl * (1 + rng.uniform(-0.5, 0.5)) for _ in range(n - 1)]),  # 0 before any update
        "frac_reward_zero_std": steps([0.1] * n),
        "grad_norm": steps([0.5 + rng.uniform(-0.1, 0.1) for _ in range(n)]),
        "learning_rate": steps([5e-6] * n),
        "completions/clipped_ratio": steps([clipped] * n),
    }


def test_a_flat_run_whose_policy_barely_moves_says_so_even_when_a_truncation_is_flagged():
    d = diagnose_metrics(_flat_run(), {"beta": "0.04"})
    found = {f.check: f for f in d if f.flagged}
    assert "completions_truncated" in found and "policy_barely_moves" in found
    # and the policy stage's ok words never call a KL below the doctor's own bar "moving"
    still = d.find("policy_still")
    assert still is not None and not still.flagged and "below the 0.01" in still.verdict


def test_the_policy_barely_moves_is_judged_by_the_median_not_one_step():
    m = _flat_run(clipped=0.0)
    kl = dict(m["kl"])
    kl[150] = 0.08  # one step reaches 0.08; the median sits at 0.0016
    m["kl"] = sorted(kl.items())
    d = diagnose_metrics(m, {"beta": "0.04"})
    assert d.top is not None and d.top.check == "policy_barely_moves"


# ---------------------------------------------------------------- evidence over a kind fixed per check
def clean_with_constants(constants: dict[str, float]) -> dict:
    """The healthy 20-step histories of tests/test_doctor.py with each key held at one value on every step."""
    from tests.test_doctor import clean

    m = clean()
    n = len(m["h07/tool_failure_rate"])
    m.update({k: steps([v] * n, start=0) for k, v in constants.items()})
    return m


def test_every_tool_call_refused_outranks_the_answer_reward_it_starves():
    m = clean_with_constants({"h07/tool_failure_rate": 1.0, "h05/answer_em/mean": 0.0,
                              "h05/answer_em/constant_group_share": 1.0, "h05/answer_f1/mean": 0.0,
                              "h05/answer_f1/constant_group_share": 1.0})
    d = diagnose_metrics(m, {})
    assert d.top is not None and (d.top.hypothesis, d.top.check) == ("h07", "tool_failures")
    blind = d.find("answer_reward_blind")
    assert blind.flagged and str(blind.role) == "consequence" and blind.explained_by is d.top


def test_every_group_identical_is_a_proof_that_explains_the_tied_groups_it_causes():
    """Greedy rollouts: every group's G completions identical, so every group ties. The share of
    identical groups at its worst end is categorical, as strong as the tied groups downstream, so the
    sampling stage is the cause and the missing signal its consequence (the Poisson tail, which floors
    near 1e-16, graded it below the tie and left the signal stage on top)."""
    m = clean_with_constants({"h06/identical_group_share": 1.0, "h06/identical_group_expected_share": 0.002,
                              "h01/zero_std_share": 1.0, "h01/adv_abs_max": 0.0})
    d = diagnose_metrics(m, {"train.prompts_per_step": "8"})
    assert d.top is not None and (d.top.hypothesis, d.top.check) == ("h06", "sampling_not_diverse"), flagged(d)
    tied = d.find("no_signal")
    assert tied.flagged and str(tied.role) == "consequence" and tied.explained_by is d.top
    # most groups identical, not all: the tail is the measure, and a weaker one
    m["h06/identical_group_share"] = [(s, 0.5) for s, _ in m["h06/identical_group_share"]]
    d = diagnose_metrics(m, {"train.prompts_per_step": "8"})
    assert int(d.find("sampling_not_diverse").severity) < 3


def test_a_weak_truncation_does_not_explain_a_task_reward_that_is_the_same_for_every_completion():
    n = 30
    m = {"rewards/environment_reward_function/mean": steps([-5.0] * n),
         "rewards/environment_reward_function/std": steps([0.0] * n),
         "rewards/format_reward/mean": steps([0.876 + 0.004 * i for i in range(n)]),
         "rewards/format_reward/std": steps([0.1] * n),
         "completions/clipped_ratio": steps([0.42] * n),
         "frac_reward_zero_std": steps([0.6] * n),
         "reward": steps([-4.12 + 0.004 * i for i in range(n)])}
    d = diagnose_metrics(m, {})
    assert (d.top.hypothesis, d.top.check) == ("h05", "reward_function_constant")
    assert str(d.find("completions_truncated").role) == "cause"  # another cause, not its explanation


# ---------------------------------------------------------------- reward roles from the values
def _funcs(**f):
    m = {}
    for name, (means, stds) in f.items():
        m[f"rewards/{name}/mean"] = steps(means)
        m[f"rewards/{name}/std"] = steps(stds)
    return m


def test_a_reward_that_pays_on_2_of_30_steps_does_not_vary():
    pays = [0.0] * 30
    pays[4] = pays[20] = 0.05
    std = [0.0] * 30
    std[4] = std[20] = 0.2
    m = _funcs(correctness_reward_func=(pays, std), format_reward_func=([0.5 + 0.01 * i for i in range(30)], [0.1] * 30))
    d = [f for f in diagnose_metrics(m, {}) if f.check == "reward_function_constant"]
    assert any(f.flagged and "correctness_reward_func" in f.verdict for f in d)


def test_a_saturated_format_reward_and_a_strict_format_nobody_earns_are_notes_not_causes():
    m = _funcs(answer_format=([1.0] * 30, [0.0] * 30), strict_format=([0.0] * 30, [0.0] * 30),
               answer_correct=([0.4 + 0.01 * i for i in range(30)], [0.45] * 30))
    d = [f for f in diagnose_metrics(m, {}) if f.check == "reward_function_constant"]
    assert d and not any(f.flagged for f in d)


def test_the_reward_main_part_constant_is_a_finding_whatever_it_is_called():
    m = _funcs(thing_a=([-5.0] * 30, [0.0] * 30), thing_b=([0.9 + 0.003 * i for i in range(30)], [0.1] * 30))
    d = [f for f in diagnose_metrics(m, {}) if f.check == "reward_function_constant" and f.flagged]
    assert d and "thing_a" in d[0].verdict and "thing_b" not in d[0].verdict.split("learns only from")[0]


# ---------------------------------------------------------------- a measurement refuted only by a measurement
def _gap_run(parity: float | None):
    from tests.test_doctor import clean

    m = clean()
    n = len(m["h06/logp_gap_mean"])
    m["h06/logp_gap_mean"] = steps([5e-7 * (1 + 20000 * i / n) for i in range(n)], start=0)  # 5e-7 -> ~1e-2
    m["h06/logp_gap_floor"] = [(0, 2e-7), (10, 3e-7)]
    if parity is None:
        del m["h06/parity_sampler_trainer"]
    else:
        m["h06/parity_sampler_trainer"] = [(0, 0.0), (10, parity)]
    return m


def test_an_in_process_backend_does_not_withdraw_a_measured_gap_the_parity_probe_does():
    params = {"train.backend": "hf", "model.dtype": "float32"}
    measured_equal = diagnose_metrics(_gap_run(0.0), params).find("gap_grows")
    assert measured_equal is not None and str(measured_equal.role) == "withdrawn"
    assert "parity probe" in measured_equal.reason
    no_probe = diagnose_metrics(_gap_run(None), params).find("gap_grows")
    assert no_probe.flagged  # the backend alone is no evidence
    lagging = diagnose_metrics(_gap_run(0.012), params)
    sync = lagging.find("sync")
    assert sync.flagged and int(sync.severity) == 3


# ---------------------------------------------------------------- non-finite values are a note
def test_a_nan_gradient_norm_is_a_note_and_the_rest_of_the_log_is_read():
    m = _flat_run(clipped=0.0)
    g = dict(m["grad_norm"])
    g[138] = float("nan")
    m["grad_norm"] = sorted(g.items())
    d = diagnose_metrics(m, {"beta": "0.04"})
    assert d.find("gradient_not_finite") is not None and not d.find("gradient_not_finite").flagged
    assert d.top is not None and d.top.check == "policy_barely_moves"


# ---------------------------------------------------------------- the table the grades stand on
def test_the_healthy_null_table_is_what_the_committed_healthy_histories_give():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "healthy_null.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_check_is_flagged_on_the_healthy_histories_beyond_what_they_allow():
    from musique_rl.doctor.evidence import table

    t = table()
    assert len(t["histories"]) >= 15
    allowed = {"void_turns", "learnability"}  # the Qwen2.5 stand-in's allowed notes (healthy_runs/expected.json)
    assert {c for c, v in t["checks"].items() if v["flagged"]} <= allowed


# ---------------------------------------------------------------- mechanisms the new instruments observe
def test_a_reference_that_is_the_policy_is_a_loss_stage_proof():
    from tests.test_doctor import clean

    m = clean()
    m["h03/ref_is_policy"] = [(0, 1.0), (10, 1.0)]
    d = diagnose_metrics(m, {"loss.beta": "0.04"})
    assert (d.top.hypothesis, d.top.check, d.top.stage) == ("h03", "reference_is_policy", "loss")
    m["h03/ref_is_policy"] = [(0, 0.0), (10, 0.0)]
    assert not diagnose_metrics(m, {"loss.beta": "0.04"}).flagged


def test_an_exact_match_the_independent_scorer_disagrees_with_is_the_reward_stage():
    from tests.test_doctor import clean

    m = clean()
    n = len(m["h05/answer_em/mean"])
    m["h05/answer_check_disagreement_share"] = steps([0.3] * n, start=0)
    m["h05/answer_check_match_disagreement_share"] = steps([0.95] * n, start=0)
    d = diagnose_metrics(m, {})
    assert (d.top.hypothesis, d.top.check, d.top.stage) == ("h05", "answer_scorer_wrong", "reward")
    m["h05/answer_check_disagreement_share"] = steps([0.0] * n, start=0)
    m["h05/answer_check_match_disagreement_share"] = steps([0.0] * n, start=0)
    assert not diagnose_metrics(m, {}).flagged


def test_an_optimizer_whose_rate_is_0_while_the_schedule_says_otherwise_is_named_and_starves_what_follows():
    from tests.test_doctor import clean

    m = clean()
    n = len(m["h08/update_weight_ratio"])
    m["h08/lr_applied_over_configured"] = steps([1.0, 1.0] + [0.0] * (n - 2), start=0)
    m["h08/lr_applied_over_logged"] = steps([1.0] * n, start=0)
    m["h08/update_weight_ratio"] = steps([1e-3, 1e-3] + [0.0] * (n - 2), start=0)
    d = diagnose_metrics(m, {})
    top = d.top
    assert (top.hypothesis, top.check) == ("h08", "learning_rate_not_applied") and top.starves
    assert all(str(f.role) == "consequence" for f in d.flagged if f is not top and f.stage in ("update", "policy"))


def test_trainable_parameters_outside_the_optimizer_are_a_proof():
    from tests.test_doctor import clean

    m = clean()
    m["h08/trainable_outside_optimizer_share"] = [(1, 0.5), (2, 0.5)]
    m["h06/lora_b_norm"] = [(s, 0.0) for s in range(0, 20, 5)]
    d = diagnose_metrics(m, {"lora.r": "8"})
    assert (d.top.hypothesis, d.top.check) == ("h08", "parameters_outside_optimizer")
    assert str(d.find("lora_untrained").role) == "consequence"
