"""Stage "sampling": sampling settings, stop rules, and the weights the sampler samples with (h06;
h02's agreement of trainer and sampler before any update)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    H02_ATTENTION_COVERAGE,
    H06_FIT_GAP_BEST,
    H06_FIT_GAP_TRAINER,
    H06_FIT_TEMPERATURE_FACTOR,
    H06_FIT_TOP_K,
    H06_FIT_TOP_P,
    H06_IDENTICAL_GROUP_EXPECTED_SHARE,
    H06_IDENTICAL_GROUP_SHARE,
    H06_LOGP_GAP_FLOOR,
    H06_LOGP_GAP_MEAN,
    H06_LOGP_GAP_SIDE_TOOL,
    H06_PARITY_SAMPLER_BASE,
    H06_PARITY_SAMPLER_TRAINER,
    H06_PARITY_STALE,
    H06_PARITY_TRAINER_BASE,
    H06_SAMPLE_OUTSIDE_SHARE,
    H06_SAMPLE_SURPRISE_EXCESS,
    H06_SAMPLE_SURPRISE_Z,
    H06_SAMPLE_TOKENS,
    PARITY_STALE_MAX,
    TRL_SAMPLING_LOGP_DIFFERENCE,
)
from musique_rl.doctor.context import gap_threshold, late_gap_threshold
from musique_rl.doctor.evidence import CATEGORICAL_SLACK, Measure
from musique_rl.doctor.findings import Finding, History, judged, magnitude, rule, stage_sentence, values
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trl_rules import OURS, TREND_MIN_POINTS, _ours

# H06 vs H02: the sampling-settings fit (sync.sampling_fit) "explains" a step-0 gap when the best
# setting brings it below the gap threshold and to at most a fifth of the trainer's own gap: a change
# of temperature/top-p/top-k, not of context, made the sampler's distribution.
FIT_EXPLAINS_RATIO = 0.2
GAP = H06_LOGP_GAP_MEAN
FLOOR = H06_LOGP_GAP_FLOOR
COVERAGE = H02_ATTENTION_COVERAGE
PARITY = (H06_PARITY_SAMPLER_TRAINER, H06_PARITY_SAMPLER_BASE, H06_PARITY_TRAINER_BASE)
# the sampling settings the fit (sync.sampling_fit) reports, by the name its verdict gives them
FITTED_SETTINGS = {"temperature_factor": H06_FIT_TEMPERATURE_FACTOR, "top_p": H06_FIT_TOP_P, "top_k": H06_FIT_TOP_K}


@rule(stage="sampling", checks={"sampling_settings_differ": Kind.DEFECT, "trainer_sampler_mismatch_at_start": Kind.DEFECT},
      reads=(GAP, COVERAGE, FLOOR, H06_FIT_GAP_TRAINER, H06_FIT_GAP_BEST, H06_LOGP_GAP_SIDE_TOOL,
             *FITTED_SETTINGS.values(), *gap_threshold.reads),
      needs=(GAP,), thresholds=("FIT_EXPLAINS_RATIO",))
def _agreement_at_start(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Before any update the sampler and the trainer hold the same weights: any gap past the run's
    floor is a different computation (settings, context), not drift."""
    gap = m.get(GAP) or []
    cov = values(m.get(COVERAGE))
    thr, why = gap_threshold(m, params)
    step0 = gap[0][1]
    ev = {f"{H06_LOGP_GAP_MEAN} (first step)": step0, "first step": float(gap[0][0]), "gap threshold": thr}
    if values(m.get(FLOOR)):
        ev[FLOOR] = values(m.get(FLOOR))[0]
    if cov:
        ev[f"{H02_ATTENTION_COVERAGE} (min)"] = min(cov)
    fit_t, fit_b = values(m.get(H06_FIT_GAP_TRAINER)), values(m.get(H06_FIT_GAP_BEST))
    pre_key, post_key = H06_LOGP_GAP_SIDE_TOOL.of(side="pre"), H06_LOGP_GAP_SIDE_TOOL.of(side="post")
    pre, post = values(m.get(pre_key)), values(m.get(post_key))
    if pre:
        ev[f"{pre_key} (first)"] = pre[0]
    if post:
        ev[f"{post_key} (first)"] = post[0]
    # before any update sampler and trainer hold the same weights: past the measured floor is exact
    measure = Measure(f"{H06_LOGP_GAP_MEAN} (first step)", step0, thr, exact=True, log=True)
    explained = bool(fit_t and fit_b and fit_t[0] > thr and fit_b[0] <= thr
                     and fit_b[0] <= FIT_EXPLAINS_RATIO * fit_t[0] and not (cov and min(cov) < 1))
    if step0 > thr and explained:
        fitted = {k: v for k, v in FITTED_SETTINGS.items() if values(m.get(v))}
        setting = {k: values(m.get(v))[0] for k, v in fitted.items()}
        ev.update({H06_FIT_GAP_TRAINER: fit_t[0], H06_FIT_GAP_BEST: fit_b[0],
                   **{fitted[k]: v for k, v in setting.items()}})
        return [Finding("h06", "sampling_settings_differ", True, 2 + magnitude(step0 / thr),
                        f"Before any update the sampler and the trainer disagree by {step0:.3g} nats/token "
                        f"(healthy up to {thr:.2g}: {why}), "
                        f"everywhere, and the trainer's own logits reproduce the sampler's log-probs to "
                        f"{fit_b[0]:.2g} under other sampling settings (temperature x"
                        f"{setting.get('temperature_factor', 1):g}, top_p {setting.get('top_p', 1):g}, top_k "
                        f"{setting.get('top_k', 0):g}): the sampler samples with different temperature/top-p/"
                        "top-k than the trainer scores with (set them explicitly on both).", ev, measure=measure)]
    if step0 > thr and fit_t and fit_t[0] <= thr:
        # a plain forward pass of the trainer's weights reproduces the sampler: the loss stage's
        # trainer_logps_differ_from_forward names the part that differs
        return [Finding("h02", "trainer_sampler_mismatch_at_start", False, 0.0,
                        f"Before any update the trainer and the sampler disagree by {step0:.3g} nats/token (healthy "
                        f"up to {thr:.2g}: {why}), but a plain forward pass of the trainer's weights reproduces the "
                        f"sampler's log-probs to {fit_t[0]:.2g}: the sampler is right; the difference is in the "
                        "trainer's scoring (loss stage, trainer_logps_differ_from_forward).", ev, measure=measure)]
    if step0 > thr:
        extra = (f" The forward pass attends to only {min(cov):.0%} of the context." if cov and min(cov) < 1 else "")
        where = (f" The gap sits after the tool results ({post[0]:.3g} vs {pre[0]:.2g} before)."
                 if pre and post and pre[0] <= thr < post[0] else "")
        if fit_t and fit_b:
            where += f" No sampling setting explains it (best fit {fit_b[0]:.3g})."
        return [Finding("h02", "trainer_sampler_mismatch_at_start", True, 2 + magnitude(step0 / thr),
                        f"Before any update the trainer and the sampler disagree on the sampled tokens by "
                        f"{step0:.3g} nats/token (healthy up to {thr:.2g}: {why}): the trainer does not score "
                        "the context the sampler saw (attention mask = loss mask, template drift, or "
                        f"re-tokenised text).{extra}{where}", ev, measure=measure)]
    return [Finding("h02", "trainer_sampler_mismatch_at_start", False, 0.0,
                    f"Trainer and sampler agree at the first step ({step0:.2g} nats/token; healthy up to "
                    f"{thr:.2g}: {why}).", ev, measure=measure)]


# sync: the parity gap says the sampler holds other weights than the trainer, not which mechanism put
# them there (a sync one step late, one that skips tensors, the frozen start): a fingerprint that
# sampler_serves_base, when it also holds, explains
@rule(stage="sampling", checks={"sampler_serves_base": Kind.DEFECT, "gap_grows": Kind.SYMPTOM, "sync": Kind.SYMPTOM},
      reads=(H06_PARITY_STALE, GAP, *PARITY, *gap_threshold.reads, *late_gap_threshold.reads),
      needs=(H06_PARITY_STALE, GAP, H06_PARITY_SAMPLER_TRAINER), thresholds=("PARITY_STALE_MAX",))
def _weight_sync(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Does the sampler sample with the trainer's weights? Measured three ways: the parity probe (fixed
    sequences scored through the sampler's own generation path and by the trainer, after each sync:
    equal on one set of weights, a stale or partial sync shows as a gap), whether the sampler matches
    the frozen start instead (parity_stale), and the per-step gap on the sampled tokens, which grows
    when the sampler falls behind."""
    out: list[Finding] = []
    stale = values(m.get(H06_PARITY_STALE))
    ev_p = {k + " (last)": values(m.get(k))[-1] for k in PARITY if values(m.get(k))}
    if stale:
        share = sum(s > PARITY_STALE_MAX for s in stale) / len(stale)
        if share > 0:
            out.append(Finding("h06", "sampler_serves_base", True, 3 + magnitude(1 + 10 * statistics.fmean(stale)),
                               f"Parity probe: sampler matches base, not trainer (in {sum(s > PARITY_STALE_MAX for s in stale)} "
                               f"of {len(stale)} probes). Rollouts come from stale weights, so updates never reach the "
                               "episodes the policy learns from: fix the weight sync.", ev_p,
                               measure=Measure(f"{H06_PARITY_STALE} (share of probes)", share, 0.0, exact=True,
                                               share=True)))
    late_thr, late_why = late_gap_threshold(m, params)
    # the probes after the first update: the sampler's weights against the trainer's, measured
    par = [(s, v) for s, v in (m.get(H06_PARITY_SAMPLER_TRAINER) or []) if v is not None and math.isfinite(v)]
    first_step = min((s for h in m.values() for s, _ in h), default=0)
    later = [v for s, v in par if s > first_step]
    if later:
        med = statistics.median(later)
        ev = {f"{H06_PARITY_SAMPLER_TRAINER} (median after the first step)": med,
              "probes after the first step": float(len(later)), "gap threshold (late)": late_thr, **ev_p}
        out += judged("h06", "sync", med > late_thr, 3.0, ev,
                      f"Parity probe: after the updates the sampler's log-probs of fixed sequences differ from the "
                      f"trainer's by {med:.3g} nats/token (median of {len(later)} probes; healthy up to "
                      f"{late_thr:.2g}: {late_why}): the sampler generates with other weights than the trainer "
                      "trains (a stale, partial or lagging weight sync). Fix the sync into the sampler.",
                      f"Parity probe: the sampler scores fixed sequences as the trainer does ({med:.2g} nats/token "
                      f"after the updates).",
                      Measure(f"{H06_PARITY_SAMPLER_TRAINER} (median after the first step)", med, late_thr, exact=True, log=True))
    gap = m.get(GAP) or []
    thr, _ = gap_threshold(m, params)
    if len(gap) >= 4 and gap[0][1] <= thr:
        tail = [v for _, v in gap[-max(2, len(gap) // 4):]]
        late = statistics.fmean(tail)
        ev = {f"{H06_LOGP_GAP_MEAN} (first)": gap[0][1], f"{H06_LOGP_GAP_MEAN} (last quarter)": late,
              "gap threshold (late)": late_thr, **ev_p}
        out += judged("h06", "gap_grows", late > late_thr, 2 + magnitude(late / late_thr), ev,
                      f"The sampler/trainer log-prob gap grows from {gap[0][1]:.2g} at the first step to "
                      f"{late:.3g} nats/token (healthy up to {late_thr:.2g}: {late_why}): the sampler lags the "
                      "trainer (weights not synced).",
                      f"The sampler/trainer gap stays within {late_thr:.2g} nats/token ({gap[0][1]:.2g} -> {late:.2g}).",
                      Measure(f"{H06_LOGP_GAP_MEAN} (last quarter)", late, late_thr, log=True))
    if not any(f.flagged for f in out) and (gap or stale) and not any(f.check == "sync" for f in out):
        ev = dict(ev_p)
        if gap:
            ev[f"{H06_LOGP_GAP_MEAN} (max)"] = max(v for _, v in gap)
        out.append(Finding("h06", "sync", False, 0.0, "Sampler tracks the trainer.", ev))
    return out


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
# Mean |sampler - trainer| logp per token (TRL's sampling/sampling_logp_difference/mean, vLLM only).
# Healthy bf16 stacks measure ~0.011 (published vLLM runs) to 0.036 (this project's 7B bf16 run on an
# H100); SkyRL's CI gate for dense models is 0.09. Without a floor measured in the run (TRL logs
# none), 0.09 is the level no healthy bf16 stack reaches; growth is judged against the run's start.
LOGP_DIFF_MAX = 0.09
LOGP_DIFF_GROWTH = 3.0  # last quarter above 3x the first steps' level: the sampler drifts from the trainer
SAMPLER_DIFF = TRL_SAMPLING_LOGP_DIFFERENCE.of(stat="mean")
SAMPLER_DIFF_TOP = TRL_SAMPLING_LOGP_DIFFERENCE.of(stat="max")


@rule(stage="sampling", checks={"sampler_trainer_differ_at_start": Kind.DEFECT, "sampler_trainer_drift": Kind.SYMPTOM},
      reads=(SAMPLER_DIFF, SAMPLER_DIFF_TOP, *OURS["logp_diff"]), needs=(SAMPLER_DIFF,),
      thresholds=("LOGP_DIFF_MAX", "LOGP_DIFF_GROWTH", "TREND_MIN_POINTS"))
def _logp_diff(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "logp_diff"):
        return []
    vals = values(m.get(SAMPLER_DIFF))
    first = statistics.fmean(vals[: max(1, min(3, len(vals) // 4))])
    tail = statistics.fmean(vals[-max(1, len(vals) // 4):])
    ev = {f"{SAMPLER_DIFF} (first steps)": first, f"{SAMPLER_DIFF} (last quarter)": tail}
    mx = values(m.get(SAMPLER_DIFF_TOP))
    if mx:
        ev[f"{SAMPLER_DIFF_TOP} (median)"] = statistics.median(mx)
    at_start = Measure(f"{SAMPLER_DIFF} (first steps)", first, LOGP_DIFF_MAX, log=True)
    if first > LOGP_DIFF_MAX:
        return [Finding("h06", "sampler_trainer_differ_at_start", True, 2 + magnitude(first / LOGP_DIFF_MAX),
                        f"From the first steps the sampler's and the trainer's log-probs differ by {first:.3g} "
                        f"nats/token (healthy bf16 stacks: 0.01-0.04): they do not compute the same distribution "
                        "(sampling settings such as temperature/top-p, a different context, or dtype/kernels). "
                        "TRL's log cannot tell which; run `+hypothesis=h06` (sampling-settings fit) and "
                        "`+hypothesis=h02` (trainer's view of the context).", ev, measure=at_start)]
    if len(vals) >= TREND_MIN_POINTS and tail > LOGP_DIFF_MAX and tail > LOGP_DIFF_GROWTH * first:
        return [Finding("h06", "sampler_trainer_drift", True, 2 + magnitude(tail / max(first, 1e-12) / LOGP_DIFF_GROWTH),
                        f"The sampler/trainer log-prob difference grows from {first:.3g} to {tail:.3g} nats/token: "
                        "the sampler falls behind the trainer (weights not synced to vLLM, or synced from the "
                        "wrong copy). Run `+hypothesis=h06` (parity probe).", ev,
                        measure=Measure(f"{SAMPLER_DIFF} (last quarter / first steps)", tail / max(first, 1e-12),
                                        LOGP_DIFF_GROWTH, log=True))]
    return [Finding("h06", "sampler_trainer_differ_at_start", False, 0.0,
                    f"Sampler and trainer agree ({first:.2g} -> {tail:.2g} nats/token).", ev, measure=at_start)]

# ---------------------------------------------------------------- at the point of use
# Read where the loss consumes its inputs (instruments/loss_inputs.py: the loss's own gradient against
# the rollout's references); the metrics, units and bounds are declared in base/catalogue.py.
# Identical groups over the run beyond what the sampler's own probabilities predict: Poisson tail
# p < 1e-3 (one false alarm in 1,000 runs) and at least 3 such groups (one or two prove nothing).
IDENTICAL_P_MAX = 1e-3
IDENTICAL_MIN = 3


def poisson_tail(k: int, mean: float) -> float:
    """P(X >= k) for X ~ Poisson(mean)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    term, below = math.exp(-mean), 0.0
    for i in range(k):
        below += term
        term *= mean / (i + 1)
    return max(0.0, 1.0 - below)


@rule(stage="sampling", checks={"sampling_not_diverse": Kind.DEFECT},
      reads=(H06_IDENTICAL_GROUP_SHARE, H06_IDENTICAL_GROUP_EXPECTED_SHARE), needs=(H06_IDENTICAL_GROUP_EXPECTED_SHARE,),
      thresholds=("IDENTICAL_P_MAX", "IDENTICAL_MIN"))
def _sampling_diverse(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Identical groups over the run vs the count the sampler's own log-probs predict (Poisson)."""
    seen = dict(m.get(H06_IDENTICAL_GROUP_SHARE) or [])
    pairs = [(seen[s], e) for s, e in (m.get(H06_IDENTICAL_GROUP_EXPECTED_SHARE) or []) if s in seen]
    groups = max(1.0, float(params.get("train.prompts_per_step", 8) or 8))
    observed = round(sum(o for o, _ in pairs) * groups)
    expected = sum(e for _, e in pairs) * groups
    p = poisson_tail(observed, expected)
    c = "sampling_not_diverse"
    t = params.get("train.temperature", "> 0")
    ev = {"identical groups": float(observed), "identical groups expected": expected, "p": p}
    # the evidence is the Poisson tail itself: -log10 p against -log10 of the bound; but when every
    # group of the run came out identical the share of groups is categorical (greedy sampling acts on
    # every group alike), a proof as strong as the tied groups it causes downstream, and the tail
    # (which floors at float precision near 1e-16) would understate it
    judged_groups = len(pairs) * groups
    share = observed / judged_groups if judged_groups else 0.0
    measure = Measure("identical groups (-log10 p)", -math.log10(max(p, 1e-300)), -math.log10(IDENTICAL_P_MAX))
    if share >= 1.0 - CATEGORICAL_SLACK and observed >= IDENTICAL_MIN:
        ev["identical groups (share of groups judged)"] = share
        measure = Measure("identical groups (share of groups judged)", share, expected / judged_groups, share=True)
    return judged("h06", c, observed >= IDENTICAL_MIN and p < IDENTICAL_P_MAX, 2 + magnitude(IDENTICAL_P_MAX / max(p, 1e-300)),
                  ev, f"{observed} groups held G identical completions where the sampler's own log-probs predict "
                  f"{expected:.2g} (Poisson p = {p:.1g}, train.temperature={t}): the sampler does not sample as "
                  "configured (greedy, or the temperature applied on one side only), so groups tie and carry no "
                  "signal." + stage_sentence(c), "Groups are as diverse as the sampler's probabilities say." + stage_sentence(c),
                  measure)


# H06: are the sampled tokens draws from the distribution the run samples with? (sync.sampling_calibration,
# once on the first probe). The log-prob gap compares RECORDED log-probs; a sampler that draws with other
# settings than it records (a temperature handed to generate beside the warpers that record) has no gap,
# but its tokens are too surprising (hotter) or too likely (colder, greedy) for the policy's entropy.
# The z-score is N(0, 1) for true draws on any model: |z| >= 6 (two-sided p ~ 2e-9) is no chance, and a
# mean excess of 0.05 nats/token keeps a real but immaterial difference (a rounded temperature on a
# long probe) from being called the run's defect. Tokens the claimed top-k / top-p give probability 0
# are impossible draws: past one in a hundred (a boundary tie in low precision) they are a proof.
CALIBRATION_Z = 6.0
CALIBRATION_EXCESS = 0.05
OUTSIDE_MAX = CATEGORICAL_SLACK


@rule(stage="sampling", checks={"samples_off_distribution": Kind.DEFECT},
      reads=(H06_SAMPLE_SURPRISE_Z, H06_SAMPLE_SURPRISE_EXCESS, H06_SAMPLE_OUTSIDE_SHARE, H06_SAMPLE_TOKENS),
      needs=(H06_SAMPLE_SURPRISE_Z,), thresholds=("CALIBRATION_Z", "CALIBRATION_EXCESS", "OUTSIDE_MAX"))
def _sample_calibration(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    z = values(m.get(H06_SAMPLE_SURPRISE_Z))[0]
    excess = (values(m.get(H06_SAMPLE_SURPRISE_EXCESS)) or [0.0])[0]
    outside = (values(m.get(H06_SAMPLE_OUTSIDE_SHARE)) or [0.0])[0]
    tokens = (values(m.get(H06_SAMPLE_TOKENS)) or [math.nan])[0]
    ev = {f"{H06_SAMPLE_SURPRISE_Z} (first probe)": z, f"{H06_SAMPLE_SURPRISE_EXCESS} (first probe)": excess,
          f"{H06_SAMPLE_OUTSIDE_SHARE} (first probe)": outside, f"{H06_SAMPLE_TOKENS} (first probe)": tokens}
    if outside > OUTSIDE_MAX:
        return [Finding("h06", "samples_off_distribution", True, 3.0,
                        f"{outside:.0%} of the sampled probe tokens have probability 0 under the sampling settings "
                        "the run claims (top-k / top-p): the sampler draws from a wider distribution than it says "
                        "(a truncation set on one side only).", ev,
                        measure=Measure(f"{H06_SAMPLE_OUTSIDE_SHARE} (first probe)", outside, OUTSIDE_MAX, exact=True,
                                        share=True))]
    side = "hotter" if z > 0 else "colder"
    return judged("h06", "samples_off_distribution", abs(z) >= CALIBRATION_Z and abs(excess) >= CALIBRATION_EXCESS,
                  2.0, ev,
                  f"The sampled tokens are not draws from the distribution the run samples with: their surprise "
                  f"differs from the policy's entropy by {excess:+.3g} nats/token (z = {z:+.1f} over {tokens:.0f} "
                  f"tokens; true draws give |z| of a few at most): the sampler draws {side} than the log-probs it "
                  "records and the trainer scores (a temperature, top-k/top-p or logits processor applied in "
                  "generation but not where the log-probs are taken). Stage: sampling.",
                  f"The sampled tokens are draws of the distribution the run samples with (z = {z:+.1f}, "
                  f"{excess:+.2g} nats/token over {tokens:.0f} tokens).",
                  Measure(f"{H06_SAMPLE_SURPRISE_Z} (first probe, |z|)", abs(z), CALIBRATION_Z))
