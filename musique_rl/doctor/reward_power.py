"""Is the reward flat, or is the run too short to tell? The flat-reward finding, with its power.

A rule that judges the other rules' findings (``last=True``: after the withdrawals): a flat run with
nothing flagged is "too short to judge" or "flat reward, cause not found". (A flat run whose policy
barely moved is the update stage's finding, judged like every other check: stages/policy.py.)

Why the length matters: a flat run with no flagged instrument is not "flat reward, cause not found"
whatever its length. A 20-step run that gains +0.08 at p = 0.054 is not evidence of a hidden
defect: it is too short to judge. From the run's own length and reward noise this module states
the smallest gain the run could have detected, and how many steps would detect the gain it saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from musique_rl.doctor.findings import Finding, History, rule
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trend import FLAT_P, TOO_SHORT_P, Z_ALPHA, Z_POWER, reward_trend, too_short  # noqa: F401  (TOO_SHORT_P: a declared threshold)

# What a flat run with nothing flagged should try next: the sweeps that test the remaining causes.
NEXT_SWEEPS = "make sweep SWEEP=h08 (update size), SWEEP=h01 (advantage scaling), SWEEP=h05 (reward signal)"


def _flat(findings: Sequence[Finding], m: Mapping[str, History]) -> tuple[dict[str, float], dict[str, float]] | None:
    """(the reward's trend, its evidence) when nothing is flagged and the reward does not rise; else None."""
    if any(f.flagged for f in findings):
        return None
    t = reward_trend(m)
    if t is None or t["p_rise"] < FLAT_P:
        return None
    ev = {"reward slope per step": t["slope"], "p (reward rises)": t["p_rise"], "reward gain (fitted)": t["gain"],
          "detectable gain (80% power)": t["detectable_gain"], "reward (first quarter mean)": t["first"],
          "reward (last quarter mean)": t["last"]}
    return t, ev


@rule(stage="policy", checks={"too_short_to_judge": Kind.STARVED, "flat_reward_cause_not_found": Kind.STARVED},
      reads=reward_trend.reads, thresholds=("FLAT_P", "TOO_SHORT_P"), last=True)
def _flat_reward(findings: Sequence[Finding], m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """No silent 'clean' on a flat run: when nothing is flagged (the rule above included) and the
    reward does not rise, either "too short to judge" (a rise short of significance; not flagged) or
    "flat, cause not found"."""
    flat = _flat(findings, m)
    if flat is None:
        return []
    t, ev = flat
    if too_short(t):
        # The standard error of the fitted gain shrinks as 1/sqrt(steps): the steps at which the
        # observed gain would be (Z_ALPHA + Z_POWER) standard errors above 0.
        need = t["points"] * ((Z_ALPHA + Z_POWER) * t["gain_se"] / t["gain"]) ** 2
        ev["steps to detect this gain"] = need
        return [Finding("unexplained", "too_short_to_judge", False, 0.0,
                        f"Too short to judge: the reward rose {t['gain']:+.3f} over {t['points']:.0f} logged steps "
                        f"(p = {t['p_rise']:.2f} for a rise), short of significance; with this reward noise the run "
                        f"could only detect a gain of {t['detectable_gain']:.3f} (80% power at p < {FLAT_P}). About "
                        f"{need:.0f} steps would detect a gain this size. No instrument is out of bounds.", ev)]
    ruled_out = sorted({f.hypothesis for f in findings if f.check != "no_data"})
    return [Finding("unexplained", "flat_reward_cause_not_found", True, 0.5,
                    f"Flat reward, cause not found: the reward does not rise over {t['points']:.0f} logged steps "
                    f"({t['first']:.3f} -> {t['last']:.3f}, fitted gain {t['gain']:+.3f}, p = {t['p_rise']:.2f} for a "
                    f"rise), although a gain of {t['detectable_gain']:.3f} would have been detected (80% power), and "
                    f"no instrument is out of bounds. Ruled out: {', '.join(ruled_out) or 'nothing'} (their checks "
                    f"passed). Not ruled out: a policy whose pass@G is near its pass@1 (see preflight), and defects "
                    f"no instrument measures. Next: {NEXT_SWEEPS}.", ev)]
