"""Stage "gradient": the gradient of the loss (TRL's `grad_norm`, before clipping; h01's zero gradient,
h08's spikes).

Field alarms (tier 1: symptoms with other possible causes) read the metric TRL itself logs, so the
same rule serves runs of plain TRL; a zero gradient while groups still differ is a proof (tier 3).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import H01_ZERO_STD_SHARE, TRL_FRAC_REWARD_ZERO_STD, TRL_GRAD_NORM
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import Finding, History, judged, magnitude, note, rule
from musique_rl.doctor.step import Kind

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


@rule(stage="gradient", checks={"gradient_not_finite": Kind.SYMPTOM, "gradient_zero": Kind.STARVED,
                            "gradient_spikes": Kind.SYMPTOM},
      starving=("gradient_zero",), reads=(TRL_GRAD_NORM, TRL_FRAC_REWARD_ZERO_STD, H01_ZERO_STD_SHARE),
      needs=(TRL_GRAD_NORM,),
      thresholds=("GRAD_SPIKE_FACTOR", "GRAD_SPIKE_HISTORY", "GRAD_SPIKE_MIN_STEPS", "GRAD_BASELINE_MIN_SHARE",
                  "GRAD_ZERO_SHARE", "TIED_EXPLAINS_SHARE"))
def _grad_norm(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    bad = [s for s, v in (m.get(TRL_GRAD_NORM) or []) if v is not None and not math.isfinite(v)]
    if bad:
        # A note, not a finding: a run that logs finite values after it survived the step (a skipped
        # overflow step, a scaler that backed off); one that does not shows it in every metric after.
        out.append(note("h08", "gradient_not_finite",
                        f"The gradient norm is NaN or infinite on {len(bad)} logged step(s) (first at step {bad[0]}): "
                        "those steps either were skipped or wrote non-finite values into the weights; look at the "
                        "loss and KL around them.", {"non-finite grad_norm steps": float(len(bad)),
                                                     "first non-finite step": float(bad[0])}))
    pts = [(s, v) for s, v in (m.get(TRL_GRAD_NORM) or []) if v is not None and math.isfinite(v)]
    if len(pts) < GRAD_SPIKE_HISTORY + 1:
        return out
    norms = [v for _, v in pts]
    zero_steps = [s for s, v in pts if v == 0]
    zero = len(zero_steps) / len(norms)
    if zero > GRAD_ZERO_SHARE:
        # On a step where every group tied (TRL's frac_reward_zero_std, or our h01/zero_std_share, = 1)
        # every advantage is 0, so a zero gradient there is the ties' consequence, not a broken graph:
        # ranked below the tied-groups finding (and its own cause), saying so.
        tied = {s for key in (TRL_FRAC_REWARD_ZERO_STD, H01_ZERO_STD_SHARE)
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
                               "unscaled adapter, an all-zero loss mask, or a detached graph).", ev,
                               measure=Measure("grad_norm zero share", zero, GRAD_ZERO_SHARE, exact=True, share=True)))
        return out
    spikes = []
    # A step on which every group tied has no gradient by construction: it is no baseline for a spike
    # (a run whose groups tie on most steps has a median near 0, and its few steps with signal would
    # all read as "spikes"). The baseline is the steps that had a group signal, where that is logged.
    tied = {s for key in (TRL_FRAC_REWARD_ZERO_STD, H01_ZERO_STD_SHARE)
            for s, v in (m.get(key) or []) if v is not None and v >= 1 - 1e-9}
    fed = [(s, v) for s, v in pts if s not in tied]
    fed_norms = [v for _, v in fed]
    baseline = GRAD_BASELINE_MIN_SHARE * statistics.median(fed_norms) if fed_norms else 0.0
    for i in range(GRAD_SPIKE_HISTORY, len(fed)):
        med = statistics.median(fed_norms[:i])
        if med > 0 and med >= baseline and fed_norms[i] > GRAD_SPIKE_FACTOR * med:
            spikes.append((fed[i][0], fed_norms[i] / med))
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
    measure = Measure("spike steps", float(len(spikes)), GRAD_SPIKE_MIN_STEPS - 1)
    return out + judged("h08", "gradient_spikes", bool(spikes), severity, ev, spiky, steady, measure)
