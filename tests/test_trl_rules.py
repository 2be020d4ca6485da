"""The rules over TRL's metric names on metrics this CPU cannot produce with plain TRL: the
``sampling/*`` metrics exist only with vLLM, and a KL that runs away or goes negative takes a
broken run. Histories are built in TRL's names and shapes; each test pairs a defect with its
healthy counterpart so a rule that fires on everything (or nothing) fails."""

from __future__ import annotations

from musique_rl.doctor.diagnose import diagnose_metrics
from musique_rl.doctor.stages.sampling import LOGP_DIFF_MAX


def steps(values):
    return [(i + 1, float(v)) for i, v in enumerate(values)]


def checks(m, params=None):
    return {(d.hypothesis, d.check) for d in diagnose_metrics(m, params or {}) if d.flagged}


def test_sampler_trainer_difference_at_start_and_drifting():
    healthy = {"sampling/sampling_logp_difference/mean": steps([0.02] * 20)}
    at_start = {"sampling/sampling_logp_difference/mean": steps([0.3] * 20)}
    drift = {"sampling/sampling_logp_difference/mean": steps([0.01] * 10 + [0.01 + 0.05 * i for i in range(10)])}
    assert not checks(healthy) & {("h06", "sampler_trainer_differ_at_start"), ("h06", "sampler_trainer_drift")}
    assert ("h06", "sampler_trainer_differ_at_start") in checks(at_start)
    assert ("h06", "sampler_trainer_drift") in checks(drift)
    assert 0.02 < LOGP_DIFF_MAX  # a healthy bf16 gap (0.011-0.036 measured) is below the threshold


def test_our_instrument_for_the_same_defect_silences_the_trl_name_rule():
    """Our runs log TRL's metrics too: with our h06 gap instrument present, one finding, not two."""
    m = {"sampling/sampling_logp_difference/mean": steps([0.3] * 20), "h06/logp_gap_mean": steps([0.3] * 20)}
    flagged = [d.check for d in diagnose_metrics(m, {}) if d.flagged]
    assert "sampler_trainer_differ_at_start" not in flagged
    assert any(c in flagged for c in ("trainer_sampler_mismatch_at_start", "sampling_settings_differ"))


def test_importance_weights_at_the_cap_or_vanishing():
    ok = {"sampling/importance_sampling_ratio/max": steps([1.3] * 10),
          "sampling/importance_sampling_ratio/min": steps([0.7] * 10)}
    capped = {"sampling/importance_sampling_ratio/max": steps([3.0] * 10),
              "sampling/importance_sampling_ratio/min": steps([0.5] * 10)}
    lower_cap = {"vllm_importance_sampling_cap": "2.0"}
    assert ("h06", "importance_weights_clipped") not in checks(ok)
    assert ("h06", "importance_weights_clipped") in checks(capped)
    assert ("h06", "importance_weights_clipped") in checks(
        {**ok, "sampling/importance_sampling_ratio/max": steps([2.0] * 10)}, lower_cap)


def test_kl_negative_is_a_proof_and_runaway_needs_level_and_growth():
    assert ("h03", "kl_negative") in checks({"kl": steps([0.01, -0.02] * 6)})
    assert ("h03", "kl_runaway") in checks({"kl": steps([0.01] * 5 + [0.5] * 5 + [3.0] * 5)})
    grows_but_small = {"kl": steps([1e-4] * 5 + [0.01] * 10)}  # early growth of a healthy run
    assert not {c for c in checks(grows_but_small) if c[0] == "h03"}


def test_reward_rising_while_a_component_falls():
    n = 20
    total = [1 + 0.05 * i for i in range(n)]
    fmt = [0.2 + 0.08 * i for i in range(n)]
    correct = [0.8 - 0.03 * i for i in range(n)]
    noise = [0.01 * ((-1) ** i) for i in range(n)]
    m = {"reward": steps([t + e for t, e in zip(total, noise, strict=True)]),
         "rewards/format/mean": steps(fmt), "rewards/format/std": steps([0.3] * n),
         "rewards/correct/mean": steps([c + e for c, e in zip(correct, noise, strict=True)]),
         "rewards/correct/std": steps([0.4] * n)}
    assert ("h05", "reward_rises_component_falls") in checks(m)
    m["rewards/correct/mean"] = steps([0.5 + 0.02 * i + e for i, e in enumerate(noise)])
    assert ("h05", "reward_rises_component_falls") not in checks(m)


def test_a_saturated_reward_function_is_reported_but_not_flagged():
    """A format reward the policy always satisfies carries no signal and harms nothing."""
    m = {"rewards/format/mean": steps([1.0] * 10), "rewards/format/std": steps([0.0] * 10),
         "rewards/correct/mean": steps([0.5] * 10), "rewards/correct/std": steps([0.4] * 10)}
    d = [d for d in diagnose_metrics(m, {}) if d.check == "reward_function_constant"]
    assert d and not any(x.flagged for x in d) and "saturated" in d[0].verdict


def test_our_budget_instrument_and_trls_clipped_ratio_report_one_truncation():
    m = {"completions/clipped_ratio": steps([0.6] * 10), "h04/budget_cap_share": steps([0.6] * 10)}
    truncation = [c for c in checks(m) if c[0] == "h04"]
    assert truncation == [("h04", "budgets_binding")]
    del m["h04/budget_cap_share"]
    assert [c for c in checks(m) if c[0] == "h04"] == [("h04", "completions_truncated")]


def test_learning_rate_rule_spares_warmup_and_a_linear_decay_to_zero():
    linear = [min(i / 10, 1.0) * (1 - i / 60) * 1e-3 for i in range(61)]  # warmup from 0, decay to 0
    assert ("h08", "learning_rate_zero") not in checks({"learning_rate": steps(linear)})
    ended = [1e-3] * 20 + [0.0] * 40
    assert ("h08", "learning_rate_zero") in checks({"learning_rate": steps(ended)})
    assert ("h08", "learning_rate_zero") in checks({"learning_rate": steps([0.0] * 30)})


def test_a_flat_run_whose_policy_barely_moves_despite_signal_is_the_update_stages():
    """A flat run with strong group signal used to come out "cause not found": TRL's own `kl` says
    whether the policy moves at all (a public Wordle run: KL 0.001-0.009 over 400 flat steps)."""
    import random

    rng = random.Random(0)
    n = 120
    base = {"reward": steps([-0.2 + rng.gauss(0, 0.3) for _ in range(n)]),
            "frac_reward_zero_std": steps([0.0] * n), "grad_norm": steps([0.2 + rng.gauss(0, 0.02) for _ in range(n)]),
            "learning_rate": steps([1e-5] * n)}
    still = {**base, "kl": steps([0.001 + 0.00003 * i for i in range(n)])}
    found = {d.check: d for d in diagnose_metrics(still, {}) if d.flagged}
    assert list(found) == ["policy_barely_moves"] and found["policy_barely_moves"].stage == "update"
    assert "raise the learning rate" in found["policy_barely_moves"].verdict
    # the policy moves (0.05 nats/token) and the reward stays flat: not an update problem
    moves = {**base, "kl": steps([0.0005 * i for i in range(n)])}
    assert ("unexplained", "flat_reward_cause_not_found") in checks(moves)
    # TRL logs kl = 0 when it computes none (beta 0): nothing to read, so no claim
    assert ("unexplained", "flat_reward_cause_not_found") in checks({**base, "kl": steps([0.0] * n)})
    # most groups tied: the signal stage speaks first, not this finding
    weak = {**still, "frac_reward_zero_std": steps([0.8] * n)}
    assert ("h08", "policy_barely_moves") not in checks(weak)
    # a run that learns is not judged at all
    rising = {**still, "reward": steps([-0.2 + 0.01 * i + rng.gauss(0, 0.1) for i in range(n)])}
    assert not checks(rising)


def test_a_first_logged_kl_the_updates_before_it_cannot_explain_stays_a_reference_finding():
    """TRL logs every logging_steps: a KL at the first row (step 5) may be the updates'. Not when those
    updates ran in the warm-up at a tiny rate (a public run: 12.1 nats/token after 4 steps at <= 1.75e-7)."""
    rows = range(5, 205, 5)
    warm = {"kl": [(s, 0.3 if s == 5 else 0.1) for s in rows], "reward": [(s, 1.0 + 0.001 * s) for s in rows],
            "learning_rate": [(s, 5e-6 * min(1.0, s / 115)) for s in rows]}
    d = next(x for x in diagnose_metrics(warm, {}) if x.check == "kl_at_start")
    assert d.flagged and d.role == "cause" and "step 5" in d.verdict
    # the same first KL after 4 steps at the peak rate (up to 4 x 0.1 nats/token): theirs, withdrawn
    peak = {**warm, "learning_rate": [(s, 5e-6) for s in rows]}
    d = next(x for x in diagnose_metrics(peak, {}) if x.check == "kl_at_start")
    assert not d.flagged and d.role == "withdrawn" and "peak-rate step" in d.reason
    # and a small first KL after warm-up steps is the updates' own: withdrawn as well
    small = {**warm, "kl": [(s, 0.005) for s in rows]}
    d = next(x for x in diagnose_metrics(small, {}) if x.check == "kl_at_start")
    assert not d.flagged


def test_a_zero_gradient_while_groups_differ_is_a_proof_that_outranks_truncation():
    n = 40
    m = {"grad_norm": steps([0.0] * n), "frac_reward_zero_std": steps([0.125] * n),
         "completions/clipped_ratio": steps([0.32] * n), "completions/mean_length": steps([304] * n),
         "completions/mean_terminated_length": steps([269] * n), "reward": steps([0.55] * n)}
    diag = diagnose_metrics(m, {})
    assert diag[0].check == "gradient_zero" and diag[0].severity >= 3
    # every group tied on those steps: the zero gradient is the ties' consequence, not a proof
    tied = diagnose_metrics({**m, "frac_reward_zero_std": steps([1.0] * n)}, {})
    g = next(d for d in tied if d.check == "gradient_zero")
    assert g.severity < 1 and g.role == "consequence"


def test_a_component_that_drifts_down_by_a_sliver_is_no_trade():
    n = 200
    total = steps([0.9 + 0.0005 * i for i in range(n)])  # +0.1 over the run
    sliver = steps([0.1 - 0.00001 * i for i in range(n)])  # -0.002: 2% of the total's gain
    trade = steps([0.5 - 0.0003 * i for i in range(n)])  # -0.06: 60% of it
    other = steps([0.4 + 0.0008 * i for i in range(n)])
    base = {"reward": total, "rewards/correct/mean": other}
    assert ("h05", "reward_rises_component_falls") not in checks({**base, "rewards/format/mean": sliver})
    assert ("h05", "reward_rises_component_falls") in checks({**base, "rewards/format/mean": trade})


def test_a_non_finite_gradient_norm_is_said():
    m = {"grad_norm": steps([0.5] * 10 + [float("nan")] + [0.5] * 10)}
    d = next(x for x in diagnose_metrics(m, {}) if x.check == "gradient_not_finite")
    assert d.role == "note" and "step 11" in d.verdict
    assert not any(x.check == "gradient_not_finite" for x in diagnose_metrics({"grad_norm": steps([0.5] * 21)}, {}))


def test_a_constant_non_zero_task_reward_is_not_saturated_and_harmless():
    """A correctness function at 0.5 for every completion is a task that no longer tells completions
    apart; a format function at 1.0 is the saturated kind (the name is all TRL's log says of a role)."""
    fmt = {"rewards/format_reward_func/mean": steps([0.1 + 0.002 * i for i in range(10)]),
           "rewards/format_reward_func/std": steps([0.05] * 10)}
    task = {"rewards/correctness_reward_func/mean": steps([0.5] * 10),
            "rewards/correctness_reward_func/std": steps([0.0] * 10)}
    d = [x for x in diagnose_metrics({**fmt, **task}, {}) if x.check == "reward_function_constant"]
    assert d[0].flagged and "correctness_reward_func" in d[0].verdict and "format_reward_func" in d[0].verdict
    swapped = {"rewards/strict_format_reward_func/mean": steps([0.5] * 10),
               "rewards/strict_format_reward_func/std": steps([0.0] * 10),
               "rewards/correctness_reward_func/mean": steps([0.3 + 0.01 * i for i in range(10)]),
               "rewards/correctness_reward_func/std": steps([0.4] * 10)}
    assert not any(x.flagged for x in diagnose_metrics(swapped, {}) if x.check == "reward_function_constant")
