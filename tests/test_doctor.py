"""The doctor: each fault's fingerprint in the metric histories names its hypothesis first; a clean
history flags nothing; a diagnosis round-trips through MLflow and the CLI."""

from __future__ import annotations

import json

import pytest

from musique_rl.core.faults import FAULTS as FAULT_REGISTRY
from musique_rl.doctor.cli import main
from musique_rl.doctor.diagnose import diagnose_metrics, diagnose_run, write_diagnosis

STEPS = 20


def series(f) -> list[tuple[int, float]]:
    return [(s, float(f(s))) for s in range(STEPS)]


def clean() -> dict[str, list[tuple[int, float]]]:
    """What a healthy 20-step run of the tiny model logs (orders of magnitude as measured)."""
    return {
        "h01/amplification_max": series(lambda s: 300.0),
        "h01/near_zero_std_share": series(lambda s: 0.3),
        "h01/near_tie_adv_share": series(lambda s: 0.1),
        "h01/adv_abs_max": series(lambda s: 2.47),
        "h02/env_tokens_with_loss": series(lambda s: 0),
        "h02/loss_share_tool": series(lambda s: 0),
        "h02/loss_share_template": series(lambda s: 0),
        "h02/assistant_tokens_without_loss_share": series(lambda s: 0),
        "h06/logp_gap_mean": series(lambda s: 3e-6),
        "h04/budget_cap_share": series(lambda s: 0.02),
        "h04/dropped_tool_results_share": series(lambda s: 0.0),
        "h04/question_left_context_share": series(lambda s: 0.0),
        "h04/prompt_at_cap_share": series(lambda s: 0.0),
        "h04/no_answer_share": series(lambda s: 0.05),
        "h05/reward_errors": series(lambda s: 0),
        "h05/answer_em/constant_group_share": series(lambda s: 0.3 + 0.02 * s),
        "h05/answer_em/mean": series(lambda s: 0.6 + 0.01 * s),
        "h05/answer_em/corr_total": series(lambda s: 0.9),
        "h05/answer_f1/constant_group_share": series(lambda s: 0.3),
        "h05/answer_f1/mean": series(lambda s: 0.7),
        "h06/parity_stale": [(s, 0.0) for s in range(0, STEPS, 10)],
        "h06/parity_sampler_trainer": [(s, 1e-6) for s in range(0, STEPS, 10)],
        "h07/tool_failure_rate": series(lambda s: 0.05),
        "h07/tool_calls_mean": series(lambda s: 2.0),
        "h08/update_weight_ratio": series(lambda s: 1e-3 * min(1, (s + 1) / 10)),
        "h08/kl_to_start": [(s, 0.02 * s) for s in range(0, STEPS, 10)],
        "h08/grad_norm_before_clip": series(lambda s: 0.8),
        "h08/grad_norm_after_clip": series(lambda s: 0.8),
        "preflight/signal_share_forecast": [(0, 0.95)],
        "preflight/pass_rate_mean": [(0, 0.64)],
    }


def with_(changes: dict) -> dict:
    m = clean()
    m.update(changes)
    return m


# What each planted fault leaves in the metric histories (its fingerprint, on top of clean()).
FINGERPRINTS = {
    "blind_context": {"h06/logp_gap_mean": series(lambda s: 0.8 + 0.01 * s)},
    "env_tokens_trained": {"h02/env_tokens_with_loss": series(lambda s: 180),
                           "h02/loss_share_tool": series(lambda s: 0.3)},
    "stale_sampler": {"h06/logp_gap_mean": series(lambda s: 0.003 * s),
                      "h06/parity_stale": [(0, 0.0), (10, 1.0)]},
    "std_epsilon": {"h01/amplification_max": series(lambda s: 3e6)},
    "kl_tool_tokens": {"h03/kl_env_tokens": series(lambda s: 40), "h03/kl_negative_share": series(lambda s: 0),
                       "h02/kl_mask_equals_loss_mask": series(lambda s: 0)},
    "kl_flipped": {"h03/kl_env_tokens": series(lambda s: 0), "h03/kl_negative_share": series(lambda s: 0.97),
                   "h02/kl_mask_equals_loss_mask": series(lambda s: 1)},
    "tiny_budgets": {"h04/budget_cap_share": series(lambda s: 0.9), "h04/no_answer_share": series(lambda s: 0.95),
                     "h04/dropped_tool_results_share": series(lambda s: 0.4),
                     "h05/answer_em/constant_group_share": series(lambda s: 1.0),
                     "h05/answer_em/mean": series(lambda s: 0.0),
                     "preflight/signal_share_forecast": [(0, 0.0)]},
    "first_turn_reward": {"h05/answer_em/constant_group_share": series(lambda s: 1.0),
                          "h05/answer_em/mean": series(lambda s: 0.0),
                          "h05/answer_f1/constant_group_share": series(lambda s: 1.0),
                          "h05/answer_f1/mean": series(lambda s: 0.0)},
    "tiny_updates": {"h08/update_weight_ratio": series(lambda s: 1e-5 * min(1, (s + 1) / 10)),
                     "h08/kl_to_start": [(0, 0.0), (10, 2e-6)],
                     "h08/grad_norm_after_clip": series(lambda s: 0.001)},
}


def test_clean_history_flags_nothing():
    diag = diagnose_metrics(clean(), {"reward.weights.answer_em": "1.0"})
    assert [d for d in diag if d.flagged] == []
    assert diag.top_hypothesis == "clean"
    assert {d.hypothesis for d in diag} >= {f"h0{i}" for i in range(1, 9)}  # every hypothesis accounted for


@pytest.mark.parametrize("fault", sorted(FINGERPRINTS))
def test_fault_fingerprint_names_its_hypothesis_first(fault):
    want, changes = FAULT_REGISTRY[fault].expected, FINGERPRINTS[fault]  # the finding its declaration expects
    diag = diagnose_metrics(with_(changes))
    top = diag[0]
    assert top.flagged and top.hypothesis == want, diag[:3]
    assert top.evidence and all(isinstance(v, float) for v in top.evidence.values())
    assert top.rank == 1 and top.verdict


def test_stale_sampler_verdict_uses_the_probe_words():
    diag = diagnose_metrics(with_(FINGERPRINTS["stale_sampler"]))
    assert "sampler matches base, not trainer" in diag[0].verdict


def test_answer_reward_rule_needs_answers_to_exist():
    # constant zero answer reward WITH no answers is truncation (h04), not a blind reward (h05)
    no_answers = with_({**FINGERPRINTS["first_turn_reward"], "h04/no_answer_share": series(lambda s: 0.9)})
    assert not any(d.flagged and d.hypothesis == "h05" for d in diagnose_metrics(no_answers))


def test_missing_metrics_are_reported_as_no_data_not_as_healthy():
    diag = diagnose_metrics({"h08/update_weight_ratio": series(lambda s: 1e-3)})
    nodata = {d.hypothesis for d in diag if d.check == "no_data"}
    assert nodata == {"h01", "h02", "h03", "h04", "h05", "h06", "h07"}


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from musique_rl.tracking.store import ensure_experiment

    return uri, ensure_experiment(uri, "doctor_test")


def _log_run(uri, exp_id, history, name):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = client.create_run(exp_id, run_name=name).info.run_id
    metrics = [Metric(k, v, 0, s) for k, h in history.items() for s, v in h]
    client.log_batch(run_id, metrics=metrics)
    client.set_terminated(run_id)
    return run_id


def test_diagnosis_round_trips_through_mlflow_and_the_cli(store, capsys):
    uri, exp_id = store
    bad = _log_run(uri, exp_id, with_(FINGERPRINTS["env_tokens_trained"]), "fault-env_tokens_trained-s1")
    good = _log_run(uri, exp_id, clean(), "clean-s1")
    diag = diagnose_run(bad, uri)
    assert diag.top_hypothesis == "h02"
    write_diagnosis(bad, diag, uri)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    with open(client.download_artifacts(bad, "diagnosis.json")) as fh:
        saved = json.load(fh)
    assert saved[0]["hypothesis"] == "h02" and saved == diag.to_json()
    assert client.get_run(bad).data.tags["diagnosis"] == "h02"

    assert main(["--run-id", good, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "top = clean" in out and "No flagged finding" in out
    assert main(["--experiment", "doctor_test", "--tracking-uri", uri, "--write"]) == 0
    out = capsys.readouterr().out
    assert "top = h02" in out and "flagged: h02 in 1" in out
    assert client.get_run(good).data.tags["diagnosis"] == "clean"
    assert main(["--experiment", "nope", "--tracking-uri", uri]) == 2


def test_an_answering_but_always_wrong_policy_is_not_a_blind_reward():
    wrong = with_({"h05/answer_em/constant_group_share": series(lambda s: 1.0),
                   "h05/answer_em/mean": series(lambda s: 0.0)})  # F1 still varies: the reward reads answers
    assert not any(d.flagged for d in diagnose_metrics(wrong))


def test_preflight_warning_needs_the_trained_reward_to_confirm_it():
    hard = {"preflight/signal_share_forecast": [(0, 0.05)], "preflight/pass_rate_mean": [(0, 0.01)]}
    partial_credit = with_({**hard, "h01/signal_group_share": series(lambda s: 0.8)})
    assert not any(d.flagged for d in diagnose_metrics(partial_credit))
    no_signal = with_({**hard, "h01/signal_group_share": series(lambda s: 0.1)})
    assert (diagnose_metrics(no_signal)).top_hypothesis == "preflight"


def test_vanishing_importance_weights_are_ranked_as_the_consequence_of_a_blind_trainer():
    """The case study's flat runs: a blind trainer (step-0 gap, attention coverage < 1) behind TRL's
    importance-sampling correction gives every sequence ~0 weight, so the policy never moves. The
    doctor must name the blind trainer first, and call the stillness its consequence, not advise
    a higher learning rate as the fix."""
    m = with_({
        "h06/logp_gap_mean": series(lambda s: 5.8),
        "h02/attention_coverage": series(lambda s: 0.23),
        "sampling/importance_sampling_ratio/mean": series(lambda s: 0.0),
        "h08/update_weight_ratio": series(lambda s: 0.0),
        "h08/kl_to_start": [(s, 0.0) for s in range(0, STEPS, 10)],
        "h06/lora_b_norm": series(lambda s: 0.0),
    })
    d = diagnose_metrics(m)
    assert d.top_hypothesis == "h02" and d[0].check == "trainer_sampler_mismatch_at_start"
    by_check = {x.check: x for x in d}
    for check in ("importance_weights_vanish", "updates_too_small", "lora_untrained"):
        assert by_check[check].flagged and "consequence of h02" in by_check[check].verdict
        assert by_check[check].rank > 1


def test_vanishing_importance_weights_alone_are_the_cause_of_the_stillness():
    """Weights weighted away starve the gradient (chain: loss -> gradient -> update), so with no
    mismatch flagged upstream the vanishing weights are the cause and the stillness their consequence
    (before the chain, only a mismatch root could explain the stillness: it ranked as a second cause)."""
    m = with_({"sampling/importance_sampling_ratio/mean": series(lambda s: 0.01),
               "h08/update_weight_ratio": series(lambda s: 0.0)})
    d = diagnose_metrics(m)
    found = {x.check: x for x in d if x.flagged}
    assert "importance_weights_vanish" in found and found["importance_weights_vanish"].hypothesis == "h06"
    assert d[0].check == "importance_weights_vanish" and d[0].role == "cause"
    assert found["updates_too_small"].role == "consequence"
    assert found["updates_too_small"].explained_by.name == "h06 importance_weights_vanish"
    assert "importance_weights_vanish" not in {x.check for x in diagnose_metrics(with_({
        "sampling/importance_sampling_ratio/mean": series(lambda s: 1.0)})) if x.flagged}


# ---------------------------------------------------------------- which side is wrong: decided by a third measurement
def test_a_first_step_gap_the_plain_forward_pass_does_not_share_is_the_trainers_scoring_in_the_loss():
    """A sampler/trainer gap before any update says two computations differ, not which one: the probe's
    plain forward pass of the trainer's weights over the sampled tokens decides. Reproducing the
    sampler (TRL's label mask inverted in its per-token log-probs: gap 0.18, forward 1e-6): the loss
    stage's scoring; not reproducing it (the generator's attention mask cut short): the sampling stage."""
    gap = {"h06/logp_gap_mean": series(lambda s: 0.18), "h06/logp_gap_floor": [(0, 0.0), (10, 1e-6)]}
    trainer_side = diagnose_metrics(with_({**gap, "h06/fit_gap_trainer": [(0, 1e-6)], "h06/fit_gap_best": [(0, 1e-6)]}))
    assert (trainer_side[0].check, trainer_side[0].stage) == ("trainer_logps_differ_from_forward", "loss")
    assert not next(f for f in trainer_side if f.check == "trainer_sampler_mismatch_at_start").flagged
    sampler_side = diagnose_metrics(with_({**gap, "h06/fit_gap_trainer": [(0, 0.04)], "h06/fit_gap_best": [(0, 0.04)]}))
    assert (sampler_side[0].check, sampler_side[0].stage) == ("trainer_sampler_mismatch_at_start", "sampling")
    assert not next(f for f in sampler_side if f.check == "trainer_logps_differ_from_forward").flagged


def test_budget_stops_the_lengths_refute_are_the_episode_loops_misreading_not_a_binding_budget():
    """Every episode 'ends at the turn budget' while no completion is half a turn's budget long (a loop
    that files every stopped turn as cut): the budget claim is refuted by the lengths, and the
    environment's stop reasons are named. Where the lengths reach the budget, the budget binds."""
    params = {"env.max_tokens_per_turn": "48", "env.max_completion_tokens": "512"}
    misread = with_({"h04/budget_cap_share": series(lambda s: 1.0), "h04/no_answer_share": series(lambda s: 1.0),
                     "h04/completion_len_max": series(lambda s: 13.0)})
    d = diagnose_metrics(misread, params)
    assert (d[0].hypothesis, d[0].check, d[0].stage) == ("h04", "stop_reasons_contradict_lengths", "environment")
    assert not next(f for f in d if f.check == "budgets_binding").flagged
    binding = with_({"h04/budget_cap_share": series(lambda s: 1.0), "h04/no_answer_share": series(lambda s: 1.0),
                     "h04/completion_len_max": series(lambda s: 48.0 + 85)})
    d = diagnose_metrics(binding, params)
    assert d[0].check == "budgets_binding" and d[0].flagged
    assert not next(f for f in d if f.check == "stop_reasons_contradict_lengths").flagged


def test_advantages_off_by_round_off_on_a_few_rows_are_their_own_and_another_rows_advantage_is_not():
    """A reward scaled 16x leaves 12% of rows 0.001 off their recomputed advantage (past the instrument's
    1e-3 line, within 1% of a unit): the rows carry their own advantages. Rows off by half a unit do not."""
    pairing = {"h01/loss_rows_unmatched_share": series(lambda s: 0.0), "h01/loss_adv_from_inputs": series(lambda s: 1.0)}
    round_off = with_({**pairing, "h01/loss_adv_misaligned_share": series(lambda s: 0.125 if s % 4 == 1 else 0.0),
                       "h01/loss_adv_pairing_error": series(lambda s: 0.001)})
    assert "advantages_not_paired_in_loss" not in [f.check for f in diagnose_metrics(round_off) if f.flagged]
    swapped = with_({**pairing, "h01/loss_adv_misaligned_share": series(lambda s: 0.125),
                     "h01/loss_adv_pairing_error": series(lambda s: 0.5)})
    assert diagnose_metrics(swapped)[0].check == "advantages_not_paired_in_loss"


def test_answers_the_independent_scorer_also_finds_wrong_clear_the_reward_and_point_upstream():
    """Every episode answers, the answer components are ~0: 'the reward does not read the answer' is
    one reading, 'the answers are wrong' the other. The independent scorer decides: agreeing with the
    reward on the answers and finding (almost) none right, the reward is cleared and the environment
    stage's answers_never_right is named; disagreeing, the reward's scorer is wrong."""
    dead = {"h04/no_answer_share": series(lambda s: 0.03), "h05/answer_em/constant_group_share": series(lambda s: 1.0),
            "h05/answer_em/mean": series(lambda s: 0.0), "h05/answer_f1/constant_group_share": series(lambda s: 0.99),
            "h05/answer_f1/mean": series(lambda s: 0.01), "h05/answer_check_checked": series(lambda s: 55.0),
            "h05/answer_check_matched": series(lambda s: 1.0 if s == 9 else 0.0)}
    d = diagnose_metrics(with_({**dead, "h05/answer_check_disagreement_share": series(lambda s: 0.0)}))
    assert (d[0].hypothesis, d[0].check, d[0].stage) == ("h07", "answers_never_right", "environment")
    assert not next(f for f in d if f.check == "answer_reward_blind").flagged
    d = diagnose_metrics(with_({**dead, "h05/answer_check_disagreement_share": series(lambda s: 0.4)}))
    assert (d[0].check, d[0].stage) == ("answer_scorer_wrong", "reward")
    assert "answers_never_right" not in [f.check for f in d if f.flagged]


def test_a_weak_symptom_on_a_run_whose_reward_rises_explains_nothing_and_is_withdrawn():
    """10% of episodes cut by a budget is just past the bound (tier 1). On a run whose reward rises
    (0.45 -> 0.75, p << 0.05) it caps nothing: withdrawn, with the reason. On a flat run it is the
    cause; and a defect (a proof) stands whatever the reward does."""
    cut = {"h04/budget_cap_share": series(lambda s: 0.102), "h04/no_answer_share": series(lambda s: 0.12)}
    rising = series(lambda s: 0.45 + 0.015 * s + (0.02 if s % 2 else -0.02))
    flat = series(lambda s: 0.55 + (0.02 if s % 2 else -0.02))
    d = diagnose_metrics(with_({**cut, "reward": rising}))
    budget = next(f for f in d if f.check == "budgets_binding")
    assert not budget.flagged and str(budget.role) == "withdrawn" and "reward rises" in budget.reason
    assert diagnose_metrics(with_({**cut, "reward": flat}))[0].check == "budgets_binding"
    proof = diagnose_metrics(with_({"h02/env_tokens_with_loss": series(lambda s: 12), "reward": rising}))
    assert proof[0].check == "env_tokens_in_loss" and proof[0].flagged


def test_a_first_step_gap_past_ten_floors_but_too_small_to_move_the_loss_is_not_a_finding():
    """The healthy bf16 LoRA run's first-step gap of 1.4e-4 (a floor of 5e-6 here: 28 floors) cannot move the
    clipped loss by 0.5% (1e-3 at epsilon 0.2): clean. The same gap under epsilon 0.01 could: flagged.
    A gap of 0.0087 (a generator attending to part of its context) is a finding either way."""
    def gap(v):
        return with_({"h06/logp_gap_mean": series(lambda s: v), "h06/logp_gap_floor": [(0, 5e-6), (10, 5e-6)]})
    assert not [f for f in diagnose_metrics(gap(1.4e-4), {"loss.epsilon": "0.2"}) if f.flagged]
    assert diagnose_metrics(gap(1.4e-4), {"loss.epsilon": "0.01"})[0].check == "trainer_sampler_mismatch_at_start"
    assert diagnose_metrics(gap(0.0087), {"loss.epsilon": "0.2"})[0].check == "trainer_sampler_mismatch_at_start"


def test_a_kl_term_that_is_not_the_kl_is_named_and_explains_the_pairing_residual_it_leaves():
    """TRL's k3 estimator corrupted under beta 0.04: the loss logs a KL of 1.0 where the same k3 from the
    same log-probs is 0.015, and the point-of-use pairing reads every row 0.04 (= beta) off its
    advantage. The KL term is named; the pairing residual, within 2 x beta, is withdrawn as its trace.
    Equal KLs (a healthy beta > 0 run) are no finding; a row off by half a unit stays a reorder."""
    params = {"loss.beta": "0.04"}
    pairing = {"h01/loss_rows_unmatched_share": series(lambda s: 0.0), "h01/loss_adv_from_inputs": series(lambda s: 1.0),
               "h01/loss_adv_misaligned_share": series(lambda s: 1.0)}
    broken = with_({**pairing, "kl": series(lambda s: 1.0), "h03/kl_model_mean": series(lambda s: 0.015),
                    "h01/loss_adv_pairing_error": series(lambda s: 0.04)})
    d = diagnose_metrics(broken, params)
    assert (d[0].hypothesis, d[0].check, d[0].stage) == ("h03", "kl_term_differs_from_kl", "loss")
    assert str(next(f for f in d if f.check == "advantages_not_paired_in_loss").role) == "withdrawn"
    healthy = with_({"kl": series(lambda s: 1e-4 * s), "h03/kl_model_mean": series(lambda s: 1e-4 * s)})
    assert "kl_term_differs_from_kl" not in [f.check for f in diagnose_metrics(healthy, params) if f.flagged]
    reorder = with_({**pairing, "kl": series(lambda s: 1.0), "h03/kl_model_mean": series(lambda s: 0.015),
                     "h01/loss_adv_pairing_error": series(lambda s: 0.5)})
    assert "advantages_not_paired_in_loss" in [f.check for f in diagnose_metrics(reorder, params) if f.flagged]


def test_a_total_reward_that_ties_where_its_weighted_components_vary_is_named_in_the_reward_stage():
    """A hop scale of 0 multiplies every episode's total by 0: every group ties (no signal) while the
    weighted answer components vary in 7 groups of 8. The total can tie only where its components all do:
    the reward stage's total_ignores_components is the cause, the tied groups its consequence. A weight
    of 0 in the config is not a component of the total."""
    weights = {"reward.weights.answer_em": "1.0", "reward.weights.answer_f1": "0.5"}
    tied = with_({"h01/zero_std_share": series(lambda s: 1.0), "h01/signal_group_share": series(lambda s: 0.0),
                  "h05/answer_em/constant_group_share": series(lambda s: 0.125),
                  "h05/answer_f1/constant_group_share": series(lambda s: 0.125)})
    d = diagnose_metrics(tied, weights)
    assert (d[0].hypothesis, d[0].check, d[0].stage) == ("h05", "total_ignores_components", "reward")
    healthy = with_({"h01/zero_std_share": series(lambda s: 0.1), "h05/answer_em/constant_group_share": series(lambda s: 0.125),
                     "h05/answer_f1/constant_group_share": series(lambda s: 0.125)})
    assert "total_ignores_components" not in [f.check for f in diagnose_metrics(healthy, weights) if f.flagged]
    unweighted = {"reward.weights.answer_em": "0", "reward.weights.answer_f1": "0"}
    assert "total_ignores_components" not in [f.check for f in diagnose_metrics(tied, unweighted) if f.flagged]


def test_turn_cap_stops_on_one_turn_episodes_are_the_loops_misreading():
    """Every episode 'stopped at the turn cap' (env.max_turns 4) with one turn each: a cap no episode
    reached. The turn counts refute the stop reasons: the environment's stop_reasons_contradict_lengths.
    A run whose capped episodes hold their four turns is clean of it."""
    params = {"env.max_turns": "4"}
    misread = with_({"h04/stop_max_turns_share": series(lambda s: 1.0), "h07/turns_mean": series(lambda s: 1.0),
                     "h04/no_answer_share": series(lambda s: 1.0)})
    d = diagnose_metrics(misread, params)
    assert (d[0].check, d[0].stage) == ("stop_reasons_contradict_lengths", "environment") and "turn cap" in d[0].verdict
    capped = with_({"h04/stop_max_turns_share": series(lambda s: 0.25), "h07/turns_mean": series(lambda s: 2.9)})
    assert "stop_reasons_contradict_lengths" not in [f.check for f in diagnose_metrics(capped, params) if f.flagged]


def test_budgets_that_bind_because_the_sampler_draws_from_another_distribution_are_its_consequence():
    """Every episode reaches its token budget and, before any update, the sampler's log-probs are 13.8
    nats/token from the trainer's: a sampler that draws from another distribution rambles to every
    budget. The sampling defect is the cause, the binding budgets its consequence; budgets alone stay
    the cause (too small for the task)."""
    budgets = {"h04/budget_cap_share": series(lambda s: 1.0), "h04/no_answer_share": series(lambda s: 1.0)}
    gap = {"h06/logp_gap_mean": series(lambda s: 13.8), "h06/logp_gap_floor": [(0, 1e-6), (10, 1e-6)],
           "h06/fit_gap_trainer": [(0, 13.8)], "h06/fit_gap_best": [(0, 13.0)]}
    d = diagnose_metrics(with_({**budgets, **gap}))
    assert (d[0].check, d[0].stage) == ("trainer_sampler_mismatch_at_start", "sampling")
    budget = next(f for f in d if f.check == "budgets_binding")
    assert budget.flagged and str(budget.role) == "consequence" and budget.explained_by.check == d[0].check
    alone = diagnose_metrics(with_(budgets))
    assert alone[0].check == "budgets_binding" and str(alone[0].role) == "cause"
