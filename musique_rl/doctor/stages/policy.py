"""Stage "policy change": does the policy move from where it started (KL to the start, TRL's `kl`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    H01_REWARD_STD_MEAN,
    H08_GRAD_NORM_BEFORE_CLIP,
    H08_KL_TO_START,
    TRL_ENTROPY,
    TRL_GRAD_NORM,
    TRL_KL,
    TRL_LEARNING_RATE,
    TRL_REWARD,
)
from musique_rl.doctor.context import schedule
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import (
    Finding,
    History,
    helper_reads,
    judged,
    magnitude,
    num,
    rule,
    values,
)
from musique_rl.doctor.stages.signal import tied_steps
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trend import FLAT_P, TOO_SHORT_P, flat, reward_trend  # noqa: F401  (declared thresholds)
from musique_rl.doctor.trl_rules import OURS, _ours

# The policy has not moved when its KL to the start stays at most 1e-6 nats/token on every probe
# taken at the scheduled learning rate: a healthy step moves it ~1e-4..1e-3 per step (the tiny
# model: 0.02 after 10 steps), and float32 round-off of two forward passes of the same weights is
# ~1e-7. Judged only on probes at >= half the peak learning rate (context.LR_JUDGED_SHARE), after
# at least one update at that rate.
KL_STILL_MAX = 1e-6


def _still(m: Mapping[str, History], params: Mapping[str, str], name: str) -> list[Finding]:
    pts = [(s, v) for s, v in (m.get(name) or []) if v is not None]
    judged_steps = schedule(m, params).judged_steps()
    if judged_steps is None:
        return []
    at_rate = [(s, v) for s, v in pts if s in judged_steps and any(j < s for j in judged_steps)]
    if not at_rate:
        return []
    worst = max(v for _, v in at_rate)
    med = statistics.median(v for _, v in at_rate)
    ev = {f"{name} (max, steps at the scheduled rate)": worst, f"{name} (median, steps at the scheduled rate)": med,
          "probes judged": float(len(at_rate))}
    # "has not moved at all" (every probe at round-off) is this check; "has moved too little for the
    # reward to move" is policy_barely_moves' (KL_MOVED_MIN): the ok words say which bar was passed
    little = (f", but its median {med:.2g} stays below the {KL_MOVED_MIN:g} that runs which learn pass"
              if med < KL_MOVED_MIN else "")
    return judged("h08", "policy_still", worst <= KL_STILL_MAX, 2.5, ev,
                  f"The policy has not moved: its KL to the starting policy is at most {worst:.2g} nats/token on "
                  f"{len(at_rate)} probe(s) taken after updates at the scheduled learning rate (a healthy step "
                  "moves it ~1e-4 or more).",
                  f"The policy is not frozen: its KL to the start reaches {worst:.2g} nats/token (above the "
                  f"{KL_STILL_MAX:g} of a policy that never moved){little}.",
                  Measure(f"{name} (max, steps at the scheduled rate)", worst, KL_STILL_MAX, worse="below", exact=True, log=True))


# ---------------------------------------------------------------- field alarms (tier 1: other causes possible)
# Entropy collapse: TRL's `entropy` (mean per-token entropy of the policy on its completions, nats).
# Sampling G completions of a prompt teaches only while they differ; a policy whose entropy fell
# below a quarter of its starting level within the run has stopped exploring (DAPO's clip-higher
# motivation; groups tie, std -> 0). A quarter: the healthy tiny runs move within 0.7-1.3x of their start.
ENTROPY_COLLAPSE_RATIO = 0.25
# Within-group spread falling before the mean rises: h01/reward_std_mean (mean over groups of the
# reward std inside a group) in the last quarter below half its first-quarter level while the
# reward has not risen: the policy converges to one answer per prompt before it gets better, so the
# groups that remain teach nothing (the collapse precedes the plateau).
SPREAD_FALL_RATIO = 0.5
MIN_POINTS = 8  # fewer logged steps than this: no trend is judged


def _quarters(xs: list[float]) -> tuple[float, float]:
    q = max(2, len(xs) // 4)
    return statistics.fmean(xs[:q]), statistics.fmean(xs[-q:])



@rule(stage="policy", checks={"entropy_collapse": Kind.SYMPTOM}, reads=(TRL_ENTROPY,), needs=(TRL_ENTROPY,),
      thresholds=("ENTROPY_COLLAPSE_RATIO", "MIN_POINTS"))
def _entropy_collapse(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    ent = values(m.get(TRL_ENTROPY))
    if len(ent) < MIN_POINTS:
        return []
    first, last = _quarters(ent)
    ev = {"entropy (first quarter mean)": first, "entropy (last quarter mean)": last}
    ratio = last / first if first > 0 else 1.0
    measure = Measure("entropy (last / first quarter)", ratio, ENTROPY_COLLAPSE_RATIO, worse="below", log=True)
    return judged("h01", "entropy_collapse", first > 0 and ratio < ENTROPY_COLLAPSE_RATIO,
                  1 + magnitude(ENTROPY_COLLAPSE_RATIO / max(ratio, 1e-9)), ev,
                  f"The policy's entropy fell from {first:.3g} to {last:.3g} nats/token ({ratio:.0%} of its start, "
                  f"alarm below {ENTROPY_COLLAPSE_RATIO:.0%}): the completions of a prompt become the same, groups "
                  "tie and the learning signal goes with them (raise the temperature, loss.epsilon_high, or beta).",
                  f"Entropy holds ({first:.3g} -> {last:.3g} nats/token).", measure)


@rule(stage="policy", checks={"spread_falls_first": Kind.SYMPTOM},
      reads=(H01_REWARD_STD_MEAN, TRL_REWARD, *reward_trend.reads), needs=(H01_REWARD_STD_MEAN,),
      thresholds=("SPREAD_FALL_RATIO", "MIN_POINTS"))
def _spread_falls(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    spread = values(m.get(H01_REWARD_STD_MEAN))
    reward = values(m.get(TRL_REWARD))
    if len(spread) < MIN_POINTS or len(reward) < MIN_POINTS:
        return []
    s0, s1 = _quarters(spread)
    r0, r1 = _quarters(reward)
    t = reward_trend(m)
    rising = t is not None and t["p_rise"] < 0.05
    ev = {f"{H01_REWARD_STD_MEAN} (first quarter)": s0, f"{H01_REWARD_STD_MEAN} (last quarter)": s1,
          "reward (first quarter)": r0, "reward (last quarter)": r1}
    fell = s0 > 0 and s1 < SPREAD_FALL_RATIO * s0
    settling = (f"The reward spread inside groups fell from {s0:.3g} to {s1:.3g} while the mean reward did not "
                f"rise ({r0:.3f} -> {r1:.3f}): the policy settles on one answer per prompt before it gets better, "
                "so fewer groups carry signal each step. A plateau follows.")
    severity = 1 + magnitude(SPREAD_FALL_RATIO * s0 / max(s1, 1e-9))
    measure = Measure(f"{H01_REWARD_STD_MEAN} (last / first quarter)", s1 / s0 if s0 > 0 else 1.0, SPREAD_FALL_RATIO,
                      worse="below", log=True)
    return judged("h01", "spread_falls_first", fell and not rising, severity, ev, settling,
                  f"Within-group reward spread {s0:.3g} -> {s1:.3g}.", measure)


@rule(stage="policy", checks={"policy_still": Kind.STARVED}, reads=(H08_KL_TO_START, *schedule.reads),
      needs=(H08_KL_TO_START,), thresholds=("KL_STILL_MAX",))
def _kl_to_start(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    return _still(m, params, H08_KL_TO_START)


@helper_reads(TRL_KL, TRL_GRAD_NORM, TRL_LEARNING_RATE)
def trl_kl_measured(m: Mapping[str, History], params: Mapping[str, str]) -> bool:
    """Whether TRL's `kl` measures anything: TRL computes it only with beta != 0, and some versions
    log 0.0 without computing it. Exactly 0 on every step while the gradient and the learning rate
    are not 0 cannot be a measurement (any update moves the policy off its reference), so it is read
    as "not computed" rather than as a policy that never moved."""
    if num(params, "beta", num(params, "loss.beta", 1.0)) == 0:
        return False
    kl = values(m.get(TRL_KL))
    if not kl or any(v != 0 for v in kl):
        return bool(kl)
    grads = values(m.get(TRL_GRAD_NORM))
    lrs = values(m.get(TRL_LEARNING_RATE))
    moved_by_optimizer = not grads or (statistics.median(grads) > 0 and (not lrs or max(lrs) > 0))
    return not moved_by_optimizer


@rule(stage="policy", checks={"policy_still": Kind.STARVED},
      reads=(H08_KL_TO_START, *trl_kl_measured.reads, *schedule.reads), needs=(TRL_KL,), thresholds=("KL_STILL_MAX",))
def _trl_kl(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """TRL's `kl` is the KL to the reference, which is the starting policy unless the run says otherwise."""
    if m.get(H08_KL_TO_START) or not trl_kl_measured(m, params):
        return []
    return _still(m, params, TRL_KL)


# A flat run whose policy has moved less than this from its start (KL, nats/token, the largest logged
# at the scheduled learning rate) has not yet changed what it samples enough for the reward to move.
# Runs that learn get past it: the two healthy public TRL logs whose reward rose reached 0.02 by their
# end (gemma3_gsm8k, unsloth_gsm8k, 250 steps each), this project's tiny default job 0.02 after 10
# steps; a flat run with truncated completions (chaos_economy) moved 0.047, so a policy that moves
# and stays flat is another story ("cause not found"). Below 0.01, with a gradient on most steps,
# the update is where the run stops.
KL_MOVED_MIN = 0.01
# "Most groups carry signal": at most half of the groups tie on the average step (below that the
# signal stage's own checks speak: zero_variance_groups, no_signal).
TIED_SHARE_MAX = 0.5


@helper_reads(H08_KL_TO_START, *trl_kl_measured.reads)
def kl_history(m: Mapping[str, History], params: Mapping[str, str]) -> tuple[str, list[tuple[int, float]]] | None:
    """(name, history) of the run's KL to its start: ours (h08/kl_to_start), else TRL's `kl` when
    it was measured (beta > 0 and not 0 on every step: TRL logs 0 when it computes no KL)."""
    ours = [(s, v) for s, v in (m.get(H08_KL_TO_START) or []) if v is not None]
    if ours:
        return H08_KL_TO_START, ours
    trl = [(s, v) for s, v in (m.get(TRL_KL) or []) if v is not None]
    if trl and trl_kl_measured(m, params):
        return TRL_KL, trl
    return None


@rule(stage="update", checks={"policy_barely_moves": Kind.SYMPTOM},
      reads=(*kl_history.reads, *tied_steps.reads, *schedule.reads, *reward_trend.reads, TRL_GRAD_NORM,
             H08_GRAD_NORM_BEFORE_CLIP),
      thresholds=("KL_MOVED_MIN", "TIED_SHARE_MAX", "FLAT_P", "TOO_SHORT_P"))
def _barely_moves(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """A flat run whose groups carry signal and whose steps have a gradient, yet whose policy hardly
    left its start: the update is where it stops. Judged on every flat run, whatever else is flagged
    (the chain decides what explains what), from statistics over the steps at the scheduled rate: the
    median KL, not its largest step (one step of 0.08 in a run whose KL sits at 0.0016 does not make
    the policy move), and the share of tied groups on the average step."""
    t = reward_trend(m)
    kl = kl_history(m, params)
    got = tied_steps(m)
    if not flat(t) or kl is None or got is None or got[1] < 2:
        return []
    name, pts = kl
    tied_share = statistics.fmean(v for _, v in (m.get(got[2]) or []) if v is not None)
    judged_steps = schedule(m, params).judged_steps()
    at_rate = [v for s, v in pts if judged_steps is None or s in judged_steps]
    grads = [g for g in (values(m.get(TRL_GRAD_NORM)) or values(m.get(H08_GRAD_NORM_BEFORE_CLIP))) if math.isfinite(g)]
    if len(at_rate) < 3 or tied_share > TIED_SHARE_MAX or (grads and statistics.median(grads) == 0):
        return []
    moved = statistics.median(at_rate)
    beta = num(params, "beta", num(params, "loss.beta", -1.0))
    ev = {f"{name} (median, steps at the scheduled rate)": moved, f"{name} (max, steps at the scheduled rate)": max(at_rate),
          f"{name} (last)": pts[-1][1], f"{got[2]} (mean)": tied_share, "steps judged": float(len(at_rate)),
          "reward gain (fitted)": t["gain"], "p (reward rises)": t["p_rise"]}
    if grads:
        ev["grad_norm (median)"] = statistics.median(grads)
    held = f" (or lower beta {beta:g}, if the KL penalty holds it back)" if beta > 0 else ""
    measure = Measure(f"{name} (median, steps at the scheduled rate)", moved, KL_MOVED_MIN, worse="below", log=True)
    return judged("h08", "policy_barely_moves", moved < KL_MOVED_MIN, 1.5, ev,
                  f"The reward is flat over {t['points']:.0f} logged steps although {1 - tied_share:.0%} of the groups "
                  f"carry signal and the steps have a gradient, and the policy has barely moved: its KL to the start "
                  f"sits at a median of {moved:.2g} nats/token over {len(at_rate)} steps at the scheduled rate (runs "
                  f"that learn pass {KL_MOVED_MIN:g}). The updates are too small to change what the policy samples: "
                  f"raise the learning rate{held} (make sweep SWEEP=h08).",
                  f"The reward is flat, and the policy moves: its KL to the start sits at a median of {moved:.2g} "
                  f"nats/token (past the {KL_MOVED_MIN:g} of runs that learn): the update is not where it stops.",
                  measure)


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
# KL to the reference (TRL's `kl`, logged when beta > 0), nats per token. Healthy GRPO runs stay
# around 1e-3..1e-1 per token; 1.0 means the policy gives its reference's tokens e^-1 of their
# probability on average: the KL term no longer holds it. Growth alone (x10 from the first quarter)
# is normal early in a run, so runaway needs both. TRL's k3 estimator is >= 0 for every token: a
# negative mean is a sign error (tier 3), not noise beyond KL_NEGATIVE_TOL.
KL_RUNAWAY = 1.0
KL_GROWTH = 10.0
KL_NEGATIVE_TOL = -1e-6


def _kl_quarters(kl: list[float]) -> tuple[float, float, dict[str, float]]:
    q = max(1, len(kl) // 4)
    early, late = statistics.fmean(kl[:q]), statistics.fmean(kl[-q:])
    return early, late, {f"{TRL_KL} (first quarter mean)": early, f"{TRL_KL} (last quarter mean)": late,
                         f"{TRL_KL} (min)": min(kl)}


@rule(stage="loss", checks={"kl_negative": Kind.DEFECT}, reads=(TRL_KL, *OURS["kl"]), needs=(TRL_KL,),
      thresholds=("KL_NEGATIVE_TOL",))
def _kl_negative(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """A sign error of the KL term, read from TRL's `kl` (a loss-stage defect, here beside the runaway
    rule that reads the same history). Judged on the run's mean: each token's k3 is >= 0, but a logged
    step's mean of them can sit a few 1e-5 below 0 in float round-off (k3 of a tiny difference is
    exp(d) - d - 1, computed from numbers near 1), so one step's value proves nothing; a run whose KL
    is negative on average is a term with the wrong sign."""
    if _ours(m, "kl"):
        return []
    kl = values(m.get(TRL_KL))
    mean = statistics.fmean(kl)
    ev = {**_kl_quarters(kl)[2], f"{TRL_KL} (mean)": mean,
          f"{TRL_KL} < 0 (share of steps)": sum(v < KL_NEGATIVE_TOL for v in kl) / len(kl)}
    return judged("h03", "kl_negative", mean < KL_NEGATIVE_TOL, 3 + magnitude(1 + abs(mean) / abs(KL_NEGATIVE_TOL)), ev,
                  f"TRL's KL estimate is negative on average over the run ({mean:.3g}); its k3 estimator cannot be "
                  "below 0 for any token, so the KL term's sign or its inputs are wrong.",
                  f"TRL's KL estimate is non-negative on average ({mean:.2g}).",
                  Measure(f"{TRL_KL} (mean, sign)", -mean, -KL_NEGATIVE_TOL, exact=True))


@rule(stage="policy", checks={"kl_runaway": Kind.SYMPTOM}, reads=(TRL_KL, *OURS["kl"]), needs=(TRL_KL,),
      thresholds=("KL_RUNAWAY", "KL_GROWTH"))
def _kl_runaway(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "kl"):
        return []
    kl = values(m.get(TRL_KL))
    early, late, ev = _kl_quarters(kl)
    runaway = late > KL_RUNAWAY and late > KL_GROWTH * max(early, 1e-12)
    return judged("h03", "kl_runaway", runaway, 2 + magnitude(late / KL_RUNAWAY), ev,
                  f"KL to the reference runs away: {early:.3g} -> {late:.3g} nats/token. The policy has left its "
                  "reference (reward hacking, or a learning rate too high for beta); TRL's log cannot say which "
                  "tokens: run `+hypothesis=h03` (KL per token kind).",
                  f"KL to the reference stays moderate ({early:.2g} -> {late:.2g} nats/token).",
                  Measure(f"{TRL_KL} (last quarter mean)", late, KL_RUNAWAY, log=True))
