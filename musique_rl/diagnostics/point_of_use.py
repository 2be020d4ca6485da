"""Doctor rules on the point-of-use checks (diagnostics/loss_inputs.py): what the loss multiplied,
read from its own gradient against the rollout's references.

Each finding names its stage of the GRPO step (chain.CHECKS: the ``Stage: ...`` sentence of its
verdict). The metrics, their units, bounds and reasons are declared once in diagnostics/catalogue.py;
the thresholds below are those bounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.chain import CHECKS
from musique_rl.diagnostics.findings import Finding, History, judged, magnitude, rule, values

# Rows whose applied advantage is not their own (mean share over the logged steps): 2% tolerates one
# odd row in 50 (a decode quirk); a reorder moves most rows.
MISALIGNED_MAX = 0.02
UNMATCHED_MAX = 0.02
# Sampled tokens of a row with signal left without gradient (mean share): 1% is one token in 100.
LEFT_OUT_MAX = 0.01
# The per-row normaliser ratio's worst step (median over steps) outside this band: float round-off
# is ~1e-6; the slips pipelines ship are factors >= 1.2 (accumulation, max length vs length).
NORMALISER_BAND = (0.95, 1.05)
# beta applied / configured (median over the steps where the policy moved): the float32 fit error is
# < 1e-3; dropped (0), flipped (-1) or rescaled betas sit far outside.
BETA_BAND = (0.9, 1.1)
# Identical groups over the run beyond what the sampler's own probabilities predict: Poisson tail
# p < 1e-3 (one false alarm in 1,000 runs) and at least 3 such groups (one or two prove nothing).
IDENTICAL_P_MAX = 1e-3
IDENTICAL_MIN = 3

# The stage of the GRPO step each check judges (inputs, sampling, environment, reward, signal, loss,
# gradient, update, policy change).
# Episodes where overlapping scorers contradict each other (mean share): 1%, as components_disagree.
OVERLAP_DISAGREEMENT_MAX = 0.01


def _stage(check: str) -> str:
    return f" Stage: {CHECKS[check][0]}."  # declared with the chain's other checks


def _mean(m: Mapping[str, History], key: str) -> float | None:
    v = values(m.get(key))
    return statistics.fmean(v) if v else None


@rule("h01/loss_adv_misaligned_share", "h01/loss_rows_unmatched_share", "h01/loss_adv_from_inputs")
def _advantages_paired(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    mis = _mean(m, "h01/loss_adv_misaligned_share") or 0.0
    err = max(values(m.get("h01/loss_adv_pairing_error")), default=0.0)
    unmatched = _mean(m, "h01/loss_rows_unmatched_share") or 0.0
    from_inputs = min(values(m.get("h01/loss_adv_from_inputs")), default=1.0)
    ev = {"h01/loss_adv_misaligned_share (mean)": mis, "h01/loss_adv_pairing_error (max)": err,
          "h01/loss_rows_unmatched_share (mean)": unmatched, "h01/loss_adv_from_inputs (min)": from_inputs}
    bad = mis > MISALIGNED_MAX or unmatched > UNMATCHED_MAX or from_inputs < 1
    worst = max(mis / MISALIGNED_MAX, unmatched / UNMATCHED_MAX, 1 + 10 * (from_inputs < 1))
    check = "advantages_not_paired_in_loss"
    why = []
    if mis > MISALIGNED_MAX:
        why.append(f"{mis:.0%} of the rows the loss trains are multiplied by an advantage that is not their own "
                   f"(up to {err:.2g} off the advantage recomputed from the rewards of the episode with the same "
                   "token ids): completions were reordered without their advantages after scoring")
    if unmatched > UNMATCHED_MAX:
        why.append(f"{unmatched:.0%} of the loss's rows match no episode of the rollout by their token ids")
    if from_inputs < 1:
        why.append("the loss's advantages are not those of its inputs (no gradient reaches them)")
    return judged("h01", check, bad, 3 + magnitude(worst), ev,
                  "Read where the loss consumes them: " + "; ".join(why) + "." + _stage(check),
                  "Every row the loss trains carries its own episode's advantage." + _stage(check))


@rule("h02/loss_tool_token_share", "h02/loss_assistant_left_out_share", "h02/loss_normaliser_ratio")
def _loss_mask_and_normaliser(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    tool = max(values(m.get("h02/loss_tool_token_share")), default=None)
    if tool is not None:
        c = "loss_trains_env_tokens"
        out += judged("h02", c, tool > 0, 3 + magnitude(1 + 100 * tool), {"h02/loss_tool_token_share (max)": tool},
                      f"The loss puts a gradient on {tool:.0%} of the tool-result and template tokens (the rollout's "
                      "token sources, not the trainer's mask): the mask the loss applies is not the rollout's; they "
                      "are not the policy's actions (docs/failure_modes.md defect 2)." + _stage(c),
                      "The loss trains no tool or template token." + _stage(c))
    left = _mean(m, "h02/loss_assistant_left_out_share")
    if left is not None:
        c = "loss_leaves_sampled_tokens_out"
        out += judged("h02", c, left > LEFT_OUT_MAX, 2 + magnitude(left / LEFT_OUT_MAX),
                      {"h02/loss_assistant_left_out_share (mean)": left},
                      f"{left:.0%} of the sampled tokens of rows with a non-zero advantage get no gradient from the "
                      "loss (not clipped, not importance-masked): the loss's mask misses the policy's own tokens."
                      + _stage(c), "Every sampled token of a row with signal trains." + _stage(c))
    ratios = values(m.get("h02/loss_normaliser_ratio"))
    if ratios:
        c = "loss_normaliser_off"
        r = statistics.median(ratios)
        lo, hi = NORMALISER_BAND
        off = max(r / hi, lo / r) if r > 0 else math.inf
        lt = params.get("loss.loss_type", "the configured loss_type")
        # a wrong mask changes the token count the loss divides by: then the ratio is its consequence
        mask_wrong = any(f.flagged and f.check in ("loss_trains_env_tokens", "loss_leaves_sampled_tokens_out")
                         for f in out)
        consequence = (" A consequence of the mask above (the loss counts other tokens), not a separate cause."
                       if mask_wrong else "")
        out += judged("h02", c, not lo <= r <= hi, (1 if mask_wrong else 2) + magnitude(off),
                      {"h02/loss_normaliser_ratio (median)": r},
                      f"The loss divides a row's tokens by {r:.3g}x what {lt} implies (the weight -dL/dA the loss "
                      "gave the row vs tokens x loss_type's normaliser): every update is scaled, per row, by the "
                      "wrong amount." + consequence + _stage(c), f"The loss normalises as {lt} says." + _stage(c))
    return out


@rule("h03/kl_term_zero_with_beta", "h03/kl_term_without_beta", "h03/kl_beta_applied_ratio",
      "h03/loss_kl_env_token_share")
def _kl_acts(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    zero = max(values(m.get("h03/kl_term_zero_with_beta")), default=0.0)
    without = max(values(m.get("h03/kl_term_without_beta")), default=0.0)
    moved = max(values(m.get("h03/loss_kl_moved")), default=0.0)
    beta = params.get("loss.beta", "> 0")
    if zero >= 1:
        c = "kl_penalty_not_applied"
        out.append(Finding("h03", c, True, 3.5, f"A KL penalty is configured (loss.beta={beta}) and the policy has "
                           f"moved from its reference ({moved:.2g} nats/token), yet no KL term reaches the loss (no "
                           "gradient flows to the reference log-probs, or none reached it): beta is not forwarded."
                           + _stage(c), {"h03/kl_term_zero_with_beta (max)": zero, "h03/loss_kl_moved (max)": moved}))
    if without >= 1:
        c = "kl_penalty_without_beta"
        out.append(Finding("h03", c, True, 2.5, "loss.beta is 0, yet a KL term acts in the loss." + _stage(c),
                           {"h03/kl_term_without_beta (max)": without}))
    ratios = values(m.get("h03/kl_beta_applied_ratio"))
    if ratios and zero < 1:
        c = "kl_beta_not_as_configured"
        r = statistics.median(ratios)
        lo, hi = BETA_BAND
        off = abs(r - 1) / (hi - 1)
        out += judged("h03", c, not lo <= r <= hi, 3 + magnitude(1 + off), {"h03/kl_beta_applied_ratio (median)": r},
                      f"The KL term the loss applies is {r:.3g}x loss.beta={beta} (fit of its gradient on the "
                      "reference log-probs): the coefficient is not the configured one"
                      + (", and its sign is flipped" if r < 0 else "") + "." + _stage(c),
                      "The KL term acts with the configured beta." + _stage(c))
    env = max(values(m.get("h03/loss_kl_env_token_share")), default=None)
    if env is not None:
        c = "kl_on_env_tokens_in_loss"
        out += judged("h03", c, env > 0, 3 + magnitude(1 + 100 * env), {"h03/loss_kl_env_token_share (max)": env},
                      f"The loss's KL term reaches {env:.0%} of the tool/template tokens (its gradient on the "
                      "reference log-probs, by the rollout's token sources)." + _stage(c),
                      "The loss's KL term stays on the policy's tokens." + _stage(c))
    return out


@rule("h06/identical_group_expected_share")
def _sampling_diverse(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Identical groups over the run vs the count the sampler's own log-probs predict (Poisson)."""
    seen = dict(m.get("h06/identical_group_share") or [])
    pairs = [(seen[s], e) for s, e in (m.get("h06/identical_group_expected_share") or []) if s in seen]
    groups = max(1.0, float(params.get("train.prompts_per_step", 8) or 8))
    observed = round(sum(o for o, _ in pairs) * groups)
    expected = sum(e for _, e in pairs) * groups
    p = poisson_tail(observed, expected)
    c = "sampling_not_diverse"
    t = params.get("train.temperature", "> 0")
    ev = {"identical groups": float(observed), "identical groups expected": expected, "p": p}
    return judged("h06", c, observed >= IDENTICAL_MIN and p < IDENTICAL_P_MAX, 2 + magnitude(IDENTICAL_P_MAX / max(p, 1e-300)),
                  ev, f"{observed} groups held G identical completions where the sampler's own log-probs predict "
                  f"{expected:.2g} (Poisson p = {p:.1g}, train.temperature={t}): the sampler does not sample as "
                  "configured (greedy, or the temperature applied on one side only), so groups tie and carry no "
                  "signal." + _stage(c), "Groups are as diverse as the sampler's probabilities say." + _stage(c))


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


@rule("h05/scorer_overlap_disagreement_share")
def _scorers_agree(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    share = _mean(m, "h05/scorer_overlap_disagreement_share") or 0.0
    checked = sum(values(m.get("h05/scorer_overlap_checked")))
    c = "scorers_disagree_on_overlap"
    return judged("h05", c, share > OVERLAP_DISAGREEMENT_MAX, 3 + magnitude(1 + 100 * share),
                  {"h05/scorer_overlap_disagreement_share (mean)": share, "h05/scorer_overlap_checked (sum)": checked},
                  f"{share:.0%} of the episodes that cite every document they were shown score a lower citation "
                  "recall than retrieval recall: one of the two scorers reads other ids than the episode's "
                  "(another turn, another message)." + _stage(c),
                  "The citation and retrieval scorers agree where they overlap." + _stage(c))
