"""Stage "signal": the spread of rewards inside a group and the advantages formed from it (h01, pre-flight)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    AMPLIFICATION_MAX,
    H01_ADV_ABS_MAX,
    H01_ADV_GROUP_SUM_REL_MAX,
    H01_ADV_SIGN_MISMATCH_SHARE,
    H01_AMPLIFICATION_MAX,
    H01_NEAR_TIE_ADV_SHARE,
    H01_NEAR_ZERO_STD_SHARE,
    H01_SIGNAL_GROUP_SHARE,
    H01_ZERO_STD_SHARE,
    MIN_SIGNAL_SHARE,
    PREFLIGHT_PASS_RATE_MEAN,
    PREFLIGHT_SIGNAL_SHARE_FORECAST,
    PREFLIGHT_ZERO_VARIANCE_FORECAST,
    TRL_FRAC_REWARD_ZERO_STD,
)
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import Finding, History, helper_reads, judged, magnitude, note, rule, values
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trl_rules import OURS, _ours

# No signal: a step on which every group tied (h01/zero_std_share = 1, TRL's frac_reward_zero_std = 1)
# has every advantage exactly 0, so its gradient and update are 0 by construction. On at least 90%
# of the logged steps (and at least 2), the run learns nothing whatever its optimizer: a starving
# failure (declared starving=) whose consequences are the zero gradient, the missing update and the
# adapter that stays at 0. 1e-9 tolerates float round-off of the share.
NO_SIGNAL_STEP_SHARE = 0.9
TIED = 1 - 1e-9


@helper_reads(H01_ZERO_STD_SHARE, TRL_FRAC_REWARD_ZERO_STD)
def tied_steps(m: Mapping[str, History]) -> tuple[list[int], int, str] | None:
    """(steps on which every group tied, steps logged, the metric read) or None without one."""
    for k in (H01_ZERO_STD_SHARE, TRL_FRAC_REWARD_ZERO_STD):
        pts = [(s, v) for s, v in (m.get(k) or []) if v is not None]
        if pts:
            return [s for s, v in pts if v >= TIED], len(pts), k
    return None


# ---------------------------------------------------------------- tier-3 invariant (a proof, not a symptom)
# advantages: TRL's group-relative advantages sum to 0 in each group and carry the sign of
# reward - group mean; rewards re-ordered or re-attached after grouping break both (a reward list
# zipped to the wrong samples after the advantage is formed, groups split across processes).
# |sum of a group's advantages| / (G x mean |advantage|): float32 round-off of a centred sum is
# ~1e-7; 1e-3 leaves four orders of magnitude for it.
ADV_GROUP_SUM_MAX = 1e-3
# Any advantage with the wrong sign is impossible (division by a positive std keeps the sign);
# 1% tolerates rewards within float round-off of their group mean.
ADV_SIGN_MISMATCH_MAX = 0.01


@rule(stage="signal", checks={"advantages_not_from_groups": Kind.DEFECT},
      reads=(H01_ADV_GROUP_SUM_REL_MAX, H01_ADV_SIGN_MISMATCH_SHARE),
      needs=(H01_ADV_GROUP_SUM_REL_MAX, H01_ADV_SIGN_MISMATCH_SHARE),
      thresholds=("ADV_GROUP_SUM_MAX", "ADV_SIGN_MISMATCH_MAX"))
def _advantages_from_groups(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    sums = values(m.get(H01_ADV_GROUP_SUM_REL_MAX))
    signs = values(m.get(H01_ADV_SIGN_MISMATCH_SHARE))
    worst_sum, worst_sign = max(sums, default=0.0), max(signs, default=0.0)
    ev = {f"{H01_ADV_GROUP_SUM_REL_MAX} (max)": worst_sum, f"{H01_ADV_SIGN_MISMATCH_SHARE} (max)": worst_sign}
    bad = worst_sum > ADV_GROUP_SUM_MAX or worst_sign > ADV_SIGN_MISMATCH_MAX
    # an exact invariant on every step: one step that breaks it is a proof
    measure = (Measure(f"{H01_ADV_GROUP_SUM_REL_MAX} (max)", worst_sum, ADV_GROUP_SUM_MAX, exact=True)
               if worst_sum / ADV_GROUP_SUM_MAX >= worst_sign / ADV_SIGN_MISMATCH_MAX else
               Measure(f"{H01_ADV_SIGN_MISMATCH_SHARE} (max)", worst_sign, ADV_SIGN_MISMATCH_MAX, exact=True, share=True))
    return judged("h01", "advantages_not_from_groups", bad,
                  3 + magnitude(max(worst_sum / ADV_GROUP_SUM_MAX, worst_sign / ADV_SIGN_MISMATCH_MAX)), ev,
                  f"The advantages the loss uses do not describe the groups' rewards: a group's advantages sum to "
                  f"{worst_sum:.2g} of their scale (must be 0) and {worst_sign:.0%} have the opposite sign of "
                  "reward - group mean. Rewards and completions are paired differently where the advantages are "
                  "formed than where they are logged (re-ordered, shifted, or grouped across processes).",
                  "Advantages sum to 0 in every group and follow the rewards' signs.", measure)


def starved_of_signal(got: tuple[list[int], int, str] | None) -> bool:
    """Whether ``tied_steps``' answer is the no-signal failure: every group tied on at least
    NO_SIGNAL_STEP_SHARE of the logged steps, and at least 2 logged."""
    return got is not None and got[1] >= 2 and len(got[0]) / got[1] >= NO_SIGNAL_STEP_SHARE


@rule(stage="signal", checks={"no_signal": Kind.SYMPTOM}, starving=("no_signal",),
      reads=(*tied_steps.reads, H01_ADV_ABS_MAX), needs=(H01_ZERO_STD_SHARE,),
      thresholds=("NO_SIGNAL_STEP_SHARE", "TIED"))
def _no_signal(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    got = tied_steps(m)
    if got is None:
        return []
    tied, n, k = got
    ev = {f"steps with every group tied ({k} = 1)": float(len(tied)), "steps logged": float(n)}
    adv = values(m.get(H01_ADV_ABS_MAX))
    if adv:
        ev[f"{H01_ADV_ABS_MAX} (max)"] = max(adv)
    measure = Measure(f"steps with every group tied ({k} = 1, share)", len(tied) / n, NO_SIGNAL_STEP_SHARE, share=True)
    if starved_of_signal(got):
        return [Finding("h01", "no_signal", True, 3.0,
                        f"Every group tied on {len(tied)} of {n} steps: all G completions of each prompt earned the "
                        "same reward, so every advantage is 0 and the loss has no gradient to give, whatever the "
                        "learning rate. Find why the rewards do not differ within a group (the reward stage, or "
                        "the inputs: budgets, a task too hard or too easy at this group size).", ev, starves=True,
                        measure=measure)]
    return [Finding("h01", "no_signal", False, 0.0, f"Some group carries signal on {n - len(tied)} of {n} steps.", ev,
                    measure=measure)]


# Amplification past the cap is judged over the run: on more than a tenth of the logged steps, and at
# least two of them (one step of float noise in one near-tied group proves nothing).
AMPLIFIED_STEP_SHARE = 0.1
AMPLIFIED_MIN_STEPS = 2


@rule(stage="signal", checks={"std_amplification": Kind.DEFECT},
      reads=(H01_AMPLIFICATION_MAX, H01_NEAR_ZERO_STD_SHARE, H01_NEAR_TIE_ADV_SHARE, H01_ADV_ABS_MAX),
      needs=(H01_AMPLIFICATION_MAX, H01_NEAR_ZERO_STD_SHARE),
      thresholds=("AMPLIFICATION_MAX", "AMPLIFIED_STEP_SHARE", "AMPLIFIED_MIN_STEPS"))
def _amplification(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    amp = values(m.get(H01_AMPLIFICATION_MAX))
    near = values(m.get(H01_NEAR_ZERO_STD_SHARE))
    if not amp and not near:
        return []
    ev = {
        f"{H01_AMPLIFICATION_MAX} (max)": max(amp, default=0.0),
        f"{H01_NEAR_ZERO_STD_SHARE} (mean)": statistics.fmean(near) if near else 0.0,
        f"{H01_NEAR_TIE_ADV_SHARE} (mean)": statistics.fmean(values(m.get(H01_NEAR_TIE_ADV_SHARE)) or [0.0]),
        f"{H01_ADV_ABS_MAX} (max)": max(values(m.get(H01_ADV_ABS_MAX)) or [0.0]),
    }
    worst = max(amp, default=0.0)
    steps = sum(a > AMPLIFICATION_MAX for a in amp)
    # a statistic over steps, not one step's value: the share of steps past the cap
    share = steps / len(amp) if amp else 0.0
    measure = Measure(f"steps with {H01_AMPLIFICATION_MAX} > {AMPLIFICATION_MAX:g} (share)", share, AMPLIFIED_STEP_SHARE,
                      share=True)
    if steps >= AMPLIFIED_MIN_STEPS and share > AMPLIFIED_STEP_SHARE:
        return [Finding("h01", "std_amplification", True, 2 + magnitude(worst / AMPLIFICATION_MAX),
                        f"Std scaling multiplied reward differences by up to {worst:.3g}x (TRL's epsilon caps it at "
                        f"{AMPLIFICATION_MAX:.0e}) on {steps} of {len(amp)} steps: near-tied groups whose rewards differ "
                        "by float noise get full-size advantages, so the gradient follows noise. Raise the std "
                        "epsilon or stop scaling by the group std (loss.scale_rewards=none).", ev, measure=measure)]
    return [Finding("h01", "std_amplification", False, 0.0,
                    f"Advantage scaling within bounds (max amplification {worst:.3g}x on {steps} of {len(amp)} steps); "
                    f"{ev[f'{H01_NEAR_ZERO_STD_SHARE} (mean)']:.0%} of groups are near-ties on average.", ev,
                    measure=measure)]



@rule(stage="signal", checks={"learnability": Kind.SYMPTOM},
      reads=(PREFLIGHT_PASS_RATE_MEAN, PREFLIGHT_ZERO_VARIANCE_FORECAST, PREFLIGHT_SIGNAL_SHARE_FORECAST,
             H01_SIGNAL_GROUP_SHARE, *tied_steps.reads),
      needs=(PREFLIGHT_SIGNAL_SHARE_FORECAST,), thresholds=("MIN_SIGNAL_SHARE",))
def _preflight(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    sig = values(m.get(PREFLIGHT_SIGNAL_SHARE_FORECAST))
    ev = {k: values(m.get(k))[0] for k in (PREFLIGHT_PASS_RATE_MEAN, PREFLIGHT_ZERO_VARIANCE_FORECAST,
                                           PREFLIGHT_SIGNAL_SHARE_FORECAST) if values(m.get(k))}
    s = sig[0]
    # The forecast is about answer correctness; a partial-credit reward can still spread inside a
    # group. Flag only when the reward actually trained on confirms it: few signal-carrying groups
    # over the first steps too.
    actual = values(m.get(H01_SIGNAL_GROUP_SHARE))[:5]
    if actual:
        ev[f"{H01_SIGNAL_GROUP_SHARE} (first steps)"] = statistics.fmean(actual)
    got = tied_steps(m)
    if s < MIN_SIGNAL_SHARE and starved_of_signal(got):
        # the forecast came true: the measured finding (no_signal) says it, with the steps
        return [note("preflight", "learnability",
                     f"Pre-flight forecast only {s:.0%} of groups to carry signal at this group size, and it came "
                     "true: see no_signal.", ev)]
    if s < MIN_SIGNAL_SHARE and (not actual or statistics.fmean(actual) < MIN_SIGNAL_SHARE):
        return [Finding("preflight", "learnability", True, 1 + magnitude(MIN_SIGNAL_SHARE / max(s, 1e-3)) / 2,
                        f"Pre-flight: only {s:.0%} of groups are forecast to carry learning signal at this group size "
                        f"(initial pass rate {ev.get(PREFLIGHT_PASS_RATE_MEAN, float('nan')):.2f}).", ev,
                        measure=Measure(PREFLIGHT_SIGNAL_SHARE_FORECAST, s, MIN_SIGNAL_SHARE, worse="below"))]
    if s < MIN_SIGNAL_SHARE:
        return [Finding("preflight", "learnability", False, 0.0,
                        f"Pre-flight: only {s:.0%} of groups forecast to carry answer signal, but the reward spreads "
                        f"in {ev[f'{H01_SIGNAL_GROUP_SHARE} (first steps)']:.0%} of groups (partial credit).", ev)]
    return [Finding("preflight", "learnability", False, 0.0,
                    f"Pre-flight: {s:.0%} of groups forecast to carry signal.", ev)]


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
# A group whose G rewards are equal has advantage 0 on every completion: it adds no gradient. When
# most groups carry none, the batch's gradient comes from a few groups (or none): learning stalls
# whatever the optimizer does. Half is the point where most of the compute trains nothing.
ZERO_STD_MAX = 0.5
# ... and at 95% on average the batch's gradient is ~0: the update, the adapter and the policy
# change downstream are this finding's consequences, not separate causes (doctor/chain.py)
ZERO_STD_STARVES = 0.95


@rule(stage="signal", checks={"zero_variance_groups": Kind.SYMPTOM},
      reads=(TRL_FRAC_REWARD_ZERO_STD, *OURS["zero_variance"]),
      needs=(TRL_FRAC_REWARD_ZERO_STD,), thresholds=("ZERO_STD_MAX", "ZERO_STD_STARVES"))
def _zero_variance(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "zero_variance"):
        return []
    z = values(m.get(TRL_FRAC_REWARD_ZERO_STD))
    share = statistics.fmean(z)
    ev = {"frac_reward_zero_std (mean)": share, "frac_reward_zero_std (first)": z[0], "frac_reward_zero_std (last)": z[-1]}
    measure = Measure("frac_reward_zero_std (mean)", share, ZERO_STD_MAX, share=True)
    if share <= ZERO_STD_MAX:
        return [Finding("preflight", "zero_variance_groups", False, 0.0,
                        f"{share:.0%} of groups have equal rewards on average: most groups carry signal.", ev,
                        measure=measure)]
    # (nearly) every group tied on (nearly) every step: nothing reaches the gradient (this finding starves: Finding.starves)
    starves = share >= ZERO_STD_STARVES
    return [Finding("preflight", "zero_variance_groups", True, 2 + magnitude(share / ZERO_STD_MAX),
                    f"{share:.0%} of groups have identical rewards for all their completions (TRL's "
                    "frac_reward_zero_std): their advantages are 0, so they add no gradient. Unless a finding upstream "
                    "explains it (truncation, a constant reward), the task is too hard or too easy for this policy at "
                    "this group size (pass@G near 0 or 1), or the reward cannot tell completions apart: run "
                    "musique_rl's pre-flight (learnability forecast) or `+hypothesis=h05` (reward audit) to decide.",
                    ev, starves=starves, measure=measure)]
