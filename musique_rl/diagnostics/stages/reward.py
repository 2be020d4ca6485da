"""Stage "reward": reward components and their scorers (h05)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.findings import Finding, History, magnitude, num, rule, values

# H05: share of audited episodes whose re-scored reward differs from the one the trainer used.
# Any difference is a defect (the reward is a function of the text); 5% tolerates one odd episode
# per 20 audited (a decode that does not round-trip) without hiding a systematic defect.
REWARD_AUDIT_MAX = 0.05
# H05: an answer component constant in >= 95% of groups, mean below 0.05, while over half of the
# episodes end with an answer, is not reading the answers
CONSTANT_SHARE = 0.95
ANSWER_PRESENT_MIN = 0.5
DEAD_MEAN = 0.05


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

