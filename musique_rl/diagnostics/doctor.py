"""The doctor: reads a run's metrics and names the broken part.

    python -m musique_rl.diagnostics.doctor --run-dir outputs/2026-11-24/01-00-00   # a run dir (metrics.jsonl)
    python -m musique_rl.diagnostics.doctor --from out/checkpoint-500               # a TRL run's trainer_state.json
    python -m musique_rl.diagnostics.doctor --from wandb_export.csv history.jsonl  # tables; several: a triage table
    python -m musique_rl.diagnostics.doctor --from mlflow:<run id> --tracking-uri sqlite:///mlflow.db
    python -m musique_rl.diagnostics.doctor --run-id <id>          # one run of this project in MLflow
    python -m musique_rl.diagnostics.doctor --experiment h02       # every run of an experiment

Each rule is a fingerprint of a known defect (docs/failure_modes.md) in the h01..h08
metrics. A diagnosis is a ranked list of findings, each naming its hypothesis id, a verdict in
words, and the numbers behind it; flagged findings first, by severity:

  severity = tier + magnitude,  tier 3 = direct proof (a count that must be 0 is not, a sign that
  cannot be negative is), tier 2 = a quantitative fingerprint past a principled threshold, tier 1 =
  a symptom with other possible causes; magnitude in [0, 1) = how far past the threshold, in
  orders of magnitude / 3.

Thresholds are module constants with their reasons. A clean run must produce no flagged finding.
Rules over TRL's own metric names (for runs made with plain TRL) are in diagnostics/trl_rules.py;
the readers of each place logs live (run dir, trainer_state.json, MLflow, CSV/JSONL) in
diagnostics/sources.py. Every training run writes `diagnosis.json` into its run directory after
training, from its own metrics.jsonl (musique_rl.job.app), tracking on or off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from musique_rl import rundir

# Rules registered in their own modules (@rule): imported for their registration (trl_rules: over
# TRL's own metric names, which also serve another framework's logs).
from musique_rl.diagnostics import alarms, invariants, point_of_use, trl_rules  # noqa: F401
from musique_rl.diagnostics.findings import (
    RULES,
    Finding,
    History,
    judged,
    magnitude,
    num,
    rule,
    values,
)
from musique_rl.diagnostics.reward_power import (  # noqa: F401
    FLAT_MIN_POINTS,
    FLAT_P,
    NEXT_SWEEPS,
    flat_finding,
    reward_trend,
)

# ---------------------------------------------------------------- thresholds (and why)
# H01: TRL's epsilon 1e-4 caps std scaling at 1e4x; a larger factor means an epsilon below TRL's
# floor meets a std below any meaningful reward difference: float noise becomes full-size advantages.
AMPLIFICATION_MAX = 1e4
# H02/H06: mean |sampler - trainer| log-prob (nats/token), judged against the run's own floor
# (`h06/logp_gap_floor`, diagnostics/floor.py: two correct code paths / float32 vs the run's dtype,
# same weights, measured at the first probe). A gap is a defect past FLOOR_MULTIPLE x the floor: the
# floor is a mean over ~8 probe sequences and healthy step gaps scatter around it by a few times
# (measured: bf16 CPU step-0 gap 5.5e-5 vs paths floor 6.4e-6, dtype floor 1.9e-3), so one order of
# magnitude above it is no longer numerics.
FLOOR_MULTIPLE = 10.0
# ... but never below GAP_ABS_MIN: float32 floors reach ~2e-7, while healthy float32 step gaps
# reach ~3e-6 (batched left-padded generate vs a fresh forward, docs/failure_modes.md); 1e-4 is 30x
# that, and a per-token gap of 1e-4 moves the log importance ratio of a 1,000-token sequence by at
# most 0.1, inside TRL's clip range, so nothing below it can bias the loss.
GAP_ABS_MIN = 1e-4
# Runs without a measured floor (logs of plain TRL, older runs): at 0.01 a 100-token sequence's
# importance ratio reaches e^1 = 2.7, near TRL's 3.0 clip where the sequence correction starts
# masking whole sequences (docs/failure_modes.md defect 5).
LOGP_GAP_MAX = 0.01


def gap_threshold(m: Mapping[str, History]) -> tuple[float, str]:
    """(the largest healthy sampler/trainer gap for this run, the words that say where it comes from)."""
    floor = values(m.get("h06/logp_gap_floor"))
    if not floor:
        return LOGP_GAP_MAX, f"no measured floor in this run: fixed {LOGP_GAP_MAX:g}"
    f = floor[0]
    thr = max(FLOOR_MULTIPLE * f, GAP_ABS_MIN)
    why = (f"{FLOOR_MULTIPLE:g}x this stack's floor {f:.2g}" if thr > GAP_ABS_MIN
           else f"the absolute minimum {GAP_ABS_MIN:g} (this stack's floor {f:.2g} x {FLOOR_MULTIPLE:g} is below it)")
    return thr, why
# H06 vs H02: the sampling-settings fit (sync.sampling_fit) "explains" a step-0 gap when the best
# setting brings it below LOGP_GAP_MAX and to at most a fifth of the trainer's own gap: a change of
# temperature/top-p/top-k, not of context, made the sampler's distribution.
FIT_EXPLAINS_RATIO = 0.2
# H05: share of audited episodes whose re-scored reward differs from the one the trainer used.
# Any difference is a defect (the reward is a function of the text); 5% tolerates one odd episode
# per 20 audited (a decode that does not round-trip) without hiding a systematic defect.
REWARD_AUDIT_MAX = 0.05
# H04: share of tool results that differ from their source (same reasoning as the reward audit)
TOOL_ALTERED_MAX = 0.05
# H02: sampled assistant tokens left out of the loss; beyond a fifth, the loss ignores what was sampled
ASSISTANT_UNTRAINED_MAX = 0.2
# H03: share of KL-masked tokens with a negative penalty. k3 >= 0 for every token, so only a sign
# error makes it negative; half the tokens rules out round-off near zero.
KL_NEGATIVE_MAX = 0.5
# H04: a token budget that ends (or drops a tool result in) more than 1 episode in 10 is binding
BUDGET_SHARE_MAX = 0.1
# H05: an answer component constant in >= 95% of groups, mean below 0.05, while over half of the
# episodes end with an answer, is not reading the answers
CONSTANT_SHARE = 0.95
ANSWER_PRESENT_MIN = 0.5
DEAD_MEAN = 0.05
# H06: frozen weights must not change at all. The float64 checksum of an untouched tensor is exact (0
# on a sound run: the out-of-place LoRA sync, core/weight_sync.py, reads 0.0 after 1,000 bf16 syncs),
# and a relative squared-norm change d is a relative Frobenius change of ~sqrt(d): 1e-9 flags ~3e-5,
# where 1e-6 waited for ~1e-3 (TRL's in-place bf16 sync took 10 tiny-model steps to pass it).
CHECKSUM_DRIFT_MAX = 1e-9
# H07: more than half of the tool calls failing means the tool interface is broken for this policy
TOOL_FAILURE_MAX = 0.5
# H06: TRL's importance-sampling weight exp(trainer - sampler logp) of a sequence (its
# `sampling/importance_sampling_ratio/mean`, with train.importance_sampling or vLLM). Identical
# weights give 1; a mean below 0.1 means most of the batch's loss is weighted away: the gradient
# vanishes whatever the learning rate (docs/failure_modes.md defect 5).
IS_WEIGHT_MIN = 0.1
IS_WEIGHT_KEY = "sampling/importance_sampling_ratio/mean"
# H08: a healthy Adam step changes weights by ~1e-3 of their norm; 10x below that for most of the
# run is a policy that is not moving
UPDATE_RATIO_MIN = 1e-4
KL_TO_START_MIN = 1e-4


@rule
def _h01(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    amp = values(m.get("h01/amplification_max"))
    near = values(m.get("h01/near_zero_std_share"))
    if not amp and not near:
        return []
    ev = {
        "h01/amplification_max (max)": max(amp, default=0.0),
        "h01/near_zero_std_share (mean)": statistics.fmean(near) if near else 0.0,
        "h01/near_tie_adv_share (mean)": statistics.fmean(values(m.get("h01/near_tie_adv_share")) or [0.0]),
        "h01/adv_abs_max (max)": max(values(m.get("h01/adv_abs_max")) or [0.0]),
    }
    worst = max(amp, default=0.0)
    steps = sum(a > AMPLIFICATION_MAX for a in amp)
    if worst > AMPLIFICATION_MAX:
        return [Finding("h01", "std_amplification", True, 2 + magnitude(worst / AMPLIFICATION_MAX),
                        f"Std scaling multiplied reward differences by up to {worst:.3g}x (TRL's epsilon caps it at "
                        f"{AMPLIFICATION_MAX:.0e}) on {steps} of {len(amp)} steps: near-tied groups whose rewards differ "
                        "by float noise get full-size advantages, so the gradient follows noise. Raise the std "
                        "epsilon or stop scaling by the group std (loss.scale_rewards=none).", ev)]
    return [Finding("h01", "std_amplification", False, 0.0,
                    f"Advantage scaling within bounds (max amplification {worst:.3g}x); "
                    f"{ev['h01/near_zero_std_share (mean)']:.0%} of groups are near-ties on average.", ev)]


@rule
def _h02(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    env = values(m.get("h02/env_tokens_with_loss"))
    if env:
        share = statistics.fmean(values(m.get("h02/loss_share_tool")) or [0.0]) + statistics.fmean(
            values(m.get("h02/loss_share_template")) or [0.0])
        ev = {"h02/env_tokens_with_loss (max)": max(env), "h02/env_tokens_with_loss (mean)": statistics.fmean(env),
              "h02/loss_share_tool+template (mean)": share}
        if max(env) > 0:
            out.append(Finding("h02", "env_tokens_in_loss", True, 3 + magnitude(1 + max(env)),
                               f"The loss trains on tokens the environment wrote: up to {max(env):.0f} tool/template "
                               f"tokens per batch ({share:.0%} of loss tokens). Must be 0: tool results and chat "
                               "scaffolding need env_mask 0 (train.mask_env_tokens=true).", ev))
        else:
            out.append(Finding("h02", "env_tokens_in_loss", False, 0.0,
                               "No tool or template token carries loss.", ev))
    gap = m.get("h06/logp_gap_mean") or []
    cov = values(m.get("h02/attention_coverage"))
    thr, why = gap_threshold(m)
    if gap:
        step0 = gap[0][1]
        ev = {"h06/logp_gap_mean (first step)": step0, "first step": float(gap[0][0]), "gap threshold": thr}
        if values(m.get("h06/logp_gap_floor")):
            ev["h06/logp_gap_floor"] = values(m.get("h06/logp_gap_floor"))[0]
        if cov:
            ev["h02/attention_coverage (min)"] = min(cov)
        fit_t, fit_b = values(m.get("h06/fit_gap_trainer")), values(m.get("h06/fit_gap_best"))
        pre, post = values(m.get("h06/logp_gap_pre_tool")), values(m.get("h06/logp_gap_post_tool"))
        if pre:
            ev["h06/logp_gap_pre_tool (first)"] = pre[0]
        if post:
            ev["h06/logp_gap_post_tool (first)"] = post[0]
        explained = bool(fit_t and fit_b and fit_t[0] > thr and fit_b[0] <= thr
                         and fit_b[0] <= FIT_EXPLAINS_RATIO * fit_t[0] and not (cov and min(cov) < 1))
        if step0 > thr and explained:
            setting = {k: values(m.get(f"h06/fit_{k}"))[0] for k in ("temperature_factor", "top_p", "top_k")
                       if values(m.get(f"h06/fit_{k}"))}
            ev.update({"h06/fit_gap_trainer": fit_t[0], "h06/fit_gap_best": fit_b[0],
                       **{f"h06/fit_{k}": v for k, v in setting.items()}})
            out.append(Finding("h06", "sampling_settings_differ", True, 2 + magnitude(step0 / thr),
                               f"Before any update the sampler and the trainer disagree by {step0:.3g} nats/token "
                               f"(healthy up to {thr:.2g}: {why}), "
                               f"everywhere, and the trainer's own logits reproduce the sampler's log-probs to "
                               f"{fit_b[0]:.2g} under other sampling settings (temperature x"
                               f"{setting.get('temperature_factor', 1):g}, top_p {setting.get('top_p', 1):g}, top_k "
                               f"{setting.get('top_k', 0):g}): the sampler samples with different temperature/top-p/"
                               "top-k than the trainer scores with (set them explicitly on both).", ev))
        elif step0 > thr:
            extra = (f" The forward pass attends to only {min(cov):.0%} of the context." if cov and min(cov) < 1 else "")
            where = (f" The gap sits after the tool results ({post[0]:.3g} vs {pre[0]:.2g} before)."
                     if pre and post and pre[0] <= thr < post[0] else "")
            if fit_t and fit_b:
                where += f" No sampling setting explains it (best fit {fit_b[0]:.3g})."
            out.append(Finding("h02", "trainer_sampler_mismatch_at_start", True, 2 + magnitude(step0 / thr),
                               f"Before any update the trainer and the sampler disagree on the sampled tokens by "
                               f"{step0:.3g} nats/token (healthy up to {thr:.2g}: {why}): the trainer does not score "
                               "the context the sampler saw (attention mask = loss mask, template drift, or "
                               f"re-tokenised text).{extra}{where}", ev))
        else:
            out.append(Finding("h02", "trainer_sampler_mismatch_at_start", False, 0.0,
                               f"Trainer and sampler agree at the first step ({step0:.2g} nats/token; healthy up to "
                               f"{thr:.2g}: {why}).", ev))
    if cov and min(cov) < 1 and not (gap and gap[0][1] > thr):
        out.append(Finding("h02", "context_hidden_from_trainer", True, 3 + magnitude(1 / max(min(cov), 1e-3)),
                           f"The trainer's forward pass attends to only {min(cov):.0%} of the context tokens: prompt or "
                           "tool tokens are invisible when it scores the assistant's tokens.",
                           {"h02/attention_coverage (min)": min(cov)}))
    untrained = values(m.get("h02/assistant_tokens_without_loss_share"))
    if untrained and statistics.fmean(untrained) > ASSISTANT_UNTRAINED_MAX:
        u = statistics.fmean(untrained)
        out.append(Finding("h02", "sampled_tokens_untrained", True, 1 + magnitude(u / ASSISTANT_UNTRAINED_MAX),
                           f"{u:.0%} of the sampled assistant tokens are outside the loss mask: most of what the "
                           "policy wrote is not trained on.", {"h02/assistant_tokens_without_loss_share (mean)": u}))
    return out


@rule
def _h03(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    env = values(m.get("h03/kl_env_tokens"))
    neg = values(m.get("h03/kl_negative_share"))
    same = values(m.get("h02/kl_mask_equals_loss_mask"))
    if not env and not neg:
        return []
    ev = {"h03/kl_env_tokens (max)": max(env, default=0.0), "h03/kl_negative_share (mean)": statistics.fmean(neg or [0.0]),
          "h03/kl_model_mean (last)": (values(m.get("h03/kl_model_mean")) or [0.0])[-1]}
    if same:
        ev["h02/kl_mask_equals_loss_mask (min)"] = min(same)
    if env and max(env) > 0:
        out.append(Finding("h03", "kl_on_env_tokens", True, 3 + magnitude(1 + max(env)),
                           f"The KL penalty is computed on up to {max(env):.0f} tool/template tokens per micro-batch "
                           "(must be 0): the policy is pulled toward the reference on text it did not write "
                           "(Search-R1's negative-KL explosion).", ev))
    elif same and min(same) < 1:
        out.append(Finding("h03", "kl_mask_differs", True, 2.0,
                           "The KL term is masked differently from the policy loss.", ev))
    if neg and statistics.fmean(neg) > KL_NEGATIVE_MAX:
        s = statistics.fmean(neg)
        out.append(Finding("h03", "kl_sign", True, 3 + magnitude(s / KL_NEGATIVE_MAX),
                           f"{s:.0%} of the per-token KL penalties are negative; the k3 estimator is never negative, "
                           "so the penalty is applied with the wrong sign: it pushes the policy AWAY from the reference.",
                           ev))
    if not out:
        out.append(Finding("h03", "kl", False, 0.0, "KL confined to model tokens, with the right sign.", ev))
    return out


@rule
def _h04(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    keys = ["h04/budget_cap_share", "h04/dropped_tool_results_share", "h04/question_left_context_share",
            "h04/prompt_at_cap_share", "h04/no_answer_share"]
    means = {k: statistics.fmean(values(m.get(k))) for k in keys if values(m.get(k))}
    alt = values(m.get("h04/tool_results_altered_share"))
    if alt and statistics.fmean(alt) > TOOL_ALTERED_MAX:
        a = statistics.fmean(alt)
        ev = {"h04/tool_results_altered_share (mean)": a,
              "h04/tool_results_altered (sum)": sum(values(m.get("h04/tool_results_altered")))}
        return [Finding("h04", "tool_results_altered", True, 3 + magnitude(1 + 100 * a),
                        f"{a:.0%} of the tool results the model saw differ from their source documents (cut, "
                        "altered, or under another document's id) between the retriever and the prompt: the policy "
                        "reads a different environment from the one the reward assumes.", ev)]
    if not means:
        return []
    ev = {f"{k} (mean)": v for k, v in means.items()}
    if alt:
        ev["h04/tool_results_altered_share (mean)"] = statistics.fmean(alt)
    lost = means.get("h04/question_left_context_share", 0.0)
    if lost > 0:
        return [Finding("h04", "question_left_context", True, 3 + magnitude(1 + 100 * lost),
                        f"In {lost:.0%} of episodes the question itself was truncated out of the context.", ev)]
    worst_key = max((k for k in keys[:2] + keys[3:4] if k in means), key=lambda k: means[k], default=None)
    if worst_key is not None and means[worst_key] > BUDGET_SHARE_MAX:
        w = means[worst_key]
        what = {"h04/budget_cap_share": "end at a token budget",
                "h04/dropped_tool_results_share": "silently lose a tool result to the budget",
                "h04/prompt_at_cap_share": "start with the prompt at its token cap"}[worst_key]
        na = means.get("h04/no_answer_share")
        tail = f"; {na:.0%} end with no answer" if na is not None else ""
        return [Finding("h04", "budgets_binding", True, 2 + magnitude(w / BUDGET_SHARE_MAX),
                        f"Token budgets truncate the episodes: {w:.0%} of episodes {what}{tail}. The reward is capped by "
                        "the budget, not by the policy (raise env.max_tokens_per_turn / env.max_completion_tokens).",
                        ev)]
    return [Finding("h04", "budgets_binding", False, 0.0, "Token budgets rarely bind.", ev)]


@rule
def _h05(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    errs = values(m.get("h05/reward_errors"))
    if errs and max(errs) > 0:
        out.append(Finding("h05", "reward_errors", True, 3 + magnitude(1 + sum(errs)),
                           f"Reward functions raised {sum(errs):.0f} times (up to {max(errs):.0f} per batch): those "
                           "completions were not scored.", {"h05/reward_errors (sum)": sum(errs)}))
    audit = values(m.get("h05/reward_audit_mismatch_share"))
    if audit and statistics.fmean(audit) > REWARD_AUDIT_MAX:
        a = statistics.fmean(audit)
        out.append(Finding("h05", "reward_audit", True, 3 + magnitude(1 + 100 * a),
                           f"Reward audit: for {a:.0%} of the audited episodes the reward the trainer used is not the "
                           f"reward of that episode's own text re-scored independently (largest difference "
                           f"{max(values(m.get('h05/reward_audit_abs_diff_max')) or [0.0]):.3g}): rewards are attached to "
                           "the wrong sample, read from the wrong turn, or cached.",
                           {"h05/reward_audit_mismatch_share (mean)": a,
                            "h05/reward_audit_mismatch (sum)": sum(values(m.get("h05/reward_audit_mismatch"))),
                            "h05/reward_audit_checked (sum)": sum(values(m.get("h05/reward_audit_checked")))}))
    answered = 1 - statistics.fmean(values(m.get("h04/no_answer_share")) or [1.0])
    # Every answer component present must be dead: an answering policy that is always wrong still
    # earns partial F1 now and then, a reward that never reads the answer earns none.
    dead, live = [], 0
    for comp in ("answer_em", "answer_f1"):
        const = values(m.get(f"h05/{comp}/constant_group_share"))
        mean = values(m.get(f"h05/{comp}/mean"))
        weight = num(params, f"reward.weights.{comp}", 1.0)
        if not const or not mean or weight == 0:
            continue
        if statistics.fmean(const) >= CONSTANT_SHARE and max(mean) < DEAD_MEAN:
            dead.append((comp, statistics.fmean(const), max(mean)))
        else:
            live += 1
    if dead and not live and answered >= ANSWER_PRESENT_MIN:
        ev = {f"h05/{c}/constant_group_share (mean)": s for c, s, _ in dead}
        ev.update({f"h05/{c}/mean (max)": v for c, _, v in dead})
        ev["answered share (1 - h04/no_answer_share)"] = answered
        names = ", ".join(c for c, _, _ in dead)
        out.append(Finding("h05", "answer_reward_blind", True, 2 + magnitude(answered / ANSWER_PRESENT_MIN * 10),
                           f"{answered:.0%} of episodes end with an answer, yet {names} is ~0 and constant in "
                           f"{min(s for _, s, _ in dead):.0%} of groups: the reward does not read the final answer "
                           "(wrong turn parsed, or brittle parsing).", ev))
    if not out:
        comps = sorted({k.split("/")[1] for k in m if k.startswith("h05/") and k.endswith("/corr_total")})
        ev = {f"h05/{c}/corr_total (mean)": statistics.fmean(values(m[f"h05/{c}/corr_total"])) for c in comps}
        if audit:
            ev["h05/reward_audit_mismatch_share (mean)"] = statistics.fmean(audit)
        if comps or errs or audit:
            out.append(Finding("h05", "reward_signal", False, 0.0,
                               "Every weighted answer component varies; no reward errors"
                               + ("; audited rewards match their episodes." if audit else "."), ev))
    return out


@rule
def _h06(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    stale = values(m.get("h06/parity_stale"))
    ev_p = {k + " (last)": values(m.get(k))[-1] for k in
            ("h06/parity_sampler_trainer", "h06/parity_sampler_base", "h06/parity_trainer_base") if values(m.get(k))}
    if stale and max(stale) > 0:
        out.append(Finding("h06", "sampler_serves_base", True, 3 + magnitude(1 + 10 * statistics.fmean(stale)),
                           f"Parity probe: sampler matches base, not trainer (in {sum(s > 0 for s in stale)} of "
                           f"{len(stale)} probes). Rollouts come from stale weights, so updates never reach the "
                           "episodes the policy learns from: fix the weight sync.", ev_p))
    gap = m.get("h06/logp_gap_mean") or []
    thr, why = gap_threshold(m)
    if len(gap) >= 4 and gap[0][1] <= thr:
        tail = [v for _, v in gap[-max(2, len(gap) // 4):]]
        late = statistics.fmean(tail)
        if late > thr:
            ev = {"h06/logp_gap_mean (first)": gap[0][1], "h06/logp_gap_mean (last quarter)": late,
                  "gap threshold": thr, **ev_p}
            out.append(Finding("h06", "gap_grows", True, 2 + magnitude(late / thr),
                               f"The sampler/trainer log-prob gap grows from {gap[0][1]:.2g} at the first step to "
                               f"{late:.3g} nats/token (healthy up to {thr:.2g}: {why}): the sampler lags the trainer "
                               "(weights not synced).", ev))
    drift = values(m.get("h06/base_checksum_drift"))
    if drift and max(drift) > CHECKSUM_DRIFT_MAX:
        out.append(Finding("h06", "base_drift", True, 3 + magnitude(max(drift) / CHECKSUM_DRIFT_MAX),
                           f"The frozen base weights changed (relative drift {max(drift):.3g}); merge/unmerge round "
                           "trips corrupt the base (TRL #6688).", {"h06/base_checksum_drift (max)": max(drift)}))
    bnorm = values(m.get("h06/lora_b_norm"))
    if len(bnorm) >= 2 and max(bnorm) == 0:
        out.append(Finding("h06", "lora_untrained", True, 3.0,
                           f"LoRA B matrices are still exactly 0 after {len(bnorm)} steps: the adapter never trains.",
                           {"h06/lora_b_norm (max)": 0.0}))
    weights = values(m.get(IS_WEIGHT_KEY))
    if weights and statistics.median(weights) < IS_WEIGHT_MIN:
        w = statistics.median(weights)
        out.append(Finding("h06", "importance_weights_vanish", True, 2 + magnitude(IS_WEIGHT_MIN / max(w, 1e-30)),
                           f"TRL's importance-sampling correction weights the sequences by {w:.2g} (median of the "
                           "steps' means; 1 when trainer and sampler agree): the loss is weighted away, so no "
                           "learning rate, rank or KL setting can move the policy. The trainer's log-probs are "
                           "far below the sampler's.", {IS_WEIGHT_KEY + " (median)": w}))
    if not out and (gap or stale or drift or bnorm or weights):
        ev = dict(ev_p)
        if gap:
            ev["h06/logp_gap_mean (max)"] = max(v for _, v in gap)
        out.append(Finding("h06", "sync", False, 0.0, "Sampler tracks the trainer.", ev))
    return out


@rule("h06/is_masked_seq_share")
def _h06_importance_sampling_masks(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """TRL's importance-sampling correction giving whole sequences zero weight (h06/is_* from
    core/importance.py). Threshold: a median of 20% of a step's sequences masked. Why 20%: with
    sequence_mask (clip 3) ordinary bf16 noise between sampler and trainer masks 25-39% of sequences
    of 1,024-8,192 loss tokens (benchmarks/bench_importance_sampling.py), so a share above this is
    the correction, not a rare off-policy sample, deciding which episodes train: the long ones drop
    out and the reward can stay flat while every other instrument looks sane. token_truncate, the
    vLLM default (train.importance_sampling=auto), masks none."""
    limit = 0.2
    masked = statistics.median(values(m.get("h06/is_masked_seq_share")))
    ev = {"h06/is_masked_seq_share (median)": masked}
    for key in ("h06/is_masked_token_share", "h06/is_ess"):
        if values(m.get(key)):
            ev[f"{key} (median)"] = statistics.median(values(m.get(key)))
    mode = params.get("train.importance_sampling", "the configured mode")
    ess = f", effective sample size {ev['h06/is_ess (median)']:.2f}" if "h06/is_ess (median)" in ev else ""
    return judged("h06", "importance_sampling_masks_sequences", masked > limit, 1.5 + magnitude(masked / limit), ev,
                  f"TRL's importance-sampling correction ({mode}) gives {masked:.0%} of each step's sequences zero "
                  f"weight (median; threshold {limit:.0%}){ess}: those episodes, the long ones first, never train. "
                  "Per-sequence ratios multiply thousands of per-token ratios, so bf16 noise alone crosses the "
                  "clip; use train.importance_sampling=token_truncate (the vLLM default) or fix the mismatch.",
                  f"The importance-sampling correction masks {masked:.0%} of sequences.")


@rule("h07/tool_failure_rate")
def _h07(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    fail = values(m.get("h07/tool_failure_rate"))
    ev = {"h07/tool_failure_rate (mean)": statistics.fmean(fail),
          "h07/tool_calls_mean (mean)": statistics.fmean(values(m.get("h07/tool_calls_mean")) or [0.0]),
          "h07/turns_mean (mean)": statistics.fmean(values(m.get("h07/turns_mean")) or [0.0])}
    f = statistics.fmean(fail)
    return judged("h07", "tool_failures", f > TOOL_FAILURE_MAX, 1 + magnitude(f / TOOL_FAILURE_MAX), ev,
                   f"{f:.0%} of tool calls fail: the multi-turn machinery, not the policy's choices, decides the episodes.",
                   f"Tool calls mostly succeed ({f:.0%} fail).")


@rule("h08/update_weight_ratio")
def _h08(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    med = statistics.median(values(m.get("h08/update_weight_ratio")))
    kl = values(m.get("h08/kl_to_start"))
    # the Trainer's own `grad_norm` is the pre-clip norm (clip_grad_norm_'s return value)
    pre = values(m.get("h08/grad_norm_before_clip")) or values(m.get("grad_norm"))
    post = values(m.get("h08/grad_norm_after_clip"))
    ev = {"h08/update_weight_ratio (median)": med}
    if kl:
        ev["h08/kl_to_start (last)"] = kl[-1]
    if pre and post:
        ev["grad clip factor (median before/after)"] = statistics.median(pre) / max(statistics.median(post), 1e-30)
    klw = f"; KL to the starting policy is {kl[-1]:.2g}" if kl else ""
    clip = ev.get("grad clip factor (median before/after)")
    clipw = f"; clipping shrinks gradients {clip:.3g}x" if clip and clip > 2 else ""
    stuck = med < UPDATE_RATIO_MIN and (not kl or kl[-1] < KL_TO_START_MIN or med < UPDATE_RATIO_MIN / 10)
    return judged("h08", "updates_too_small", stuck, 2 + magnitude(UPDATE_RATIO_MIN / max(med, 1e-30)), ev,
                   f"Each step changes the weights by {med:.2g} of their norm (healthy ~1e-3){klw}{clipw}: the "
                   "policy is not moving. Raise the learning rate or max_grad_norm.",
                   f"Weights move {med:.2g} of their norm per step.")


@rule("preflight/signal_share_forecast")
def _preflight(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    sig = values(m.get("preflight/signal_share_forecast"))
    from musique_rl.diagnostics.preflight import MIN_SIGNAL_SHARE

    ev = {k: values(m.get(k))[0] for k in ("preflight/pass_rate_mean", "preflight/zero_variance_forecast",
                                           "preflight/signal_share_forecast") if values(m.get(k))}
    s = sig[0]
    # The forecast is about answer correctness; a partial-credit reward can still spread inside a
    # group. Flag only when the reward actually trained on confirms it: few signal-carrying groups
    # over the first steps too.
    actual = values(m.get("h01/signal_group_share"))[:5]
    if actual:
        ev["h01/signal_group_share (first steps)"] = statistics.fmean(actual)
    if s < MIN_SIGNAL_SHARE and (not actual or statistics.fmean(actual) < MIN_SIGNAL_SHARE):
        return [Finding("preflight", "learnability", True, 1 + magnitude(MIN_SIGNAL_SHARE / max(s, 1e-3)) / 2,
                        f"Pre-flight: only {s:.0%} of groups are forecast to carry learning signal at this group size "
                        f"(initial pass rate {ev.get('preflight/pass_rate_mean', float('nan')):.2f}).", ev)]
    if s < MIN_SIGNAL_SHARE:
        return [Finding("preflight", "learnability", False, 0.0,
                        f"Pre-flight: only {s:.0%} of groups forecast to carry answer signal, but the reward spreads "
                        f"in {ev['h01/signal_group_share (first steps)']:.0%} of groups (partial credit).", ev)]
    return [Finding("preflight", "learnability", False, 0.0,
                    f"Pre-flight: {s:.0%} of groups forecast to carry signal.", ev)]


HYPOTHESES = ("h01", "h02", "h03", "h04", "h05", "h06", "h07", "h08")


# A trainer/sampler mismatch at the start (the root) and, downstream of it through the
# importance-sampling weights, a policy that does not move (the consequences).
MISMATCH_CHECKS = ("trainer_sampler_mismatch_at_start", "context_hidden_from_trainer", "sampling_settings_differ")
STILLNESS_CHECKS = ("importance_weights_vanish", "updates_too_small", "lora_untrained")


def _consequences(findings: list[Finding]) -> None:
    """Rank a root cause above what it causes. When the importance-sampling weights vanish and the
    trainer disagreed with the sampler from the first step, the stillness findings (weights
    weighted away, updates too small, LoRA B still 0) are that mismatch's consequence, not a second
    defect: raising the learning rate would not help. They stay flagged, ranked below the mismatch,
    and say so."""
    roots = [f for f in findings if f.flagged and f.check in MISMATCH_CHECKS]
    if not roots or not any(f.flagged and f.check == "importance_weights_vanish" for f in findings):
        return
    root = max(roots, key=lambda f: f.severity)
    for i, f in enumerate(findings):
        if f.flagged and f.check in STILLNESS_CHECKS:
            findings[i] = Finding(f.hypothesis, f.check, True, min(f.severity, root.severity - 0.5),
                                  f"{f.verdict} A consequence of {root.hypothesis} {root.check}: the importance "
                                  "weights of mismatched sequences are ~0.", f.evidence)


def diagnose_metrics(metrics: Mapping[str, History], params: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Ranked diagnosis from metric histories {key: [(step, value), ...]} and the run's params."""
    params = params or {}
    findings: list[Finding] = []
    for check in RULES:
        findings.extend(check(metrics, params))
    _consequences(findings)
    findings.extend(flat_finding(findings, metrics))
    seen = {f.hypothesis for f in findings}
    for h in HYPOTHESES:
        if h not in seen:
            findings.append(Finding(h, "no_data", False, 0.0, "No data for this hypothesis in this log: "
                                    + trl_rules.CANNOT_TELL.get(h, "no instrument measured it") + "."))
    findings.sort(key=lambda f: (not f.flagged, -f.severity, f.check == "no_data", f.hypothesis))
    out = []
    for rank, f in enumerate(findings, start=1):
        d = asdict(f)
        d["rank"] = rank
        d["severity"] = round(f.severity, 3)
        d["evidence"] = {k: (float(v) if v is not None else None) for k, v in f.evidence.items()}
        out.append(d)
    return out


# ---------------------------------------------------------------- MLflow I/O
_PREFIXES = ("h0", "preflight/")
_ALSO = ("grad_norm", "reward", "reward_std", "entropy", "kl", "learning_rate", IS_WEIGHT_KEY, *trl_rules.TRL_KEYS)  # TRL / Trainer metrics rules read


def read_run_metrics(run_id: str, uri: str | None = None) -> tuple[dict[str, History], dict[str, str], Any]:
    """Histories of the instrument metrics, the params and the run object."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    hist: dict[str, History] = {}
    for key in run.data.metrics:
        if key.startswith(_PREFIXES + trl_rules.TRL_PREFIXES) or key in _ALSO:
            pts = client.get_metric_history(run_id, key)
            hist[key] = sorted(((p.step, p.value) for p in pts), key=lambda sv: sv[0])
    return hist, dict(run.data.params), run


def diagnose_run(run_id: str, uri: str | None = None) -> list[dict[str, Any]]:
    """The ranked diagnosis of one MLflow run (see module docstring)."""
    hist, params, _ = read_run_metrics(run_id, uri)
    return diagnose_metrics(hist, params)


def write_diagnosis(run_id: str, diagnosis: list[dict[str, Any]], uri: str | None = None) -> None:
    """Save `diagnosis.json` as an artifact of the run and tag the run with its top flagged hypothesis."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.log_text(run_id, json.dumps(diagnosis, indent=2), rundir.DIAGNOSIS)
    for key, value in diagnosis_tags(diagnosis).items():
        client.set_tag(run_id, key, value)


def diagnosis_tags(diagnosis: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The run tags a diagnosis sets: `diagnosis` (the top flagged hypothesis, or clean) and
    `diagnosis_flagged` (every flagged hypothesis, in rank order, or none)."""
    flagged = [d for d in diagnosis if d["flagged"]]
    return {"diagnosis": flagged[0]["hypothesis"] if flagged else "clean",
            "diagnosis_flagged": ",".join(dict.fromkeys(d["hypothesis"] for d in flagged)) or "none"}


def top_flagged(diagnosis: Sequence[Mapping[str, Any]]) -> str:
    """The hypothesis id of the top flagged finding, or 'clean'."""
    return next((d["hypothesis"] for d in diagnosis if d["flagged"]), "clean")


def format_diagnosis(diagnosis: Sequence[Mapping[str, Any]], show_ok: bool = True,
                     verbose_missing: bool = False) -> str:
    lines = []
    for d in diagnosis:
        if d["check"] == "no_data" or (not show_ok and not d["flagged"]):
            continue
        mark = "FLAGGED" if d["flagged"] else "ok     "
        lines.append(f"{d['rank']:>2}. {d['hypothesis']:<9} {mark} [{d['severity']:.2f}] {d['verdict']}")
        if d["evidence"]:
            ev = ", ".join(f"{k}={v:.4g}" for k, v in d["evidence"].items() if v is not None)
            lines.append(f"    evidence: {ev}")
    missing = [d["hypothesis"] for d in diagnosis if d["check"] == "no_data"]
    if missing:
        lines.append(f"    no instrument data: {', '.join(missing)}")
        if verbose_missing:
            lines.extend(f"      {d['hypothesis']}: {d['verdict'].split(': ', 1)[-1]}" for d in diagnosis
                         if d["check"] == "no_data")
    if not any(d["flagged"] for d in diagnosis):
        lines.insert(0, "No flagged finding: every instrument is within its bounds.")
    return "\n".join(lines)


def diagnose_log(run: Any) -> list[dict[str, Any]]:
    """The ranked diagnosis of a ``sources.RunLog`` (any place a run's logs live)."""
    return diagnose_metrics(run.histories, run.params)


def save_diagnosis(diagnosis: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``diagnosis.json`` at ``path`` (written whole, then moved into place: a reader never sees half)."""
    return rundir.write_diagnosis(path, list(diagnosis))


def top_finding(diagnosis: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((d for d in diagnosis if d["flagged"]), None)


def triage_table(rows: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], width: int = 110) -> str:
    """One line per run: run, top finding (hypothesis/check or 'clean'), its evidence; then the other
    flagged checks. How a user triages many runs at once."""
    w = max([24, *(len(n) for n, _ in rows)])
    out = [f"{'run':<{w}} {'top finding':<40} evidence", "-" * width]
    for name, diag in rows:
        top = top_finding(diag)
        if top is None:
            unseen = " ".join(d["hypothesis"] for d in diag if d["check"] == "no_data")
            out.append(f"{name:<{w}} {'clean':<40} no flagged finding"
                       + (f"; not in this log: {unseen}" if unseen else ""))
            continue
        ev = ", ".join(f"{k}={v:.3g}" for k, v in list(top["evidence"].items())[:3] if v is not None)
        out.append(f"{name:<{w}} {top['hypothesis'] + ' ' + top['check']:<40} {ev}")
        also = [f"{d['hypothesis']} {d['check']}" for d in diag if d["flagged"] and d is not top]
        if also:
            out.append(f"{'':<{w}} also: {'; '.join(also)}")
    return "\n".join(out)


def _default_uri(arg: str | None) -> str:
    # The default of tracking.tracking_uri() outside a Hydra job, spelled here so that the doctor
    # (diagnostics layer) does not import the experiment layer that runs it.
    return arg or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def _from_files(args: argparse.Namespace) -> int:
    """--from / --run-dir: read each input, diagnose, write diagnosis.json; several: a triage table."""
    from musique_rl.diagnostics.sources import SourceError, open_source, read_run_dir

    specs = [("run-dir", d) for d in args.run_dir or []] + [("from", f) for f in args.sources or []]
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    rows, results, bad = [], {}, 0
    for kind, spec in specs:
        try:
            run = read_run_dir(spec) if kind == "run-dir" else open_source(spec, uri)
        except (SourceError, OSError) as e:
            print(f"doctor: cannot read --{kind} {spec}: {e}", file=sys.stderr)
            bad += 1
            continue
        diag = diagnose_log(run)
        name = run.name if run.name not in results else f"{run.name} [{spec}]"
        results[name] = diag
        rows.append((name, diag))
        if not args.no_write:
            home = Path(args.out) if args.out else (run.home or Path.cwd())
            if args.out and len(specs) > 1:
                home = home / re.sub(r"[^\w.-]+", "_", name).strip("_")
            dest = home / (rundir.DIAGNOSIS if run.home is not None or args.out else f"diagnosis-{run.name}.json")
            try:
                save_diagnosis(diag, dest)
            except OSError as e:
                print(f"doctor: cannot write {dest}: {e} (use --out DIR)", file=sys.stderr)
                dest = None
        else:
            dest = None
        if not args.json:
            print(f"== {name} ({run.source}): top = {top_flagged(diag)}")
            for note in run.notes:
                print(f"   note: {note}")
            print(format_diagnosis(diag, verbose_missing=True))
            if dest is not None:
                print(f"   written: {dest}")
            print()
    if args.json:
        print(json.dumps(results if len(specs) > 1 else next(iter(results.values()), []), indent=2))
    elif len(rows) > 1:
        print(triage_table(rows))
    return 2 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musique_rl.diagnostics.doctor", description=__doc__.split("\n")[0])
    g = p.add_argument_group("what to diagnose (one or more)")
    g.add_argument("--from", dest="sources", nargs="+", metavar="PATH_OR_RUN",
                   help="a run directory, trainer_state.json (or a checkpoint / output dir), a CSV or JSONL "
                        "metrics table, or mlflow:<run id> / runs:/<run id>; several give a triage table")
    g.add_argument("--run-dir", nargs="+", metavar="DIR", help="a run directory of this project (its metrics.jsonl)")
    g.add_argument("--run-id", help="diagnose one MLflow run of this project")
    g.add_argument("--experiment", help="diagnose every finished or failed run of an MLflow experiment (name)")
    p.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    p.add_argument("--out", default=None, help="--from/--run-dir: write diagnosis.json here (a directory) "
                                               "instead of beside each input")
    p.add_argument("--no-write", action="store_true", help="--from/--run-dir: print only")
    p.add_argument("--write", action="store_true", help="--run-id/--experiment: also save diagnosis.json to each run")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    args = p.parse_args(argv)
    chosen = [bool(args.sources or args.run_dir), bool(args.run_id), bool(args.experiment)]
    if sum(chosen) != 1:
        p.error("give --from/--run-dir, or --run-id, or --experiment")
    if args.sources or args.run_dir:
        return _from_files(args)

    from mlflow.tracking import MlflowClient

    uri = _default_uri(args.tracking_uri)
    client = MlflowClient(uri)
    if args.run_id:
        runs = [client.get_run(args.run_id)]
    else:
        exp = client.get_experiment_by_name(args.experiment)
        if exp is None:
            print(f"no experiment named {args.experiment!r} in {uri}", file=sys.stderr)
            return 2
        runs = [r for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
                if r.data.tags.get("sweep_parent") != "true"]
    results = {}
    for run in runs:
        diag = diagnose_run(run.info.run_id, uri)
        results[run.info.run_id] = diag
        if args.write:
            write_diagnosis(run.info.run_id, diag, uri)
        if not args.json:
            name = run.data.tags.get("mlflow.runName", "")
            print(f"== run {run.info.run_id} ({name}, {run.info.status}): top = {top_flagged(diag)}")
            print(format_diagnosis(diag))
            print()
    if args.experiment and not args.json:
        counts: dict[str, int] = {}
        for diag in results.values():
            for h in dict.fromkeys(d["hypothesis"] for d in diag if d["flagged"]):
                counts[h] = counts.get(h, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        print(f"experiment {args.experiment}: {len(results)} runs; flagged: "
              + (", ".join(f"{h} in {n}" for h, n in ranked) or "none"))
    if args.json:
        print(json.dumps(results if args.experiment else next(iter(results.values())), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
