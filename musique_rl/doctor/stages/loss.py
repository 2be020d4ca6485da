"""Stage "loss": what the loss consumes: masks, normalisation, importance weights, KL (h02, h03, h06's
importance-sampling correction)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    H01_LOSS_ADV_FROM_INPUTS,
    H01_LOSS_ADV_MISALIGNED_SHARE,
    H01_LOSS_ADV_PAIRING_ERROR,
    H01_LOSS_ROWS_UNMATCHED_SHARE,
    H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE,
    H02_ATTENTION_COVERAGE,
    H02_ENV_TOKENS_WITH_LOSS,
    H02_KL_MASK_EQUALS_LOSS_MASK,
    H02_LOSS_ASSISTANT_LEFT_OUT_SHARE,
    H02_LOSS_NORMALISER_RATIO,
    H02_LOSS_SHARE_KIND,
    H02_LOSS_TOOL_TOKEN_SHARE,
    H03_KL_BETA_APPLIED_RATIO,
    H03_KL_ENV_TOKENS,
    H03_KL_MODEL_MEAN,
    H03_KL_NEGATIVE_SHARE,
    H03_KL_TERM_WITHOUT_BETA,
    H03_KL_TERM_ZERO_WITH_BETA,
    H03_LOSS_KL_ENV_TOKEN_SHARE,
    H03_LOSS_KL_MOVED,
    H03_REF_IS_POLICY,
    H06_FIT_GAP_TRAINER,
    H06_IS_ESS,
    H06_IS_MASKED_SEQ_SHARE,
    H06_IS_MASKED_TOKEN_SHARE,
    H06_LOGP_GAP_MEAN,
    KL_NEGATIVE_MAX,
    TRL_IMPORTANCE_SAMPLING_RATIO,
    TRL_KL,
)
from musique_rl.doctor.context import KL_PER_PEAK_STEP, gap_threshold, kl_term_off, update_budget_before
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import (
    Finding,
    History,
    judged,
    magnitude,
    mean_of,
    num,
    rule,
    stage_sentence,
    values,
)
from musique_rl.doctor.step import Kind

# H02: sampled assistant tokens left out of the loss; beyond a fifth, the loss ignores what was sampled
ASSISTANT_UNTRAINED_MAX = 0.2
# H06: TRL's importance-sampling weight exp(trainer - sampler logp) of a sequence (its
# `sampling/importance_sampling_ratio/mean`, with train.importance_sampling or vLLM). Identical
# weights give 1; a mean below 0.1 means most of the batch's loss is weighted away: the gradient
# vanishes whatever the learning rate (docs/failure_modes.md defect 5).
IS_WEIGHT_MIN = 0.1
IS_WEIGHT_KEY = TRL_IMPORTANCE_SAMPLING_RATIO.of(stat="mean")
# TRL's importance-sampling weights' extremes over a step's sequences
IS_WEIGHT_MAX = TRL_IMPORTANCE_SAMPLING_RATIO.of(stat="max")
IS_WEIGHT_MIN_KEY = TRL_IMPORTANCE_SAMPLING_RATIO.of(stat="min")
# H06: a median of 20% of a step's sequences given weight 0 by TRL's correction (why 20%: the docstring
# of _h06_importance_sampling_masks below)
IS_MASKED_SEQ_MAX = 0.2


# ---------------------------------------------------------------- tier-3 invariant (a proof, not a symptom)
# KL: before the first optimizer step the policy IS the reference (full fine-tuning loads a copy,
# PEFT disables the adapter), so the KL to it is 0 up to numerics; a larger one means the
# reference is another model (another checkpoint, dtype or adapter state: the silent reference
# mismatch verl and OpenRLHF users reported).
# KL to the reference at the first step. k3 ~ d^2 / 2 for a per-token log-prob difference d, so
# 1e-3 needs d ~ 0.045 on average: 20x the bf16-vs-float32 floor measured on CPU (1.9e-3) and far
# above float32 (~1e-6); a reference that is another model is typically at 1e-2 and above.
KL_AT_START_MAX = 1e-3


@rule(stage="loss", checks={"kl_at_start": Kind.DEFECT}, reads=(TRL_KL, H03_KL_MODEL_MEAN, *update_budget_before.reads),
      needs=(TRL_KL, H03_KL_MODEL_MEAN), thresholds=("KL_AT_START_MAX",))
def _kl_at_start(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    key = TRL_KL if values(m.get(TRL_KL)) else H03_KL_MODEL_MEAN
    first_step, first = next((s, v) for s, v in m[key] if v is not None)
    if num(params, "loss.beta", 1.0) == 0:
        return []
    ev = {f"{key} (first step)": first}
    when = "Before the first update"
    if first_step > 1:
        # a first row after updates: context.py withdraws the claim unless those updates cannot account for it
        budget = update_budget_before(first_step, m, params)
        ev["first logged step"] = float(first_step)
        if budget is not None:
            ev["updates before it (peak-rate steps)"] = budget
            when = (f"At the first logged row (step {first_step}), after updates worth {budget:.2g} peak-rate step(s) "
                    f"that move a policy at most {KL_PER_PEAK_STEP * budget:.2g} nats/token,")
    return judged("h03", "kl_at_start", first > KL_AT_START_MAX, 3 + magnitude(first / KL_AT_START_MAX), ev,
                  f"{when} the KL to the reference is already {first:.3g} (must be ~0: the "
                  "policy starts AS the reference): the reference model is not the starting policy (another "
                  "checkpoint, dtype, or adapter state).",
                  f"KL to the reference starts at {first:.2g}.",
                  Measure(f"{key} (first step)", first, KL_AT_START_MAX, exact=True, log=True))


@rule(stage="loss", checks={"env_tokens_in_loss": Kind.DEFECT, "context_hidden_from_trainer": Kind.DEFECT,
                        "sampled_tokens_untrained": Kind.DEFECT},
      reads=(H02_ENV_TOKENS_WITH_LOSS, H02_ATTENTION_COVERAGE, H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE,
             H02_LOSS_SHARE_KIND, H06_LOGP_GAP_MEAN, *gap_threshold.reads),
      needs=(H02_ENV_TOKENS_WITH_LOSS, H02_ATTENTION_COVERAGE, H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE),
      thresholds=("ASSISTANT_UNTRAINED_MAX",))
def _loss_mask(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    env = values(m.get(H02_ENV_TOKENS_WITH_LOSS))
    if env:
        share = statistics.fmean(values(m.get(H02_LOSS_SHARE_KIND.of(kind="tool"))) or [0.0]) + statistics.fmean(
            values(m.get(H02_LOSS_SHARE_KIND.of(kind="template"))) or [0.0])
        ev = {f"{H02_ENV_TOKENS_WITH_LOSS} (max)": max(env), f"{H02_ENV_TOKENS_WITH_LOSS} (mean)": statistics.fmean(env),
              f"{H02_LOSS_SHARE_KIND.of(kind='tool+template')} (mean)": share}
        if max(env) > 0:
            out.append(Finding("h02", "env_tokens_in_loss", True, 3 + magnitude(1 + max(env)),
                               f"The loss trains on tokens the environment wrote: up to {max(env):.0f} tool/template "
                               f"tokens per batch ({share:.0%} of loss tokens). Must be 0: tool results and chat "
                               "scaffolding need env_mask 0 (train.mask_env_tokens=true).", ev,
                               measure=Measure(f"{H02_ENV_TOKENS_WITH_LOSS} (max)", max(env), 0.0, exact=True)))
        else:
            out.append(Finding("h02", "env_tokens_in_loss", False, 0.0,
                               "No tool or template token carries loss.", ev,
                               measure=Measure(f"{H02_ENV_TOKENS_WITH_LOSS} (max)", max(env), 0.0, exact=True)))
    gap = m.get(H06_LOGP_GAP_MEAN) or []
    cov = values(m.get(H02_ATTENTION_COVERAGE))
    thr, _ = gap_threshold(m, params)
    # a hidden context with a gap past the threshold is reported by the sampling stage's agreement
    # check (the gap is its measurement); alone, it is a tier-3 proof here
    if cov and min(cov) < 1 and not (gap and gap[0][1] > thr):
        out.append(Finding("h02", "context_hidden_from_trainer", True, 3 + magnitude(1 / max(min(cov), 1e-3)),
                           f"The trainer's forward pass attends to only {min(cov):.0%} of the context tokens: prompt or "
                           "tool tokens are invisible when it scores the assistant's tokens.",
                           {f"{H02_ATTENTION_COVERAGE} (min)": min(cov)},
                           measure=Measure(f"{H02_ATTENTION_COVERAGE} (min)", min(cov), 1.0, worse="below", exact=True)))
    untrained = values(m.get(H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE))
    if untrained and statistics.fmean(untrained) > ASSISTANT_UNTRAINED_MAX:
        u = statistics.fmean(untrained)
        out.append(Finding("h02", "sampled_tokens_untrained", True, 1 + magnitude(u / ASSISTANT_UNTRAINED_MAX),
                           f"{u:.0%} of the sampled assistant tokens are outside the loss mask: most of what the "
                           "policy wrote is not trained on.", {f"{H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE} (mean)": u},
                           measure=Measure(f"{H02_ASSISTANT_TOKENS_WITHOUT_LOSS_SHARE} (mean)", u, ASSISTANT_UNTRAINED_MAX,
                                           share=True)))
    return out


# Which side of a sampler/trainer gap at the first step is wrong is decided by a third measurement, not
# assumed: the parity probe's plain forward pass of the trainer's weights over the sampled tokens
# (sync.sampling_fit, h06/fit_gap_trainer). When it reproduces the sampler's own log-probs, the sampler
# and the batch are right and the trainer's per-token log-probs in the loss (its attention mask, labels,
# logits_to_keep, temperature) are the part that differs; when it does not, the sampling stage reports
# the gap (sampling.py, trainer_sampler_mismatch_at_start).
@rule(stage="loss", checks={"trainer_logps_differ_from_forward": Kind.DEFECT},
      reads=(H06_LOGP_GAP_MEAN, H06_FIT_GAP_TRAINER, *gap_threshold.reads),
      needs=(H06_LOGP_GAP_MEAN, H06_FIT_GAP_TRAINER))
def _trainer_logps(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    gap, fits = m.get(H06_LOGP_GAP_MEAN) or [], values(m.get(H06_FIT_GAP_TRAINER))
    if not gap or not fits or not math.isfinite(gap[0][1]):
        return []
    step0, fit = gap[0][1], fits[0]
    thr, why = gap_threshold(m, params)
    c = "trainer_logps_differ_from_forward"
    ev = {f"{H06_LOGP_GAP_MEAN} (first step)": step0, f"{H06_FIT_GAP_TRAINER} (first probe)": fit, "gap threshold": thr}
    return judged("h02", c, step0 > thr >= fit, 2 + magnitude(step0 / thr), ev,
                  f"Before any update the trainer's log-probs of the sampled tokens differ from the sampler's by "
                  f"{step0:.3g} nats/token (healthy up to {thr:.2g}: {why}), while a plain forward pass of the "
                  f"trainer's weights over the same tokens reproduces the sampler's to {fit:.2g}: the sampler and "
                  "the batch are right, the trainer's per-token log-probs in the loss are not (the attention mask "
                  "or labels it scores with, the positions it keeps, its temperature)." + stage_sentence(c),
                  "The trainer's per-token log-probs agree with a plain forward pass of its weights at the first "
                  "step, or the gap is the sampler's (sampling stage)." + stage_sentence(c),
                  Measure(f"{H06_LOGP_GAP_MEAN} (first step)", step0, thr, exact=True, log=True))


@rule(stage="loss", checks={"kl_on_env_tokens": Kind.DEFECT, "kl_mask_differs": Kind.DEFECT, "kl_sign": Kind.DEFECT,
                        "kl": Kind.DEFECT},
      reads=(H03_KL_ENV_TOKENS, H03_KL_NEGATIVE_SHARE, H02_KL_MASK_EQUALS_LOSS_MASK, H03_KL_MODEL_MEAN),
      needs=(H03_KL_ENV_TOKENS, H03_KL_NEGATIVE_SHARE), thresholds=("KL_NEGATIVE_MAX",))
def _kl(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    env = values(m.get(H03_KL_ENV_TOKENS))
    neg = values(m.get(H03_KL_NEGATIVE_SHARE))
    same = values(m.get(H02_KL_MASK_EQUALS_LOSS_MASK))
    if not env and not neg:
        return []
    ev = {f"{H03_KL_ENV_TOKENS} (max)": max(env, default=0.0), f"{H03_KL_NEGATIVE_SHARE} (mean)": statistics.fmean(neg or [0.0]),
          f"{H03_KL_MODEL_MEAN} (last)": (values(m.get(H03_KL_MODEL_MEAN)) or [0.0])[-1]}
    if same:
        ev[f"{H02_KL_MASK_EQUALS_LOSS_MASK} (min)"] = min(same)
    if env and max(env) > 0:
        out.append(Finding("h03", "kl_on_env_tokens", True, 3 + magnitude(1 + max(env)),
                           f"The KL penalty is computed on up to {max(env):.0f} tool/template tokens per micro-batch "
                           "(must be 0): the policy is pulled toward the reference on text it did not write "
                           "(Search-R1's negative-KL explosion).", ev,
                           measure=Measure(f"{H03_KL_ENV_TOKENS} (max)", max(env), 0.0, exact=True)))
    elif same and min(same) < 1:
        out.append(Finding("h03", "kl_mask_differs", True, 2.0,
                           "The KL term is masked differently from the policy loss.", ev,
                           measure=Measure(f"{H02_KL_MASK_EQUALS_LOSS_MASK} (min)", min(same), 1.0, worse="below",
                                           exact=True)))
    if neg and statistics.fmean(neg) > KL_NEGATIVE_MAX:
        s = statistics.fmean(neg)
        out.append(Finding("h03", "kl_sign", True, 3 + magnitude(s / KL_NEGATIVE_MAX),
                           f"{s:.0%} of the per-token KL penalties are negative; the k3 estimator is never negative, "
                           "so the penalty is applied with the wrong sign: it pushes the policy AWAY from the reference.",
                           ev, measure=Measure(f"{H03_KL_NEGATIVE_SHARE} (mean)", s, KL_NEGATIVE_MAX, exact=True,
                                               share=True)))
    if not out:
        out.append(Finding("h03", "kl", False, 0.0, "KL confined to model tokens, with the right sign.", ev))
    return out



@rule(stage="loss", checks={"importance_weights_vanish": Kind.SYMPTOM}, starving=("importance_weights_vanish",),
      reads=(IS_WEIGHT_KEY,), needs=(IS_WEIGHT_KEY,), thresholds=("IS_WEIGHT_MIN",))
def _importance_weights(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    w = statistics.median(values(m.get(IS_WEIGHT_KEY)))
    return judged("h06", "importance_weights_vanish", w < IS_WEIGHT_MIN, 2 + magnitude(IS_WEIGHT_MIN / max(w, 1e-30)),
                  {IS_WEIGHT_KEY + " (median)": w},
                  f"TRL's importance-sampling correction weights the sequences by {w:.2g} (median of the steps' "
                  "means; 1 when trainer and sampler agree): the loss is weighted away, so no learning rate, rank or "
                  "KL setting can move the policy. The trainer's log-probs are far below the sampler's.",
                  f"Importance-sampling weights near 1 (median {w:.2g}).",
                  Measure(IS_WEIGHT_KEY + " (median)", w, IS_WEIGHT_MIN, worse="below", log=True))


@rule(stage="loss", checks={"importance_sampling_masks_sequences": Kind.SYMPTOM},
      reads=(H06_IS_MASKED_SEQ_SHARE, H06_IS_MASKED_TOKEN_SHARE, H06_IS_ESS), needs=(H06_IS_MASKED_SEQ_SHARE,),
      thresholds=("IS_MASKED_SEQ_MAX",))
def _h06_importance_sampling_masks(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """TRL's importance-sampling correction giving whole sequences zero weight (h06/is_* from
    core/importance.py). Threshold: a median of 20% of a step's sequences masked. Why 20%: with
    sequence_mask (clip 3) ordinary bf16 noise between sampler and trainer masks 25-39% of sequences
    of 1,024-8,192 loss tokens (benchmarks/bench_importance_sampling.py), so a share above this is
    the correction, not a rare off-policy sample, deciding which episodes train: the long ones drop
    out and the reward can stay flat while every other instrument looks sane. token_truncate, the
    vLLM default (train.importance_sampling=auto), masks none."""
    limit = IS_MASKED_SEQ_MAX
    masked = statistics.median(values(m.get(H06_IS_MASKED_SEQ_SHARE)))
    ev = {f"{H06_IS_MASKED_SEQ_SHARE} (median)": masked}
    for k in (H06_IS_MASKED_TOKEN_SHARE, H06_IS_ESS):
        if values(m.get(k)):
            ev[f"{k} (median)"] = statistics.median(values(m.get(k)))
    mode = params.get("train.importance_sampling", "the configured mode")
    ess = f", effective sample size {ev[f'{H06_IS_ESS} (median)']:.2f}" if f"{H06_IS_ESS} (median)" in ev else ""
    return judged("h06", "importance_sampling_masks_sequences", masked > limit, 1.5 + magnitude(masked / limit), ev,
                  f"TRL's importance-sampling correction ({mode}) gives {masked:.0%} of each step's sequences zero "
                  f"weight (median; threshold {limit:.0%}){ess}: those episodes, the long ones first, never train. "
                  "Per-sequence ratios multiply thousands of per-token ratios, so bf16 noise alone crosses the "
                  "clip; use train.importance_sampling=token_truncate (the vLLM default) or fix the mismatch.",
                  f"The importance-sampling correction masks {masked:.0%} of sequences.",
                  Measure(f"{H06_IS_MASKED_SEQ_SHARE} (median)", masked, limit, share=True))


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
# TRL's sequence/token IS weight exp(trainer - sampler logp) is capped at vllm_importance_sampling_cap
# (default 3.0); a max at the cap on most steps means the correction is truncating or masking
# tokens every step, not occasionally. A min below 1e-3 means some sequences are weighted ~away.
IS_CAP_DEFAULT = 3.0
IS_AT_CAP_SHARE = 0.5
IS_MIN_VANISH = 1e-3


@rule(stage="loss", checks={"importance_weights_clipped": Kind.SYMPTOM}, reads=(IS_WEIGHT_MAX, IS_WEIGHT_MIN_KEY),
      needs=(IS_WEIGHT_MAX, IS_WEIGHT_MIN_KEY), thresholds=("IS_CAP_DEFAULT", "IS_AT_CAP_SHARE", "IS_MIN_VANISH"))
def _is_clipped(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """The mean weight vanishing is the doctor's h06 rule (importance_weights_vanish); this reads the
    tails: weights at TRL's cap on most steps, or some sequences weighted ~0."""
    cap = num(params, "vllm_importance_sampling_cap", IS_CAP_DEFAULT)
    hi = values(m.get(IS_WEIGHT_MAX))
    lo = values(m.get(IS_WEIGHT_MIN_KEY))
    at_cap = sum(v >= cap * (1 - 1e-6) for v in hi) / len(hi) if hi else 0.0
    vanish = sum(v < IS_MIN_VANISH for v in lo) / len(lo) if lo else 0.0
    ev = {"importance_sampling_ratio/max at cap (share of steps)": at_cap,
          "importance_sampling_ratio/min < 1e-3 (share of steps)": vanish, "cap": cap}
    if hi:
        ev[f"{IS_WEIGHT_MAX} (median)"] = statistics.median(hi)
    if lo:
        ev[f"{IS_WEIGHT_MIN_KEY} (median)"] = statistics.median(lo)
    bad = at_cap > IS_AT_CAP_SHARE or vanish > IS_AT_CAP_SHARE
    worst = max(at_cap, vanish)
    return judged("h06", "importance_weights_clipped", bad, 1 + magnitude(worst / IS_AT_CAP_SHARE * 10), ev,
                  f"TRL's importance-sampling correction is at work every step: the largest weight sits at the cap "
                  f"{cap:g} on {at_cap:.0%} of steps and the smallest is below 1e-3 on {vanish:.0%}: the sampler's "
                  "tokens are not the trainer's (sampling settings or stale weights). TRL's log cannot tell which; "
                  "run `+hypothesis=h06` (parity probe, sampling-settings fit).",
                  "Importance weights stay inside TRL's cap.",
                  Measure("importance weights at the cap or ~0 (share of steps)", worst, IS_AT_CAP_SHARE, share=True))

# ---------------------------------------------------------------- at the point of use
# Read where the loss consumes its inputs (instruments/loss_inputs.py: the loss's own gradient against
# the rollout's references); the metrics, units and bounds are declared in base/catalogue.py.
# Rows whose applied advantage is not their own (mean share over the logged steps): 2% tolerates one
# odd row in 50 (a decode quirk); a reorder moves most rows.
MISALIGNED_MAX = 0.02
# ... and only when some row is off by a material amount: the instrument calls a row misaligned past
# 1e-3 advantage units (+1%), the round-off line; a row carrying ANOTHER row's advantage is off by the
# difference of two advantages, which for rows whose rewards differ is a sizeable part of a unit. A
# run whose worst row is within 1% of a unit (0.001 on a few near-zero advantages, when rewards are
# 16x larger than usual) has every row's own advantage, up to the precision the loss computes it in.
PAIRING_MATERIAL = 0.01
UNMATCHED_MAX = 0.02
# Sampled tokens of a row with signal left without gradient (mean share): 1% is one token in 100.
LEFT_OUT_MAX = 0.01
# The per-row normaliser ratio's worst step (median over steps) outside this band: float round-off
# is ~1e-6; the slips pipelines ship are factors >= 1.2 (accumulation, max length vs length).
NORMALISER_BAND = (0.95, 1.05)
# beta applied / configured (median over the steps where the policy moved): the float32 fit error is
# < 1e-3; dropped (0), flipped (-1) or rescaled betas sit far outside.
BETA_BAND = (0.9, 1.1)


@rule(stage="loss", checks={"advantages_not_paired_in_loss": Kind.DEFECT},
      reads=(H01_LOSS_ADV_MISALIGNED_SHARE, H01_LOSS_ROWS_UNMATCHED_SHARE, H01_LOSS_ADV_FROM_INPUTS,
             H01_LOSS_ADV_PAIRING_ERROR),
      needs=(H01_LOSS_ADV_MISALIGNED_SHARE, H01_LOSS_ROWS_UNMATCHED_SHARE, H01_LOSS_ADV_FROM_INPUTS),
      thresholds=("MISALIGNED_MAX", "UNMATCHED_MAX", "PAIRING_MATERIAL"))
def _advantages_paired(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    mis = mean_of(m, H01_LOSS_ADV_MISALIGNED_SHARE) or 0.0
    err = max(values(m.get(H01_LOSS_ADV_PAIRING_ERROR)), default=0.0)
    unmatched = mean_of(m, H01_LOSS_ROWS_UNMATCHED_SHARE) or 0.0
    from_inputs = min(values(m.get(H01_LOSS_ADV_FROM_INPUTS)), default=1.0)
    ev = {f"{H01_LOSS_ADV_MISALIGNED_SHARE} (mean)": mis, f"{H01_LOSS_ADV_PAIRING_ERROR} (max)": err,
          f"{H01_LOSS_ROWS_UNMATCHED_SHARE} (mean)": unmatched, f"{H01_LOSS_ADV_FROM_INPUTS} (min)": from_inputs}
    misaligned = mis > MISALIGNED_MAX and err > PAIRING_MATERIAL
    bad = misaligned or unmatched > UNMATCHED_MAX or from_inputs < 1
    worst = max(mis / MISALIGNED_MAX, unmatched / UNMATCHED_MAX, 1 + 10 * (from_inputs < 1))
    check = "advantages_not_paired_in_loss"
    why = []
    if misaligned:
        why.append(f"{mis:.0%} of the rows the loss trains are multiplied by an advantage that is not their own "
                   f"(up to {err:.2g} off the advantage recomputed from the rewards of the episode with the same "
                   "token ids): completions were reordered without their advantages after scoring")
    if unmatched > UNMATCHED_MAX:
        why.append(f"{unmatched:.0%} of the loss's rows match no episode of the rollout by their token ids")
    if from_inputs < 1:
        why.append("the loss's advantages are not those of its inputs (no gradient reaches them)")
    measure = (Measure(f"{H01_LOSS_ROWS_UNMATCHED_SHARE} (mean)", unmatched, UNMATCHED_MAX, exact=True, share=True)
               if unmatched / UNMATCHED_MAX > mis / MISALIGNED_MAX else
               Measure(f"{H01_LOSS_ADV_MISALIGNED_SHARE} (mean)", mis, MISALIGNED_MAX, exact=True, share=True))
    if from_inputs < 1:
        measure = Measure(f"{H01_LOSS_ADV_FROM_INPUTS} (min)", from_inputs, 1.0, worse="below", exact=True)
    return judged("h01", check, bad, 3 + magnitude(worst), ev,
                  "Read where the loss consumes them: " + "; ".join(why) + "." + stage_sentence(check),
                  "Every row the loss trains carries its own episode's advantage." + stage_sentence(check), measure)


@rule(stage="loss", checks={"loss_trains_env_tokens": Kind.DEFECT, "loss_leaves_sampled_tokens_out": Kind.DEFECT,
                        "loss_normaliser_off": Kind.SYMPTOM},  # a wrong mask changes the count the loss divides by
      reads=(H02_LOSS_TOOL_TOKEN_SHARE, H02_LOSS_ASSISTANT_LEFT_OUT_SHARE, H02_LOSS_NORMALISER_RATIO),
      needs=(H02_LOSS_TOOL_TOKEN_SHARE, H02_LOSS_ASSISTANT_LEFT_OUT_SHARE, H02_LOSS_NORMALISER_RATIO),
      thresholds=("LEFT_OUT_MAX", "NORMALISER_BAND"))
def _loss_mask_and_normaliser(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    tool = max(values(m.get(H02_LOSS_TOOL_TOKEN_SHARE)), default=None)
    if tool is not None:
        c = "loss_trains_env_tokens"
        out += judged("h02", c, tool > 0, 3 + magnitude(1 + 100 * tool), {f"{H02_LOSS_TOOL_TOKEN_SHARE} (max)": tool},
                      f"The loss puts a gradient on {tool:.0%} of the tool-result and template tokens (the rollout's "
                      "token sources, not the trainer's mask): the mask the loss applies is not the rollout's; they "
                      "are not the policy's actions (docs/failure_modes.md defect 2)." + stage_sentence(c),
                      "The loss trains no tool or template token." + stage_sentence(c),
                      Measure(f"{H02_LOSS_TOOL_TOKEN_SHARE} (max)", tool, 0.0, exact=True, share=True))
    left = mean_of(m, H02_LOSS_ASSISTANT_LEFT_OUT_SHARE)
    if left is not None:
        c = "loss_leaves_sampled_tokens_out"
        out += judged("h02", c, left > LEFT_OUT_MAX, 2 + magnitude(left / LEFT_OUT_MAX),
                      {f"{H02_LOSS_ASSISTANT_LEFT_OUT_SHARE} (mean)": left},
                      f"{left:.0%} of the sampled tokens of rows with a non-zero advantage get no gradient from the "
                      "loss (not clipped, not importance-masked): the loss's mask misses the policy's own tokens."
                      + stage_sentence(c), "Every sampled token of a row with signal trains." + stage_sentence(c),
                      Measure(f"{H02_LOSS_ASSISTANT_LEFT_OUT_SHARE} (mean)", left, LEFT_OUT_MAX, exact=True, share=True))
    ratios = values(m.get(H02_LOSS_NORMALISER_RATIO))
    if ratios:
        c = "loss_normaliser_off"
        r = statistics.median(ratios)
        lo, hi = NORMALISER_BAND
        off = max(r / hi, lo / r) if r > 0 else math.inf
        lt = params.get("loss.loss_type", "the configured loss_type")
        # a wrong mask changes the token count the loss divides by: the chain then files this under
        # the mask's finding (a defect of the same stage explains its symptom), not as a second cause
        out += judged("h02", c, not lo <= r <= hi, 2 + magnitude(off),
                      {f"{H02_LOSS_NORMALISER_RATIO} (median)": r},
                      f"The loss divides a row's tokens by {r:.3g}x what {lt} implies (the weight -dL/dA the loss "
                      "gave the row vs tokens x loss_type's normaliser): every update is scaled, per row, by the "
                      "wrong amount." + stage_sentence(c), f"The loss normalises as {lt} says." + stage_sentence(c),
                      Measure(f"{H02_LOSS_NORMALISER_RATIO} (median, x off the band)", off, 1.0, log=True))
    return out


@rule(stage="loss", checks={"kl_penalty_not_applied": Kind.DEFECT, "kl_penalty_without_beta": Kind.DEFECT,
                        "kl_beta_not_as_configured": Kind.DEFECT, "kl_on_env_tokens_in_loss": Kind.DEFECT},
      reads=(H03_KL_TERM_ZERO_WITH_BETA, H03_KL_TERM_WITHOUT_BETA, H03_KL_BETA_APPLIED_RATIO, H03_LOSS_KL_ENV_TOKEN_SHARE,
             H03_LOSS_KL_MOVED),
      needs=(H03_KL_TERM_ZERO_WITH_BETA, H03_KL_TERM_WITHOUT_BETA, H03_KL_BETA_APPLIED_RATIO, H03_LOSS_KL_ENV_TOKEN_SHARE),
      thresholds=("BETA_BAND",))
def _kl_acts(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    zero = max(values(m.get(H03_KL_TERM_ZERO_WITH_BETA)), default=0.0)
    without = max(values(m.get(H03_KL_TERM_WITHOUT_BETA)), default=0.0)
    moved = max(values(m.get(H03_LOSS_KL_MOVED)), default=0.0)
    beta = params.get("loss.beta", "> 0")
    if zero >= 1:
        c = "kl_penalty_not_applied"
        out.append(Finding("h03", c, True, 3.5, f"A KL penalty is configured (loss.beta={beta}) and the policy has "
                           f"moved from its reference ({moved:.2g} nats/token), yet no KL term reaches the loss (no "
                           "gradient flows to the reference log-probs, or none reached it): beta is not forwarded."
                           + stage_sentence(c), {f"{H03_KL_TERM_ZERO_WITH_BETA} (max)": zero, f"{H03_LOSS_KL_MOVED} (max)": moved},
                           measure=Measure(f"{H03_KL_TERM_ZERO_WITH_BETA} (max)", zero, 0.0, exact=True)))
    if without >= 1:
        c = "kl_penalty_without_beta"
        out.append(Finding("h03", c, True, 2.5, "loss.beta is 0, yet a KL term acts in the loss." + stage_sentence(c),
                           {f"{H03_KL_TERM_WITHOUT_BETA} (max)": without},
                           measure=Measure(f"{H03_KL_TERM_WITHOUT_BETA} (max)", without, 0.0, exact=True)))
    ratios = values(m.get(H03_KL_BETA_APPLIED_RATIO))
    if ratios and zero < 1:
        c = "kl_beta_not_as_configured"
        r = statistics.median(ratios)
        lo, hi = BETA_BAND
        off = abs(r - 1) / (hi - 1)
        out += judged("h03", c, not lo <= r <= hi, 3 + magnitude(1 + off), {f"{H03_KL_BETA_APPLIED_RATIO} (median)": r},
                      f"The KL term the loss applies is {r:.3g}x loss.beta={beta} (fit of its gradient on the "
                      "reference log-probs): the coefficient is not the configured one"
                      + (", and its sign is flipped" if r < 0 else "") + "." + stage_sentence(c),
                      "The KL term acts with the configured beta." + stage_sentence(c),
                      Measure(f"{H03_KL_BETA_APPLIED_RATIO} (median, off 1 in band widths)", off, 1.0, exact=True))
    env = max(values(m.get(H03_LOSS_KL_ENV_TOKEN_SHARE)), default=None)
    if env is not None:
        c = "kl_on_env_tokens_in_loss"
        out += judged("h03", c, env > 0, 3 + magnitude(1 + 100 * env), {f"{H03_LOSS_KL_ENV_TOKEN_SHARE} (max)": env},
                      f"The loss's KL term reaches {env:.0%} of the tool/template tokens (its gradient on the "
                      "reference log-probs, by the rollout's token sources)." + stage_sentence(c),
                      "The loss's KL term stays on the policy's tokens." + stage_sentence(c),
                      Measure(f"{H03_LOSS_KL_ENV_TOKEN_SHARE} (max)", env, 0.0, exact=True, share=True))
    return out


# ---------------------------------------------------------------- the reference model (instruments/reference.py)
@rule(stage="loss", checks={"kl_term_differs_from_kl": Kind.DEFECT}, reads=(TRL_KL, H03_KL_MODEL_MEAN),
      needs=(TRL_KL, H03_KL_MODEL_MEAN))
def _kl_term(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """The KL term the loss adds (TRL's logged ``kl``) against the k3 KL recomputed from the same
    per-token log-probs (instruments/kl.py): the same quantity, equal on a healthy run."""
    off, steps = kl_term_off(m)
    if not steps:
        return []
    c = "kl_term_differs_from_kl"
    ours, theirs = values(m.get(H03_KL_MODEL_MEAN)), values(m.get(TRL_KL))
    ev = {"steps where the loss's KL term differs from the KL": float(off), "steps with both": float(steps),
          f"{TRL_KL} (first)": theirs[0], f"{H03_KL_MODEL_MEAN} (first)": ours[0]}
    return judged("h03", c, off * 2 > steps, 3.0, ev,
                  f"On {off} of {steps} steps the KL term the loss adds ({TRL_KL}: {theirs[0]:.3g} at the first) is not "
                  f"the KL between the policy and the reference recomputed from the same log-probs ({ours[0]:.3g}): "
                  "the loss computes its KL term wrong (the estimator, its sign, or what it is multiplied by)."
                  + stage_sentence(c),
                  "The loss's KL term is the KL of the policy to the reference." + stage_sentence(c),
                  Measure("steps whose KL term is not the KL (share)", off / steps, 0.5, exact=True, share=True))


@rule(stage="loss", checks={"reference_is_policy": Kind.DEFECT}, reads=(H03_REF_IS_POLICY,), needs=(H03_REF_IS_POLICY,))
def _reference_is_policy(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """With beta > 0, the reference the KL is scored against must be a model of its own: read from the
    objects at the start and at every probe (an exact invariant, not a statistic). A reference that is the
    trained module, or aliases its weights, makes the KL 0 at every step however far the policy moves."""
    flags = values(m.get(H03_REF_IS_POLICY))
    share = sum(v > 0.5 for v in flags) / len(flags)
    c = "reference_is_policy"
    beta = params.get("loss.beta", params.get("beta", "> 0"))
    return judged("h03", c, share > 0, 3.5, {f"{H03_REF_IS_POLICY} (share of probes)": share},
                  f"The KL's reference is the policy itself (or shares the weights the optimizer trains) on "
                  f"{share:.0%} of the probes: with loss.beta={beta} the KL term is 0 at every step however far "
                  "the policy moves, so the penalty holds nothing back. Load the reference as a model of its own "
                  "(or, under PEFT, score it with the adapters disabled)." + stage_sentence(c),
                  "The KL's reference is a model of its own (no storage shared with the trained weights)."
                  + stage_sentence(c),
                  Measure(f"{H03_REF_IS_POLICY} (share of probes)", share, 0.0, exact=True, share=True))
