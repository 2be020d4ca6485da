"""Tier-3 invariants: things that cannot happen in a correct pipeline, read where the loss consumes them.

Each is a proof, not a symptom: a sum that must be 0 is not, a sign that is fixed is wrong, a
quantity that must be 0 before the policy can move is not. Chosen from defects pipelines shipped
(docs/failure_modes.md, docs/diagnostics.md "Invariants"):

- advantages: TRL's group-relative advantages sum to 0 in each group and carry the sign of
  reward - group mean; rewards re-ordered or re-attached after grouping break both (a reward list
  zipped to the wrong samples after the advantage is formed, groups split across processes).
- rewards: components whose definitions overlap must agree (exact match implies F1 = 1; an F1
  lies between its precision and recall); a component constant in every group at every step
  carries no signal (reported, not flagged: a reward that is constant as a whole is TRL's
  frac_reward_zero_std, read by diagnostics/trl_rules.py).
- KL: before the first optimizer step the policy IS the reference (full fine-tuning loads a copy,
  PEFT disables the adapter), so the KL to it is 0 up to numerics; a larger one means the
  reference is another model (another checkpoint, dtype or adapter state: the silent reference
  mismatch verl and OpenRLHF users reported).
- updates: an optimizer step with a non-zero learning rate and gradient changes the weights, by at
  most what Adam at that learning rate can move them (h08/adam_step_ratio); no change, or a far
  larger one, means the step is not the configured optimizer's (parameters not in the optimizer,
  a frozen copy trained, weights written outside the optimizer).
The masks' invariant (the loss mask == the rollout's env_mask) is h02 env_tokens_in_loss and h03
kl_on_env_tokens in doctor.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.findings import Finding, History, judged, magnitude, num, rule, values

# |sum of a group's advantages| / (G x mean |advantage|): float32 round-off of a centred sum is
# ~1e-7; 1e-3 leaves four orders of magnitude for it.
ADV_GROUP_SUM_MAX = 1e-3
# Any advantage with the wrong sign is impossible (division by a positive std keeps the sign);
# 1% tolerates rewards within float round-off of their group mean.
ADV_SIGN_MISMATCH_MAX = 0.01
# Episodes whose overlapping components disagree: any is a defect; 1% tolerates one episode in a
# hundred with a decode quirk (the same tolerance as the reward audit's spirit, tighter).
COMPONENT_DISAGREEMENT_MAX = 0.01
# KL to the reference at the first step. k3 ~ d^2 / 2 for a per-token log-prob difference d, so
# 1e-3 needs d ~ 0.045 on average: 20x the bf16-vs-float32 floor measured on CPU (1.9e-3) and far
# above float32 (~1e-6); a reference that is another model is typically at 1e-2 and above.
KL_AT_START_MAX = 1e-3
# An optimizer step far beyond what Adam takes: |m/sqrt(v)| <= ~3 per element for default betas.
ADAM_STEP_MAX = 10.0


@rule("h01/adv_group_sum_rel_max", "h01/adv_sign_mismatch_share")
def _advantages_from_groups(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    sums = values(m.get("h01/adv_group_sum_rel_max"))
    signs = values(m.get("h01/adv_sign_mismatch_share"))
    worst_sum, worst_sign = max(sums, default=0.0), max(signs, default=0.0)
    ev = {"h01/adv_group_sum_rel_max (max)": worst_sum, "h01/adv_sign_mismatch_share (max)": worst_sign}
    bad = worst_sum > ADV_GROUP_SUM_MAX or worst_sign > ADV_SIGN_MISMATCH_MAX
    return judged("h01", "advantages_not_from_groups", bad,
                  3 + magnitude(max(worst_sum / ADV_GROUP_SUM_MAX, worst_sign / ADV_SIGN_MISMATCH_MAX)), ev,
                  f"The advantages the loss uses do not describe the groups' rewards: a group's advantages sum to "
                  f"{worst_sum:.2g} of their scale (must be 0) and {worst_sign:.0%} have the opposite sign of "
                  "reward - group mean. Rewards and completions are paired differently where the advantages are "
                  "formed than where they are logged (re-ordered, shifted, or grouped across processes).",
                  "Advantages sum to 0 in every group and follow the rewards' signs.")


@rule("h05/component_disagreement_share", "h05/answer_em/constant_group_share")
def _reward_components(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    dis = values(m.get("h05/component_disagreement_share"))
    if dis:
        d = statistics.fmean(dis)
        out += judged("h05", "components_disagree", d > COMPONENT_DISAGREEMENT_MAX,
                      3 + magnitude(d / COMPONENT_DISAGREEMENT_MAX), {"h05/component_disagreement_share (mean)": d},
                      f"In {d:.0%} of the episodes reward components contradict each other where their definitions "
                      "overlap (an exact match without F1 = 1, or an F1 outside its precision and recall): one of "
                      "them reads another text or parses differently.",
                      "Overlapping reward components agree.")
    comps = sorted({k.split("/")[1] for k in m if k.startswith("h05/") and k.endswith("/constant_group_share")})
    weighted = [c for c in comps if num(params, f"reward.weights.{c}", 1.0) != 0]
    const = [c for c in weighted if min(values(m.get(f"h05/{c}/constant_group_share")) or [0.0]) >= 1.0]
    if const:
        out.append(Finding("h05", "components_without_signal", False, 0.0,
                           f"Constant in every group at every step, so they carry no signal (they shift the reward, "
                           f"not the advantages): {', '.join(const)}.",
                           {f"h05/{c}/constant_group_share (min)": 1.0 for c in const}))
    return out


@rule("kl", "h03/kl_model_mean")
def _kl_at_start(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    key = "kl" if values(m.get("kl")) else "h03/kl_model_mean"
    first_step, first = next((s, v) for s, v in m[key] if v is not None)
    if num(params, "loss.beta", 1.0) == 0:
        return []
    ev = {f"{key} (first step)": first}
    when = "Before the first update"
    if first_step > 1:
        # a first row after updates: context.py withdraws the claim unless those updates cannot account for it
        from musique_rl.diagnostics.context import KL_PER_PEAK_STEP, update_budget_before

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
                  f"KL to the reference starts at {first:.2g}.")


@rule("h08/update_norm")
def _updates_apply(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    upd = dict(m.get("h08/update_norm") or [])
    lr = dict(m.get("h08/learning_rate") or [])
    grad = dict(m.get("h08/grad_norm_after_clip") or m.get("grad_norm") or [])
    idle = [s for s, u in upd.items() if u == 0 and lr.get(s, 0) > 0 and grad.get(s, 0) > 0]
    ratio = values(m.get("h08/adam_step_ratio"))
    big = max(ratio, default=0.0)
    ev = {"steps that changed nothing": float(len(idle)), "h08/adam_step_ratio (max)": big}
    if ratio:
        ev["h08/adam_step_ratio (median)"] = statistics.median(ratio)
    if idle:
        low = str(params.get("model.dtype", "")) in ("bfloat16", "float16")
        why = ("each step is below the precision of the bf16/fp16 weights, so rounding discards it (train with "
               "float32 master weights, or a larger learning rate), or the optimizer does not hold the parameters"
               if low else "the optimizer does not hold the parameters the loss differentiates (a copy, a "
               "re-wrapped model, parameters added after it was built)")
        return [Finding("h08", "step_changed_nothing", True, 3 + magnitude(1 + len(idle)),
                        f"{len(idle)} optimizer step(s) with a non-zero learning rate and gradient left every trained "
                        f"weight unchanged (first at step {min(idle)}): {why}.", ev)]
    return judged("h08", "step_larger_than_adam", big > ADAM_STEP_MAX, 3 + magnitude(big / ADAM_STEP_MAX), ev,
                  f"An optimizer step moved the weights {big:.3g}x as far as Adam at the logged learning rate can "
                  f"(at most ~3): the weights change outside the optimizer, or the learning rate applied is not "
                  "the one logged.",
                  "Every step with a gradient moved the weights, within Adam's reach "
                  f"(step / (lr x sqrt(n)) up to {big:.2g}).")
