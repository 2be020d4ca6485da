"""Stage "update": the learning-rate schedule, the optimizer step and the adapter's parameters (h08,
h06's adapter and frozen-base checks)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace

from musique_rl.base.catalogue import (
    CHECKSUM_DRIFT_MAX,
    H06_BASE_CHECKSUM_DRIFT,
    H06_LORA_B_NORM,
    H08_ADAM_STEP_RATIO,
    H08_GRAD_NORM_AFTER_CLIP,
    H08_GRAD_NORM_BEFORE_CLIP,
    H08_KL_TO_START,
    H08_LEARNING_RATE,
    H08_LR_APPLIED_OVER_CONFIGURED,
    H08_LR_APPLIED_OVER_LOGGED,
    H08_STEP_OVER_CONFIGURED_LR,
    H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE,
    H08_UPDATE_NORM,
    H08_UPDATE_WEIGHT_RATIO,
    TRL_GRAD_NORM,
    TRL_LEARNING_RATE,
    UPDATE_RATIO_MIN,
)
from musique_rl.doctor.context import LR_JUDGED_SHARE, schedule
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import Finding, History, judged, magnitude, note, num, rule, values
from musique_rl.doctor.stages.signal import starved_of_signal, tied_steps
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trl_rules import OURS, _ours

# H08: the policy has moved when the KL to its start reaches 1e-4 nats/token (a step of ~1e-3 of the
# weights' norm moves it by ~1e-4..1e-3 per step on the tiny model); below it after the run's
# steps, a small update ratio is confirmed as a policy that is not moving.
KL_TO_START_MIN = 1e-4
RATIO = H08_UPDATE_WEIGHT_RATIO
# The update size is a median over the steps that had something to update with: at the scheduled
# rate AND with at least one group whose rewards differ (on a step where every group tied the
# gradient is 0 by construction: the signal stage's business, not the optimizer's). A median over
# fewer than 3 such steps is one step's value (the first step after a tied one moves with Adam's
# decayed momentum only), too little to tell the user to change the learning rate.
MIN_UPDATE_STEPS = 3


# ---------------------------------------------------------------- tier-3 invariant (a proof, not a symptom)
# updates: an optimizer step with a non-zero learning rate and gradient changes the weights, by at
# most what Adam at that learning rate can move them (h08/adam_step_ratio); no change, or a far
# larger one, means the step is not the configured optimizer's (parameters not in the optimizer,
# a frozen copy trained, weights written outside the optimizer).
# An optimizer step far beyond what Adam takes: |m/sqrt(v)| <= ~3 per element for default betas.
ADAM_STEP_MAX = 10.0


@rule(stage="update", checks={"step_changed_nothing": Kind.DEFECT, "step_larger_than_adam": Kind.DEFECT},
      starving=("step_changed_nothing",),
      reads=(H08_UPDATE_NORM, H08_LEARNING_RATE, H08_GRAD_NORM_AFTER_CLIP, TRL_GRAD_NORM, H08_ADAM_STEP_RATIO),
      needs=(H08_UPDATE_NORM,), thresholds=("ADAM_STEP_MAX",))
def _updates_apply(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    upd = dict(m.get(H08_UPDATE_NORM) or [])
    lr = dict(m.get(H08_LEARNING_RATE) or [])
    grad = dict(m.get(H08_GRAD_NORM_AFTER_CLIP) or m.get(TRL_GRAD_NORM) or [])
    idle = [s for s, u in upd.items() if u == 0 and lr.get(s, 0) > 0 and grad.get(s, 0) > 0]
    ratio = values(m.get(H08_ADAM_STEP_RATIO))
    big = max(ratio, default=0.0)
    ev = {"steps that changed nothing": float(len(idle)), f"{H08_ADAM_STEP_RATIO} (max)": big}
    if ratio:
        ev[f"{H08_ADAM_STEP_RATIO} (median)"] = statistics.median(ratio)
    out: list[Finding] = []
    if idle:
        low = str(params.get("model.dtype", "")) in ("bfloat16", "float16")
        why = ("each step is below the precision of the bf16/fp16 weights, so rounding discards it (train with "
               "float32 master weights, or a larger learning rate), or the optimizer does not hold the parameters"
               if low else "the optimizer does not hold the parameters the loss differentiates (a copy, a "
               "re-wrapped model, parameters added after it was built)")
        # an exact invariant: a step with a rate and a gradient changes a weight the optimizer holds
        out.append(Finding("h08", "step_changed_nothing", True, 3 + magnitude(1 + len(idle)),
                           f"{len(idle)} optimizer step(s) with a non-zero learning rate and gradient left every trained "
                           f"weight unchanged (first at step {min(idle)}): {why}.", ev,
                           measure=Measure("steps that changed nothing", float(len(idle)), 0.0, exact=True)))
    # Adam's step is bounded per element (|m / sqrt(v)| <= ~3): the median step over the run past 10x
    # that is the optimizer's rate not being the logged one, not one step's bias-correction transient
    med = statistics.median(ratio) if ratio else 0.0
    return out + judged("h08", "step_larger_than_adam", big > ADAM_STEP_MAX and med > ADAM_STEP_MAX / 3,
                        3 + magnitude(big / ADAM_STEP_MAX), ev,
                  f"An optimizer step moved the weights {big:.3g}x as far as Adam at the logged learning rate can "
                  f"(at most ~3): the weights change outside the optimizer, or the learning rate applied is not "
                  "the one logged.",
                  "Every step with a gradient moved the weights, within Adam's reach "
                  f"(step / (lr x sqrt(n)) up to {big:.2g}).",
                  Measure(f"{H08_ADAM_STEP_RATIO} (median)", med, ADAM_STEP_MAX / 3, log=True))


@rule(stage="update", checks={"updates_too_small": Kind.STARVED}, starving=("updates_too_small",),
      reads=(RATIO, H08_KL_TO_START, H08_GRAD_NORM_BEFORE_CLIP, TRL_GRAD_NORM, H08_GRAD_NORM_AFTER_CLIP,
             *schedule.reads, *tied_steps.reads),
      needs=(RATIO,), thresholds=("UPDATE_RATIO_MIN", "KL_TO_START_MIN", "MIN_UPDATE_STEPS", "LR_JUDGED_SHARE"))
def _update_size(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Updates too small to move the policy, judged only at the scheduled learning rate: a step in
    the warm-up (or a decay's tail) is small by schedule, not by defect."""
    sched = schedule(m, params)
    judged_steps = sched.judged_steps()
    pts = [(s, v) for s, v in (m.get(RATIO) or []) if v is not None]
    at_rate = [(s, v) for s, v in pts if judged_steps is None or s in judged_steps]
    ev: dict[str, float] = {f"{H08_UPDATE_WEIGHT_RATIO} (median, all steps)": statistics.median(v for _, v in pts)}
    if sched.lr:
        ev["learning_rate (peak)"] = sched.peak
        ev["steps at >= half the peak rate"] = float(len(at_rate))
    if not at_rate:
        return [note("h08", "updates_too_small",
                     f"Update size not judged: no logged step ran at {LR_JUDGED_SHARE:.0%} of the peak learning rate "
                     f"or more ({sched.words()}): the run is still in its warm-up (or past its decay), so its steps "
                     "are small by schedule.", ev)]
    got = tied_steps(m)
    tied = set(got[0]) if got else set()
    starved = starved_of_signal(got)
    fed = [v for s, v in at_rate if s not in tied]
    if len(fed) < len(at_rate):
        ev["of which with a group signal"] = float(len(fed))
    if len(fed) < MIN_UPDATE_STEPS and not starved:
        # (a run whose groups tie on nearly every step is judged below: its update is starved, and
        # the chain lists it under the signal stage's no_signal)
        why = (f" (the other {len(at_rate) - len(fed)} had every group tied: no gradient by construction)"
               if len(fed) < len(at_rate) else "")
        return [note("h08", "updates_too_small",
                     f"Update size not judged: only {len(fed)} logged step(s) ran at the scheduled learning rate "
                     f"with a group whose rewards differ{why}; at least {MIN_UPDATE_STEPS} are needed before the "
                     "learning rate is blamed.", ev)]
    med = statistics.median(fed or [v for _, v in at_rate])
    ev[f"{H08_UPDATE_WEIGHT_RATIO} (median)"] = med
    kl = values(m.get(H08_KL_TO_START))
    # the Trainer's own `grad_norm` is the pre-clip norm (clip_grad_norm_'s return value)
    pre = values(m.get(H08_GRAD_NORM_BEFORE_CLIP)) or values(m.get(TRL_GRAD_NORM))
    post = values(m.get(H08_GRAD_NORM_AFTER_CLIP))
    if kl:
        ev[f"{H08_KL_TO_START} (last)"] = kl[-1]
    if pre and post:
        ev["grad clip factor (median before/after)"] = statistics.median(pre) / max(statistics.median(post), 1e-30)
    klw = f"; KL to the starting policy is {kl[-1]:.2g}" if kl else ""
    clip = ev.get("grad clip factor (median before/after)")
    clipw = f"; clipping shrinks gradients {clip:.3g}x" if clip and clip > 2 else ""
    stuck = med < UPDATE_RATIO_MIN and (not kl or kl[-1] < KL_TO_START_MIN or med < UPDATE_RATIO_MIN / 10)
    measure = Measure(f"{H08_UPDATE_WEIGHT_RATIO} (median)", med, UPDATE_RATIO_MIN, worse="below", log=True)
    return judged("h08", "updates_too_small", stuck, 2 + magnitude(UPDATE_RATIO_MIN / max(med, 1e-30)), ev,
                  f"At the scheduled learning rate each step changes the weights by {med:.2g} of their norm (healthy "
                  f"~1e-3){klw}{clipw}: the policy is not moving. Raise the learning rate or max_grad_norm.",
                  f"Weights move {med:.2g} of their norm per step at the scheduled learning rate.", measure)


@rule(stage="update", checks={"lora_untrained": Kind.STARVED}, starving=("lora_untrained",), reads=(H06_LORA_B_NORM,),
      needs=(H06_LORA_B_NORM,))
def _adapter(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    bnorm = values(m.get(H06_LORA_B_NORM))
    if len(bnorm) < 2:
        return []
    return judged("h06", "lora_untrained", max(bnorm) == 0, 3.0, {f"{H06_LORA_B_NORM} (max)": max(bnorm)},
                  f"LoRA B matrices are still exactly 0 after {len(bnorm)} steps: the adapter never trains.",
                  f"LoRA B matrices have left 0 (norm up to {max(bnorm):.3g}).",
                  Measure(f"{H06_LORA_B_NORM} (max)", max(bnorm), 0.0, worse="below", exact=True))


@rule(stage="update", checks={"base_drift": Kind.DEFECT}, reads=(H06_BASE_CHECKSUM_DRIFT,),
      needs=(H06_BASE_CHECKSUM_DRIFT,), thresholds=("CHECKSUM_DRIFT_MAX",))
def _frozen_base(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    drift = max(values(m.get(H06_BASE_CHECKSUM_DRIFT)))
    return judged("h06", "base_drift", drift > CHECKSUM_DRIFT_MAX, 3 + magnitude(drift / CHECKSUM_DRIFT_MAX),
                  {f"{H06_BASE_CHECKSUM_DRIFT} (max)": drift},
                  f"The frozen base weights changed (relative drift {drift:.3g}); merge/unmerge round trips corrupt "
                  "the base (TRL #6688).", "The frozen base weights are unchanged.",
                  Measure(f"{H06_BASE_CHECKSUM_DRIFT} (max)", drift, CHECKSUM_DRIFT_MAX, exact=True, log=True))


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
# Learning rate: a quarter of the logged steps, after the peak, below 1e-3 of the peak rate. A linear decay to 0
# spends only its last 0.1% of steps there; a quarter of the run without updates is a schedule that
# ends before the run does (or a rate of 0).
LR_ZERO_REL = 1e-3
LR_ZERO_SHARE = 0.25


@rule(stage="update", checks={"learning_rate_zero": Kind.DEFECT}, starving=("learning_rate_zero",),
      reads=(TRL_LEARNING_RATE, *OURS["lr"]), needs=(TRL_LEARNING_RATE,), thresholds=("LR_ZERO_REL", "LR_ZERO_SHARE"))
def _lr_zero(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "lr"):
        return []
    lr = m.get(TRL_LEARNING_RATE) or []
    vals = values(lr)
    peak = max(vals)
    peak_step = next(s for s, v in lr if v == peak)
    # after the peak: a warmup starting at 0 is not a schedule that ended
    dead = [s for s, v in lr if v is not None and v <= peak * LR_ZERO_REL and s > peak_step]
    share = len(dead) / len(vals)
    ev = {"learning_rate (peak)": peak, "learning_rate (last)": vals[-1], "steps at ~0 (share)": share}
    configured = num(params, "learning_rate", 0.0)
    if configured:
        ev["learning_rate (param)"] = configured
    if peak == 0:
        return [Finding("h08", "learning_rate_zero", True, 3.0,
                        "The learning rate is 0 at every logged step: no update is ever applied.", ev,
                        measure=Measure("steps at ~0 (share)", 1.0, LR_ZERO_SHARE, share=True))]
    from_step = f" from step {dead[0]:g}" if dead else ""
    return judged("h08", "learning_rate_zero", share > LR_ZERO_SHARE, 2 + magnitude(share / LR_ZERO_SHARE * 10), ev,
                  f"The learning rate is ~0 (below {LR_ZERO_REL:g} of its peak {peak:.3g}){from_step} on {share:.0%} "
                  "of the logged steps: the schedule ends before the run does, so those steps update nothing "
                  "(check lr_scheduler_type / lr_scheduler_kwargs / max_steps against the run's length).",
                  f"The learning rate stays above {LR_ZERO_REL:g} of its peak ({peak:.3g}) on most steps.",
                  Measure("steps at ~0 (share)", share, LR_ZERO_SHARE, share=True))


# ---------------------------------------------------------------- the step the optimizer applies (instruments/updates.py)
# The rate in the optimizer's parameter groups is, at every step, what the job's schedule sets (rebuilt
# from the config) and what the trainer logs: an exact invariant per step. A step off by more than 2x
# (either way) is a different rate; judged over the run: more than LR_OFF_STEP_SHARE of the steps (one
# step at a scheduler's boundary, read before or after it moved, proves nothing).
LR_OFF_BAND = (0.5, 2.0)
LR_OFF_STEP_SHARE = 0.1
# An applied rate below this share of the configured one is no update at all: nothing flows past it.
LR_DEAD = 1e-3


def _off(r: float) -> bool:
    return not LR_OFF_BAND[0] <= r <= LR_OFF_BAND[1]


@rule(stage="update", checks={"learning_rate_not_applied": Kind.DEFECT}, starving=(),
      reads=(H08_LR_APPLIED_OVER_CONFIGURED, H08_LR_APPLIED_OVER_LOGGED, H08_STEP_OVER_CONFIGURED_LR),
      needs=(H08_LR_APPLIED_OVER_CONFIGURED, H08_LR_APPLIED_OVER_LOGGED),
      thresholds=("LR_OFF_BAND", "LR_OFF_STEP_SHARE", "LR_DEAD"))
def _rate_applied(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """The optimizer's own rate against the configured schedule and against the logged rate: a scheduler
    built for another run length (the rate 0 after a few steps), or an optimizer stepping with another
    rate than the one logged, makes every learning-rate figure of the run fiction."""
    conf = values(m.get(H08_LR_APPLIED_OVER_CONFIGURED))
    logged = values(m.get(H08_LR_APPLIED_OVER_LOGGED))
    step = values(m.get(H08_STEP_OVER_CONFIGURED_LR))
    ev: dict[str, float] = {}
    worst_share, what, median = 0.0, "", 1.0
    for name, xs, against in ((H08_LR_APPLIED_OVER_CONFIGURED, conf, "the configured schedule"),
                              (H08_LR_APPLIED_OVER_LOGGED, logged, "the logged learning_rate")):
        if not xs:
            continue
        off = sum(_off(r) for r in xs) / len(xs)
        ev[f"{name} (median)"] = statistics.median(xs)
        ev[f"{name} off by > 2x (share of steps)"] = off
        if off > worst_share:
            worst_share, what, median = off, against, statistics.median(xs)
    if step:
        ev[f"{H08_STEP_OVER_CONFIGURED_LR} (median)"] = statistics.median(step)
    dead = median < LR_DEAD
    c = "learning_rate_not_applied"
    measure = Measure("optimizer rate off by > 2x (share of steps)", worst_share, LR_OFF_STEP_SHARE, exact=True,
                      share=True)
    found = judged("h08", c, worst_share > LR_OFF_STEP_SHARE and len(conf or logged) >= 2,
                   3 + magnitude(1 + 10 * worst_share), ev,
                   f"The rate in the optimizer's parameter groups is not {what} on {worst_share:.0%} of the steps "
                   f"(median {median:.2g}x of it"
                   + ("; the optimizer applies ~0: those steps update nothing" if dead else "") +
                   "): the scheduler or the optimizer steps with another rate than the one the job sets and "
                   "logs (a scheduler built for another run length, a second scheduler, a rate written into the "
                   "optimizer's groups).",
                   "The optimizer applies the configured, logged rate at every step.", measure)
    # a rate of ~0 leaves nothing to update: what follows (no update, a still policy) is its consequence
    return [replace(f, starves=dead) if f.flagged else f for f in found]


@rule(stage="update", checks={"parameters_outside_optimizer": Kind.DEFECT}, starving=("parameters_outside_optimizer",),
      reads=(H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE,), needs=(H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE,))
def _outside_optimizer(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Every parameter that requires a gradient is in an optimizer group: an exact invariant. LoRA's B
    matrices left out keep B = 0, so A's gradient is 0 too and the adapter never changes the model
    (starving what follows)."""
    share = max(values(m.get(H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE)))
    c = "parameters_outside_optimizer"
    return judged("h08", c, share > 0, 3.5, {f"{H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE} (max)": share},
                  f"{share:.0%} of the trainable parameter elements are in no optimizer parameter group: they get a "
                  "gradient and are never stepped (a per-matrix grouping that drops a group, parameters added after "
                  "the optimizer was built). With LoRA, B matrices left out stay 0 and the adapter never trains.",
                  "Every trainable parameter is in an optimizer group.",
                  Measure(f"{H08_TRAINABLE_OUTSIDE_OPTIMIZER_SHARE} (max)", share, 0.0, exact=True, share=True))
