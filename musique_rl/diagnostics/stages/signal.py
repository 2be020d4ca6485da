"""Stage "signal": the spread of rewards inside a group and the advantages formed from it (h01, pre-flight)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.catalogue import AMPLIFICATION_MAX, key
from musique_rl.diagnostics.findings import Finding, History, magnitude, note, rule, values

# No signal: a step on which every group tied (h01/zero_std_share = 1, TRL's frac_reward_zero_std = 1)
# has every advantage exactly 0, so its gradient and update are 0 by construction. On at least 90%
# of the logged steps (and at least 2), the run learns nothing whatever its optimizer: a starving
# failure (chain.STARVING) whose consequences are the zero gradient, the missing update and the
# adapter that stays at 0. 1e-9 tolerates float round-off of the share.
NO_SIGNAL_STEP_SHARE = 0.9
TIED = 1 - 1e-9


def tied_steps(m: Mapping[str, History]) -> tuple[list[int], int, str] | None:
    """(steps on which every group tied, steps logged, the metric read) or None without one."""
    for k in (key("h01/zero_std_share"), key("frac_reward_zero_std")):
        pts = [(s, v) for s, v in (m.get(k) or []) if v is not None]
        if pts:
            return [s for s, v in pts if v >= TIED], len(pts), k
    return None


@rule(key("h01/zero_std_share"))
def _no_signal(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    got = tied_steps(m)
    if got is None:
        return []
    tied, n, k = got
    share = len(tied) / n
    ev = {f"steps with every group tied ({k} = 1)": float(len(tied)), "steps logged": float(n)}
    adv = values(m.get(key("h01/adv_abs_max")))
    if adv:
        ev["h01/adv_abs_max (max)"] = max(adv)
    if n >= 2 and share >= NO_SIGNAL_STEP_SHARE:
        return [Finding("h01", "no_signal", True, 3.0,
                        f"Every group tied on {len(tied)} of {n} steps: all G completions of each prompt earned the "
                        "same reward, so every advantage is 0 and the loss has no gradient to give, whatever the "
                        "learning rate. Find why the rewards do not differ within a group (the reward stage, or "
                        "the inputs: budgets, a task too hard or too easy at this group size).", ev, starves=True)]
    return []


@rule
def _amplification(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
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



@rule(key("preflight/signal_share_forecast"))
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
    got = tied_steps(m)
    if s < MIN_SIGNAL_SHARE and got is not None and got[1] >= 2 and len(got[0]) / got[1] >= NO_SIGNAL_STEP_SHARE:
        # the forecast came true: the measured finding (no_signal) says it, with the steps
        return [note("preflight", "learnability",
                     f"Pre-flight forecast only {s:.0%} of groups to carry signal at this group size, and it came "
                     "true: see no_signal.", ev)]
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

