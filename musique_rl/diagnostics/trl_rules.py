"""Doctor rules over TRL's own metric names (GRPOTrainer 1.16), for runs made with plain TRL (or
verifiers on TRL) that carry none of this project's instruments.

Same tiers and ranking as the doctor (diagnostics/doctor.py): severity = tier + magnitude, tier 3 a
direct proof, tier 2 a fingerprint past a principled threshold, tier 1 a symptom with other causes.
Our own runs log TRL's metrics too; each rule here stands down where our instrument for the same
defect is in the log (``_ours``), so one defect is reported once, by the better measurement.

Where TRL's log cannot decide, the finding (or ``CANNOT_TELL``, used for hypotheses with no data)
says which musique_rl sweep or instrument would.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping

from musique_rl.diagnostics.findings import Finding, History, judged, magnitude, num, rule, values

# ---------------------------------------------------------------- thresholds (and why)
# A group whose G rewards are equal has advantage 0 on every completion: it adds no gradient. When
# most groups carry none, the batch's gradient comes from a few groups (or none): learning stalls
# whatever the optimizer does. Half is the point where most of the compute trains nothing.
ZERO_STD_MAX = 0.5
# ... and at 95% on average the batch's gradient is ~0: the update, the adapter and the policy
# change downstream are this finding's consequences, not separate causes (diagnostics/chain.py)
ZERO_STD_STARVES = 0.95
# Share of completions cut at max_completion_length. A truncated completion usually has no answer,
# so the budget, not the policy, scores it; more than 1 in 10 binds (as the doctor's h04 budget rule).
CLIPPED_MAX = 0.1
# TRL's sequence/token IS weight exp(trainer - sampler logp) is capped at vllm_importance_sampling_cap
# (default 3.0); a max at the cap on most steps means the correction is truncating or masking
# tokens every step, not occasionally. A min below 1e-3 means some sequences are weighted ~away.
IS_CAP_DEFAULT = 3.0
IS_AT_CAP_SHARE = 0.5
IS_MIN_VANISH = 1e-3
# Mean |sampler - trainer| logp per token (TRL's sampling/sampling_logp_difference/mean, vLLM only).
# Healthy bf16 stacks measure ~0.011 (published vLLM runs) to 0.036 (this project's 7B bf16 run on an
# H100); SkyRL's CI gate for dense models is 0.09. Without a floor measured in the run (TRL logs
# none), 0.09 is the level no healthy bf16 stack reaches; growth is judged against the run's start.
LOGP_DIFF_MAX = 0.09
LOGP_DIFF_GROWTH = 3.0  # last quarter above 3x the first steps' level: the sampler drifts from the trainer
# Learning rate: a quarter of the logged steps, after the peak, below 1e-3 of the peak rate. A linear decay to 0
# spends only its last 0.1% of steps there; a quarter of the run without updates is a schedule that
# ends before the run does (or a rate of 0).
LR_ZERO_REL = 1e-3
LR_ZERO_SHARE = 0.25
# KL to the reference (TRL's `kl`, logged when beta > 0), nats per token. Healthy GRPO runs stay
# around 1e-3..1e-1 per token; 1.0 means the policy gives its reference's tokens e^-1 of their
# probability on average: the KL term no longer holds it. Growth alone (x10 from the first quarter)
# is normal early in a run, so runaway needs both. TRL's k3 estimator is >= 0 for every token: a
# negative mean is a sign error (tier 3), not noise beyond KL_NEGATIVE_TOL.
KL_RUNAWAY = 1.0
KL_GROWTH = 10.0
KL_NEGATIVE_TOL = -1e-6
# A reward function's std over the batch at exactly 0 on every logged step (at least this many).
CONSTANT_MIN_STEPS = 5
# One-sided p for "rises" / "falls" in the reward-vs-component trend (as the doctor's flat rule)
TREND_P = 0.05
TREND_MIN_POINTS = 8

# TRL's metrics these rules read (the MLflow reader of our runs fetches only the histories rules use)
TRL_KEYS = ("frac_reward_zero_std", "learning_rate", "kl", "reward", "reward_std")
TRL_PREFIXES = ("rewards/", "completions/", "sampling/")

# Our instruments for the same defects: a TRL-name rule stands down when one of these was logged.
OURS = {
    "zero_variance": ("h01/signal_group_share", "preflight/signal_share_forecast"),
    "truncation": ("h04/budget_cap_share",),
    "logp_diff": ("h06/logp_gap_mean",),
    "lr": ("h08/update_weight_ratio",),
    "kl": ("h03/kl_model_mean", "h03/kl_negative_share"),
    "reward_funcs": ("h05/reward_errors", "h05/answer_em/mean", "h05/answer_f1/mean"),
}

# What decides a hypothesis a log has no data for: the doctor's words for "no data" on a TRL log.
CANNOT_TELL = {
    "h01": "advantage scaling is not in TRL's logs (only reward_std); run `+hypothesis=h01` (amplification "
           "instrument) or make sweep SWEEP=h01",
    "h02": "env tokens in the loss and the trainer's view of the context cannot be seen in TRL's logs; run "
           "`+hypothesis=h02` or the token ledger (diagnostics.enabled=true)",
    "h03": "KL is logged only with beta > 0, and never per token kind; run `+hypothesis=h03`",
    "h04": "token budgets: only completions/clipped_ratio is logged (prompt truncation and dropped tool results "
           "are not); run `+hypothesis=h04`",
    "h05": "whether a reward matches its completion (a shuffled or misaligned reward) cannot be seen in TRL's "
           "logs; run the reward audit (`+hypothesis=h05`)",
    "h06": "sampler/trainer agreement is logged by TRL only with vLLM and IS correction "
           "(sampling/sampling_logp_difference); a temperature or top-p that differs between generation_kwargs "
           "and the loss is invisible without it; run `+hypothesis=h06` (parity probe, sampling-settings fit)",
    "h07": "tool failures: TRL logs tools/failure_frequency only for its own tool calling; run `+hypothesis=h07`",
    "h08": "update size is not in TRL's logs (grad_norm is, before clipping); run `+hypothesis=h08` "
           "(update/weight ratio, KL to start)",
}


def _ours(m: Mapping[str, History], what: str) -> bool:
    return any(values(m.get(k)) for k in OURS[what])


# A component "falls at the others' expense" only when its fall (fitted, per step) is at least this share of
# the total's rise: a trade costs the component something comparable to what the total gained. A public
# 1,130-step run's format reward drifted -0.002 (2.7% of the total's +0.074) at p < 0.05: no trade.
COMPONENT_FALL_MATERIAL = 0.1
# A reward function named for the task's outcome (TRL users name them: correctness_reward_func,
# accuracy_reward, answer_reward, outcome_reward_fn, ...) that is the same non-zero number for every
# completion is not "saturated and harmless": the task itself no longer tells completions apart, so
# the run learns only from the other functions (format, length). Read from the name because TRL's log
# says nothing else about a function's role; a function whose name says format is the saturated kind.
TASK_REWARD_NAME = re.compile(r"correct|accura|answer|outcome|task|exact|\bem\b|_em_|f1|score|solve|pass|win|success")
FORMAT_REWARD_NAME = re.compile(r"format|xml|tag|length|len_|strict|soft|count|style|think")


def _trend(h: History | None) -> tuple[float, float] | None:
    """(slope, one-sided p that it rises) of a history, or None with too few points."""
    pts = [(s, v) for s, v in (h or []) if v is not None and not math.isnan(v)]
    if len(pts) < TREND_MIN_POINTS or len({v for _, v in pts}) == 1:
        return None
    from scipy.stats import linregress

    fit = linregress([float(s) for s, _ in pts], [v for _, v in pts])
    return float(fit.slope), float(fit.pvalue / 2 if fit.slope > 0 else 1 - fit.pvalue / 2)


def reward_funcs(m: Mapping[str, History]) -> list[str]:
    """Names of the reward functions TRL logged (``rewards/<f>/mean``)."""
    return sorted({k[len("rewards/"):-len("/mean")] for k in m if re.fullmatch(r"rewards/[^/]+/mean", k)})


def constant_funcs(m: Mapping[str, History]) -> dict[str, float]:
    """Reward functions whose std over the batch is exactly 0 at every logged step: {name: mean}."""
    out = {}
    for f in reward_funcs(m):
        std = values(m.get(f"rewards/{f}/std"))
        if len(std) >= CONSTANT_MIN_STEPS and max(abs(s) for s in std) == 0:
            out[f] = statistics.fmean(values(m.get(f"rewards/{f}/mean")))
    return out


def clipped_share(m: Mapping[str, History]) -> float | None:
    c = values(m.get("completions/clipped_ratio"))
    return statistics.fmean(c) if c else None


# ---------------------------------------------------------------- rules
@rule("frac_reward_zero_std")
def _zero_variance(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "zero_variance"):
        return []
    z = values(m.get("frac_reward_zero_std"))
    share = statistics.fmean(z)
    ev = {"frac_reward_zero_std (mean)": share, "frac_reward_zero_std (first)": z[0], "frac_reward_zero_std (last)": z[-1]}
    if share <= ZERO_STD_MAX:
        return [Finding("preflight", "zero_variance_groups", False, 0.0,
                        f"{share:.0%} of groups have equal rewards on average: most groups carry signal.", ev)]
    const = constant_funcs(m)
    clip = clipped_share(m)
    why = []
    if clip is not None and clip > CLIPPED_MAX:
        why.append(f"{clip:.0%} of completions are truncated (h04)")
    if const and len(const) == len(reward_funcs(m)):
        why.append("every reward function is constant (h05)")
    cause = (f" A consequence of what is flagged above: {'; '.join(why)}." if why else
             " Either the task is too hard or too easy for this policy at this group size (pass@G near 0 or 1), or "
             "the reward cannot tell completions apart: run musique_rl's pre-flight (learnability forecast) or "
             "`+hypothesis=h05` (reward audit) to decide.")
    # ranked below its cause when one is flagged (truncation, constant reward)
    sev = (1 if why else 2) + magnitude(share / ZERO_STD_MAX) * (0.5 if why else 1)
    # (nearly) every group tied on (nearly) every step: nothing reaches the gradient (chain.STARVING)
    starves = share >= ZERO_STD_STARVES
    return [Finding("preflight", "zero_variance_groups", True, sev,
                    f"{share:.0%} of groups have identical rewards for all their completions (TRL's "
                    "frac_reward_zero_std): their advantages are 0, so they add no gradient." + cause, ev,
                    starves=starves)]


@rule("completions/clipped_ratio")
def _truncation(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "truncation"):
        return []
    c = clipped_share(m) or 0.0
    ev = {"completions/clipped_ratio (mean)": c}
    mean_len = values(m.get("completions/mean_length"))
    term = values(m.get("completions/mean_terminated_length"))
    if mean_len:
        ev["completions/mean_length (mean)"] = statistics.fmean(mean_len)
    if term:
        ev["completions/mean_terminated_length (mean)"] = statistics.fmean(term)
    budget = num(params, "max_completion_length", 0.0)
    if budget:
        ev["max_completion_length (param)"] = budget
    ended = (f"; the completions that do end are {statistics.fmean(term):.3g} tokens long on average"
             if term and statistics.fmean(term) > 0 else "; no completion ever ends before the budget")
    return judged("h04", "completions_truncated", c > CLIPPED_MAX, 2 + magnitude(c / CLIPPED_MAX), ev,
                  f"{c:.0%} of completions are cut at max_completion_length{ended}: the budget, not the policy, "
                  "decides those rewards (raise max_completion_length, or mask_truncated_completions=True so "
                  "cut completions do not train).",
                  f"{c:.0%} of completions are truncated.")


@rule("sampling/importance_sampling_ratio/max", "sampling/importance_sampling_ratio/min")
def _is_clipped(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """The mean weight vanishing is the doctor's h06 rule (importance_weights_vanish); this reads the
    tails: weights at TRL's cap on most steps, or some sequences weighted ~0."""
    cap = num(params, "vllm_importance_sampling_cap", IS_CAP_DEFAULT)
    hi = values(m.get("sampling/importance_sampling_ratio/max"))
    lo = values(m.get("sampling/importance_sampling_ratio/min"))
    at_cap = sum(v >= cap * (1 - 1e-6) for v in hi) / len(hi) if hi else 0.0
    vanish = sum(v < IS_MIN_VANISH for v in lo) / len(lo) if lo else 0.0
    ev = {"importance_sampling_ratio/max at cap (share of steps)": at_cap,
          "importance_sampling_ratio/min < 1e-3 (share of steps)": vanish, "cap": cap}
    if hi:
        ev["sampling/importance_sampling_ratio/max (median)"] = statistics.median(hi)
    if lo:
        ev["sampling/importance_sampling_ratio/min (median)"] = statistics.median(lo)
    bad = at_cap > IS_AT_CAP_SHARE or vanish > IS_AT_CAP_SHARE
    worst = max(at_cap, vanish)
    return judged("h06", "importance_weights_clipped", bad, 1 + magnitude(worst / IS_AT_CAP_SHARE * 10), ev,
                  f"TRL's importance-sampling correction is at work every step: the largest weight sits at the cap "
                  f"{cap:g} on {at_cap:.0%} of steps and the smallest is below 1e-3 on {vanish:.0%}: the sampler's "
                  "tokens are not the trainer's (sampling settings or stale weights). TRL's log cannot tell which; "
                  "run `+hypothesis=h06` (parity probe, sampling-settings fit).",
                  "Importance weights stay inside TRL's cap.")


@rule("sampling/sampling_logp_difference/mean")
def _logp_diff(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "logp_diff"):
        return []
    vals = values(m.get("sampling/sampling_logp_difference/mean"))
    first = statistics.fmean(vals[: max(1, min(3, len(vals) // 4))])
    tail = statistics.fmean(vals[-max(1, len(vals) // 4):])
    ev = {"sampling/sampling_logp_difference/mean (first steps)": first,
          "sampling/sampling_logp_difference/mean (last quarter)": tail}
    mx = values(m.get("sampling/sampling_logp_difference/max"))
    if mx:
        ev["sampling/sampling_logp_difference/max (median)"] = statistics.median(mx)
    if first > LOGP_DIFF_MAX:
        return [Finding("h06", "sampler_trainer_differ_at_start", True, 2 + magnitude(first / LOGP_DIFF_MAX),
                        f"From the first steps the sampler's and the trainer's log-probs differ by {first:.3g} "
                        f"nats/token (healthy bf16 stacks: 0.01-0.04): they do not compute the same distribution "
                        "(sampling settings such as temperature/top-p, a different context, or dtype/kernels). "
                        "TRL's log cannot tell which; run `+hypothesis=h06` (sampling-settings fit) and "
                        "`+hypothesis=h02` (trainer's view of the context).", ev)]
    if len(vals) >= TREND_MIN_POINTS and tail > LOGP_DIFF_MAX and tail > LOGP_DIFF_GROWTH * first:
        return [Finding("h06", "sampler_trainer_drift", True, 2 + magnitude(tail / max(first, 1e-12) / LOGP_DIFF_GROWTH),
                        f"The sampler/trainer log-prob difference grows from {first:.3g} to {tail:.3g} nats/token: "
                        "the sampler falls behind the trainer (weights not synced to vLLM, or synced from the "
                        "wrong copy). Run `+hypothesis=h06` (parity probe).", ev)]
    return [Finding("h06", "sampler_trainer_differ_at_start", False, 0.0,
                    f"Sampler and trainer agree ({first:.2g} -> {tail:.2g} nats/token).", ev)]


@rule("learning_rate")
def _lr_zero(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "lr"):
        return []
    lr = m.get("learning_rate") or []
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
                        "The learning rate is 0 at every logged step: no update is ever applied.", ev)]
    from_step = f" from step {dead[0]:g}" if dead else ""
    return judged("h08", "learning_rate_zero", share > LR_ZERO_SHARE, 2 + magnitude(share / LR_ZERO_SHARE * 10), ev,
                  f"The learning rate is ~0 (below {LR_ZERO_REL:g} of its peak {peak:.3g}){from_step} on {share:.0%} "
                  "of the logged steps: the schedule ends before the run does, so those steps update nothing "
                  "(check lr_scheduler_type / lr_scheduler_kwargs / max_steps against the run's length).",
                  f"The learning rate stays above {LR_ZERO_REL:g} of its peak ({peak:.3g}) on most steps.")


@rule("kl")
def _kl(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "kl"):
        return []
    kl = values(m.get("kl"))
    q = max(1, len(kl) // 4)
    early, late = statistics.fmean(kl[:q]), statistics.fmean(kl[-q:])
    ev = {"kl (first quarter mean)": early, "kl (last quarter mean)": late, "kl (min)": min(kl)}
    if min(kl) < KL_NEGATIVE_TOL:
        return [Finding("h03", "kl_negative", True, 3 + magnitude(1 + abs(min(kl)) / abs(KL_NEGATIVE_TOL)),
                        f"TRL's KL estimate is negative ({min(kl):.3g}); its k3 estimator cannot be below 0 for any "
                        "token, so the KL term's sign or its inputs are wrong.", ev)]
    runaway = late > KL_RUNAWAY and late > KL_GROWTH * max(early, 1e-12)
    return judged("h03", "kl_runaway", runaway, 2 + magnitude(late / KL_RUNAWAY), ev,
                  f"KL to the reference runs away: {early:.3g} -> {late:.3g} nats/token. The policy has left its "
                  "reference (reward hacking, or a learning rate too high for beta); TRL's log cannot say which "
                  "tokens: run `+hypothesis=h03` (KL per token kind).",
                  f"KL to the reference stays moderate ({early:.2g} -> {late:.2g} nats/token).")


@rule
def _constant_reward_func(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    funcs = reward_funcs(m)
    if not funcs or _ours(m, "reward_funcs"):
        return []
    const = constant_funcs(m)
    out: list[Finding] = []
    clip = clipped_share(m)
    # completions cut before their answer score the same (usually 0) under any reward: then the
    # constant functions are the truncation's consequence, ranked below it (the h04 finding)
    cut = clip is not None and clip > CLIPPED_MAX
    because = (f" A consequence of the truncation: {clip:.0%} of completions are cut before they end." if cut else
               " Check what it reads (field, tag, parser) on a few completions.")
    if const and len(const) == len(funcs):
        ev = {f"rewards/{f}/mean (mean)": v for f, v in const.items()}
        ev["reward functions constant"] = float(len(const))
        what = ", ".join(f"`{f}` = {v:.3g}" for f, v in const.items())
        out.append(Finding("h05", "reward_function_constant", True, 1.5 if cut else 3.0,
                           f"Every reward function is constant on every completion of every logged step ({what}): no "
                           "completion is ever told apart from another, so there is nothing to learn." + because, ev))
        return out
    for f, mean in const.items():
        ev = {f"rewards/{f}/std (max)": 0.0, f"rewards/{f}/mean (mean)": mean}
        if mean == 0:
            out.append(Finding("h05", "reward_function_constant", True, 1.5 if cut else 2.5,
                               f"Reward function `{f}` returns 0 for every completion at every logged step: it never "
                               "pays, so it carries no signal." + because, ev))
        elif TASK_REWARD_NAME.search(f.lower()) and not FORMAT_REWARD_NAME.search(f.lower()):
            others = ", ".join(f"`{g}`" for g in funcs if g not in const) or "nothing"
            out.append(Finding("h05", "reward_function_constant", True, 1.5 if cut else 2.5,
                               f"The task's reward function `{f}` is {mean:.3g} for every completion at every logged "
                               f"step: the task no longer tells completions apart (a parser that returns a default, "
                               f"partial credit that is always the same, or questions every completion solves), so "
                               f"the run learns only from {others}." + because, ev))
        else:
            out.append(Finding("h05", "reward_function_constant", False, 0.0,
                               f"Reward function `{f}` is {mean:.3g} for every completion (saturated): it carries "
                               "no signal, harmless unless it was meant to be the correctness reward.", ev))
    varying = [f for f in funcs if f not in const and values(m.get(f"rewards/{f}/std"))]
    if varying and not any(f.flagged for f in out):
        out.append(Finding("h05", "reward_function_constant", False, 0.0,
                           f"Reward functions that vary: {', '.join(varying)}. Whether each reward belongs to its "
                           "own completion (a shuffled or misaligned reward) cannot be seen in TRL's logs: run the "
                           "reward audit (`+hypothesis=h05`).", {}))
    return out


@rule("reward")
def _reward_vs_component(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    funcs = reward_funcs(m)
    total = _trend(m.get("reward"))
    if len(funcs) < 2 or total is None or total[1] >= TREND_P:
        return []
    falling = {}
    for f in funcs:
        t = _trend(m.get(f"rewards/{f}/mean"))
        # one-sided p for a fall, and a fall worth a trade: at least COMPONENT_FALL_MATERIAL of what
        # the total gained (a long run makes a 0.002 drift "significant" without costing anything)
        if t is not None and 1 - t[1] < TREND_P and -t[0] >= COMPONENT_FALL_MATERIAL * total[0]:
            falling[f] = t[0]
    if not falling:
        return []
    ev = {"reward slope per step": total[0], "p (reward rises)": total[1],
          **{f"rewards/{f}/mean slope per step": s for f, s in falling.items()}}
    names = ", ".join(f"`{f}`" for f in falling)
    return [Finding("h05", "reward_rises_component_falls", True, 1 + magnitude(1 + 10 * len(falling) / len(funcs)),
                    f"The total reward rises while {names} falls: the policy gains on the other components at "
                    f"{names}'s expense (reward hacking, or weights that trade correctness for format). Check the "
                    "reward weights; run `+hypothesis=h05`.", ev)]
