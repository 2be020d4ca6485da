"""Field alarms: symptoms a long run shows before its reward says anything (tier 1: other causes possible).

Each reads the metric TRL itself logs where TRL logs one (``entropy``, ``grad_norm``), so the same
rule serves runs of plain TRL; the within-group reward spread and void turns come from this
project's instruments (``h01/reward_std_mean``, ``h07/void_episode_share``). The flat-reward
finding with its statistical power is in ``reward_power`` (the doctor calls it after every rule).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.findings import Finding, History, judged, magnitude, note, rule, values

# Entropy collapse: TRL's `entropy` (mean per-token entropy of the policy on its completions, nats).
# Sampling G completions of a prompt teaches only while they differ; a policy whose entropy fell
# below a quarter of its starting level within the run has stopped exploring (DAPO's clip-higher
# motivation; groups tie, std -> 0). A quarter: the healthy tiny runs move within 0.7-1.3x of their start.
ENTROPY_COLLAPSE_RATIO = 0.25
# Gradient-norm spikes: TRL's `grad_norm` (pre-clip). A step more than 10x the median of the
# steps before it is one batch dominating the update (a ratio blow-up, a reward outlier, an
# unmasked token with a huge log-prob); healthy runs stay within ~3x of their median.
GRAD_SPIKE_FACTOR = 10.0
GRAD_SPIKE_HISTORY = 5  # steps of history before a spike can be judged
# ... and only recurring spikes are a finding: healthy runs show isolated ones (the default float32
# job on an H200, f87b655: one step at 13.6x; a healthy public TRL run: one at 12.5x), so one or
# two spike steps are a note. Three in one run is a pattern no healthy run here has shown.
GRAD_SPIKE_MIN_STEPS = 3
# A median of the earlier steps below a tenth of the whole run's median is not a baseline (a run
# whose first steps have ~0 gradient, e.g. every group tied early): no spike is measured against it.
GRAD_BASELINE_MIN_SHARE = 0.1
# Zero gradient: more than half of the steps with a gradient norm of exactly 0 (with a logged
# non-zero learning rate or without one): the loss does not depend on the weights (every group
# tied, a detached graph, an all-zero loss mask).
GRAD_ZERO_SHARE = 0.5
# gradient_zero is the tied groups' consequence when at least this share of its zero-gradient steps had
# every group tied (advantages all 0); below it something else zeroes the gradient
TIED_EXPLAINS_SHARE = 0.9
# Within-group spread falling before the mean rises: h01/reward_std_mean (mean over groups of the
# reward std inside a group) in the last quarter below half its first-quarter level while the
# reward has not risen: the policy converges to one answer per prompt before it gets better, so the
# groups that remain teach nothing (the collapse precedes the plateau).
SPREAD_FALL_RATIO = 0.5
# Void turns: an assistant turn with neither a tool call nor an answer ends the episode
# (stop_reason no_tool_call). The warm-started tiny policy has ~8% such episodes before training;
# above a quarter of the episodes in the last quarter of the run, the policy or the tool-call
# parser has stopped producing actions (a format the parser does not read, a chatty collapse).
VOID_EPISODE_MAX = 0.25
MIN_POINTS = 8  # fewer logged steps than this: no trend is judged


def _quarters(xs: list[float]) -> tuple[float, float]:
    q = max(2, len(xs) // 4)
    return statistics.fmean(xs[:q]), statistics.fmean(xs[-q:])


@rule("entropy")
def _entropy_collapse(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    ent = values(m.get("entropy"))
    if len(ent) < MIN_POINTS:
        return []
    first, last = _quarters(ent)
    ev = {"entropy (first quarter mean)": first, "entropy (last quarter mean)": last}
    ratio = last / first if first > 0 else 1.0
    return judged("h01", "entropy_collapse", first > 0 and ratio < ENTROPY_COLLAPSE_RATIO,
                  1 + magnitude(ENTROPY_COLLAPSE_RATIO / max(ratio, 1e-9)), ev,
                  f"The policy's entropy fell from {first:.3g} to {last:.3g} nats/token ({ratio:.0%} of its start, "
                  f"alarm below {ENTROPY_COLLAPSE_RATIO:.0%}): the completions of a prompt become the same, groups "
                  "tie and the learning signal goes with them (raise the temperature, loss.epsilon_high, or beta).",
                  f"Entropy holds ({first:.3g} -> {last:.3g} nats/token).")


@rule("grad_norm")
def _grad_norm(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    bad = [s for s, v in (m.get("grad_norm") or []) if v is not None and not math.isfinite(v)]
    if bad:
        # A note, not a finding: a run that logs finite values after it survived the step (a skipped
        # overflow step, a scaler that backed off); one that does not shows it in every metric after.
        out.append(note("h08", "gradient_not_finite",
                        f"The gradient norm is NaN or infinite on {len(bad)} logged step(s) (first at step {bad[0]}): "
                        "those steps either were skipped or wrote non-finite values into the weights; look at the "
                        "loss and KL around them.", {"non-finite grad_norm steps": float(len(bad)),
                                                     "first non-finite step": float(bad[0])}))
    pts = [(s, v) for s, v in (m.get("grad_norm") or []) if v is not None and math.isfinite(v)]
    if len(pts) < GRAD_SPIKE_HISTORY + 1:
        return out
    norms = [v for _, v in pts]
    zero_steps = [s for s, v in pts if v == 0]
    zero = len(zero_steps) / len(norms)
    if zero > GRAD_ZERO_SHARE:
        # On a step where every group tied (TRL's frac_reward_zero_std, or our h01/zero_std_share, = 1)
        # every advantage is 0, so a zero gradient there is the ties' consequence, not a broken graph:
        # ranked below the tied-groups finding (and its own cause), saying so.
        tied = {s for key in ("frac_reward_zero_std", "h01/zero_std_share")
                for s, v in (m.get(key) or []) if v is not None and v >= 1 - 1e-9}
        explained = sum(s in tied for s in zero_steps) / len(zero_steps)
        ev = {"grad_norm zero share": zero, "zero-gradient steps with every group tied (share)": explained}
        if explained >= TIED_EXPLAINS_SHARE:
            out.append(Finding("h01", "gradient_zero", True, 0.9,
                               f"The gradient norm is exactly 0 on {zero:.0%} of the steps. A consequence of tied "
                               f"groups: on {explained:.0%} of those steps every group's rewards were equal, so every "
                               "advantage was 0 (see the tied-groups finding and its cause).", ev))
        else:
            # A proof, not a symptom (tier 3): a group whose rewards differ has non-zero advantages, and at
            # the sampled policy (ratio 1, inside any clip) their policy-gradient term cannot vanish, so a
            # gradient of exactly 0 means the loss does not reach the trained weights. Ranked above findings
            # that only cap part of the reward (truncation): fixing those cannot make a zero gradient train.
            out.append(Finding("h01", "gradient_zero", True, 3 + magnitude(zero / GRAD_ZERO_SHARE * 10),
                               f"The gradient norm is exactly 0 on {zero:.0%} of the steps while groups still differ "
                               f"in reward (on {1 - explained:.0%} of those steps at least one group had a spread, so "
                               "non-zero advantages): the loss does not depend on the trained weights (a frozen or "
                               "unscaled adapter, an all-zero loss mask, or a detached graph).", ev))
        return out
    spikes = []
    baseline = GRAD_BASELINE_MIN_SHARE * statistics.median(norms)
    for i in range(GRAD_SPIKE_HISTORY, len(pts)):
        med = statistics.median(norms[:i])
        if med > 0 and med >= baseline and norms[i] > GRAD_SPIKE_FACTOR * med:
            spikes.append((pts[i][0], norms[i] / med))
    ev = {"grad_norm (median)": statistics.median(norms), "grad_norm (max)": max(norms),
          "spike steps": float(len(spikes))}
    worst_step, worst = max(spikes, key=lambda sv: sv[1]) if spikes else (0, 0.0)
    if spikes:
        ev["worst spike (x median before it)"] = worst
        ev["worst spike step"] = float(worst_step)
    spiky = (f"{len(spikes)} step(s) with a gradient norm over {GRAD_SPIKE_FACTOR:g}x the median of the steps before "
             f"(worst {worst:.3g}x at step {worst_step:.0f}): single batches dominate the updates (an importance "
             "ratio blow-up, a reward outlier, or tokens that should be masked).")
    steady = f"Gradient norms steady (max {max(norms):.3g}, median {statistics.median(norms):.3g})."
    severity = 1 + magnitude(worst / GRAD_SPIKE_FACTOR)
    if 0 < len(spikes) < GRAD_SPIKE_MIN_STEPS:
        return out + [note("h08", "gradient_spikes",
                           f"{len(spikes)} isolated step(s) with a gradient norm over {GRAD_SPIKE_FACTOR:g}x the median "
                           f"of the steps before (worst {worst:.3g}x at step {worst_step:.0f}). Healthy runs show one "
                           f"or two such steps; {GRAD_SPIKE_MIN_STEPS} or more would be a finding.", ev)]
    return out + judged("h08", "gradient_spikes", bool(spikes), severity, ev, spiky, steady)


@rule("h01/reward_std_mean")
def _spread_falls(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    spread = values(m.get("h01/reward_std_mean"))
    reward = values(m.get("reward"))
    if len(spread) < MIN_POINTS or len(reward) < MIN_POINTS:
        return []
    s0, s1 = _quarters(spread)
    r0, r1 = _quarters(reward)
    from musique_rl.diagnostics.reward_power import reward_trend

    t = reward_trend(m)
    rising = t is not None and t["p_rise"] < 0.05
    ev = {"h01/reward_std_mean (first quarter)": s0, "h01/reward_std_mean (last quarter)": s1,
          "reward (first quarter)": r0, "reward (last quarter)": r1}
    fell = s0 > 0 and s1 < SPREAD_FALL_RATIO * s0
    settling = (f"The reward spread inside groups fell from {s0:.3g} to {s1:.3g} while the mean reward did not "
                f"rise ({r0:.3f} -> {r1:.3f}): the policy settles on one answer per prompt before it gets better, "
                "so fewer groups carry signal each step. A plateau follows.")
    severity = 1 + magnitude(SPREAD_FALL_RATIO * s0 / max(s1, 1e-9))
    return judged("h01", "spread_falls_first", fell and not rising, severity, ev, settling,
                  f"Within-group reward spread {s0:.3g} -> {s1:.3g}.")


@rule("h07/void_episode_share")
def _void_turns(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    void = values(m.get("h07/void_episode_share"))
    q = max(1, len(void) // 4)
    last = statistics.fmean(void[-q:])
    ev = {"h07/void_episode_share (first)": void[0], "h07/void_episode_share (last quarter)": last,
          "h07/void_turn_share (last)": (values(m.get("h07/void_turn_share")) or [0.0])[-1]}
    return judged("h07", "void_turns", last > VOID_EPISODE_MAX, 1 + magnitude(last / VOID_EPISODE_MAX), ev,
                  f"{last:.0%} of the episodes (last quarter of the run) end in a void turn, neither a tool call nor "
                  "an answer: the policy writes text the tool-call parser does not read, or has collapsed into "
                  "chatter (check model.tool_call_format against what the model writes).",
                  f"Void turns: {last:.0%} of episodes in the last quarter.")
