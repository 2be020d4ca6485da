"""Stage "reward": reward components and their scorers (h05)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    H01_ZERO_STD_SHARE,
    H04_NO_ANSWER_SHARE,
    H05_ANSWER_CHECK_CHECKED,
    H05_ANSWER_CHECK_DISAGREEMENT_SHARE,
    H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE,
    H05_ANSWER_CHECK_MATCHED,
    H05_COMPONENT_CONSTANT_GROUP_SHARE,
    H05_COMPONENT_CONTRADICTED_SHARE,
    H05_COMPONENT_CORR_TOTAL,
    H05_COMPONENT_DISAGREEMENT_SHARE,
    H05_COMPONENT_MEAN,
    H05_REWARD_AUDIT_ABS_DIFF_MAX,
    H05_REWARD_AUDIT_CHECKED,
    H05_REWARD_AUDIT_MISMATCH,
    H05_REWARD_AUDIT_MISMATCH_SHARE,
    H05_REWARD_ERRORS,
    H05_SCORER_OVERLAP_CHECKED,
    H05_SCORER_OVERLAP_DISAGREEMENT_SHARE,
    TRL_REWARD,
    TRL_REWARDS,
    Metric,
)
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import (
    Finding,
    History,
    judged,
    magnitude,
    mean_of,
    note,
    num,
    rule,
    stage_sentence,
    values,
)
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trl_rules import (
    CONSTANT_STEP_SHARE,
    OURS,
    TREND_P,
    _ours,
    _trend,
    constant_funcs,
    reward_funcs,
    tied_step_share,
    tied_value,
)

# H05: share of audited episodes whose re-scored reward differs from the one the trainer used.
# Any difference is a defect (the reward is a function of the text); 5% tolerates one odd episode
# per 20 audited (a decode that does not round-trip) without hiding a systematic defect.
REWARD_AUDIT_MAX = 0.05
# H05: an answer component constant in >= 95% of groups, mean below 0.05, while over half of the
# episodes end with an answer, is not reading the answers
CONSTANT_SHARE = 0.95
ANSWER_PRESENT_MIN = 0.5
DEAD_MEAN = 0.05


# ---------------------------------------------------------------- tier-3 invariant (a proof, not a symptom)
# rewards: components whose definitions overlap must agree (exact match implies F1 = 1; an F1
# lies between its precision and recall); a component constant in every group at every step
# carries no signal (reported, not flagged: a reward that is constant as a whole is TRL's
# frac_reward_zero_std, read by stages/signal.py).
# Episodes whose overlapping components disagree: any is a defect; 1% tolerates one episode in a
# hundred with a decode quirk (the same tolerance as the reward audit's spirit, tighter).
COMPONENT_DISAGREEMENT_MAX = 0.01


def weights_known(params: Mapping[str, str]) -> bool:
    """Whether the params carry the run's reward weights (our own runs do; a foreign log does not)."""
    return any(k.startswith("reward.weights.") for k in params)


def paid_for(params: Mapping[str, str], component: str) -> bool:
    """Whether the run's reward weights ``component`` (a component its ``reward.weights`` leave out is
    weighted 0); True where the params carry no reward weights at all (a foreign log: unknown, so material)."""
    return not weights_known(params) or num(params, f"reward.weights.{component}", 0.0) != 0


def components_logged(m: Mapping[str, History], metric: Metric) -> list[str]:
    """The reward components with a logged ``metric`` (an ``h05/{component}/...`` one), sorted."""
    return sorted({s["component"] for k in m if (s := metric.segments(k)) is not None})


@rule(stage="reward", checks={"components_disagree": Kind.DEFECT, "components_without_signal": Kind.SYMPTOM},
      reads=(H05_COMPONENT_DISAGREEMENT_SHARE, H05_COMPONENT_CONTRADICTED_SHARE, H05_COMPONENT_CONSTANT_GROUP_SHARE),
      needs=(H05_COMPONENT_DISAGREEMENT_SHARE, H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component="answer_em")),
      thresholds=("COMPONENT_DISAGREEMENT_MAX",))
def _reward_components(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    dis = values(m.get(H05_COMPONENT_DISAGREEMENT_SHARE))
    # the components each contradiction implicates (logged since the instrument names them): when every
    # implicated one the contradictions reach is weighted 0 by the run's own reward config, the logged
    # numbers are wrong and the training reward is not (materiality from our config, not from a name)
    implicated = {c: statistics.fmean(values(m.get(H05_COMPONENT_CONTRADICTED_SHARE.of(component=c))) or [0.0])
                  for c in components_logged(m, H05_COMPONENT_CONTRADICTED_SHARE)}
    reached = sorted(c for c, share in implicated.items() if share > COMPONENT_DISAGREEMENT_MAX)
    unpaid = [c for c in reached if not paid_for(params, c)]
    if dis and reached and unpaid == reached:
        d = statistics.fmean(dis)
        out.append(note("h05", "components_disagree",
                        f"In {d:.0%} of the episodes reward components contradict each other, and every component "
                        f"the contradictions implicate ({', '.join(reached)}) is weighted 0 by this run's reward "
                        "(reward.weights): a defect in what is logged, not in what is trained. Fix it before a "
                        "reward that weights it.",
                        {f"{H05_COMPONENT_DISAGREEMENT_SHARE} (mean)": d,
                         **{f"{H05_COMPONENT_CONTRADICTED_SHARE.of(component=c)} (mean)": implicated[c] for c in reached}}))
    elif dis:
        d = statistics.fmean(dis)
        out += judged("h05", "components_disagree", d > COMPONENT_DISAGREEMENT_MAX,
                      3 + magnitude(d / COMPONENT_DISAGREEMENT_MAX), {f"{H05_COMPONENT_DISAGREEMENT_SHARE} (mean)": d},
                      f"In {d:.0%} of the episodes reward components contradict each other where their definitions "
                      "overlap (an exact match without F1 = 1, or an F1 outside its precision and recall): one of "
                      "them reads another text or parses differently.",
                      "Overlapping reward components agree.",
                      Measure(f"{H05_COMPONENT_DISAGREEMENT_SHARE} (mean)", d, COMPONENT_DISAGREEMENT_MAX, exact=True,
                              share=True))
    comps = components_logged(m, H05_COMPONENT_CONSTANT_GROUP_SHARE)
    weighted = [c for c in comps if num(params, f"reward.weights.{c}", 1.0) != 0]
    const = [c for c in weighted if min(values(m.get(H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component=c))) or [0.0]) >= 1.0]
    if const:
        out.append(Finding("h05", "components_without_signal", False, 0.0,
                           f"Constant in every group at every step, so they carry no signal (they shift the reward, "
                           f"not the advantages): {', '.join(const)}.",
                           {f"{H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component=c)} (min)": 1.0 for c in const}))
    return out


# The total reward is the weighted sum of its components: in a group where a weighted component varies, the
# total varies (an exact cancellation of two components is a measure-zero event). A step whose share of
# groups with a constant total exceeds the share where every weighted component is constant by more than
# this (one group in 20: a cancellation, a component the config weights at ~0) is a step whose total did
# not follow its components: a scale, weight or combination of the reward that drops them.
TOTAL_TIED_EXCESS = 0.05


@rule(stage="reward", checks={"total_ignores_components": Kind.DEFECT},
      reads=(H01_ZERO_STD_SHARE, H05_COMPONENT_CONSTANT_GROUP_SHARE),
      needs=(H01_ZERO_STD_SHARE, H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component="answer_em")),
      thresholds=("TOTAL_TIED_EXCESS",))
def _total_follows_components(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """Groups whose total reward is tied against groups where the weighted components are all tied (each
    component's tied share bounds the total's from above: the total can tie only where they all do)."""
    weighted = [c for c in components_logged(m, H05_COMPONENT_CONSTANT_GROUP_SHARE)
                if weights_known(params) and paid_for(params, c)]
    if not weighted:
        return []
    tied = dict(m.get(H01_ZERO_STD_SHARE) or [])
    by_comp = {c: dict(m.get(H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component=c)) or []) for c in weighted}
    steps = [s for s in tied if all(s in v for v in by_comp.values())]
    if not steps:
        return []
    excess = {s: tied[s] - min(v[s] for v in by_comp.values()) for s in steps}
    off = [s for s in steps if excess[s] > TOTAL_TIED_EXCESS]
    share = len(off) / len(steps)
    worst = max(steps, key=lambda s: excess[s])
    c = "total_ignores_components"
    ev = {f"{H01_ZERO_STD_SHARE} (step {worst})": tied[worst],
          f"weighted components' least tied share (step {worst})": tied[worst] - excess[worst],
          "steps whose total ties beyond its components (share)": share}
    return judged("h05", c, share > 0.5, 3.0, ev,
                  f"On {len(off)} of {len(steps)} steps the total reward ties in more groups than its weighted "
                  f"components do ({tied[worst]:.0%} of groups tied against at most {tied[worst] - excess[worst]:.0%} "
                  f"for a component, step {worst}): the total does not follow its components (a scale, weight or "
                  "combination that drops them), so their signal never reaches the advantages." + stage_sentence(c),
                  "The total reward varies wherever its weighted components do." + stage_sentence(c),
                  Measure("steps whose total ties beyond its components (share)", share, 0.5, exact=True, share=True))


# answer_reward_blind is a fingerprint, not a proof: answer components ~0 and constant while the
# episodes answer is what a reward that never reads the answer gives, and also what a policy that
# cannot find the answer gives (every tool call refused upstream): a symptom the chain may explain.
@rule(stage="reward", checks={"reward_errors": Kind.DEFECT, "reward_audit": Kind.DEFECT, "answer_reward_blind": Kind.SYMPTOM,
                          "reward_signal": Kind.DEFECT},
      reads=(H05_REWARD_ERRORS, H05_REWARD_AUDIT_MISMATCH_SHARE, H05_REWARD_AUDIT_ABS_DIFF_MAX, H05_REWARD_AUDIT_MISMATCH,
             H05_REWARD_AUDIT_CHECKED, H04_NO_ANSWER_SHARE, H05_COMPONENT_CONSTANT_GROUP_SHARE, H05_COMPONENT_MEAN,
             H05_COMPONENT_CORR_TOTAL, H05_ANSWER_CHECK_CHECKED, H05_ANSWER_CHECK_DISAGREEMENT_SHARE,
             H05_ANSWER_CHECK_MATCHED),
      thresholds=("REWARD_AUDIT_MAX", "CONSTANT_SHARE", "ANSWER_PRESENT_MIN", "DEAD_MEAN"))
def _h05(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    out: list[Finding] = []
    errs = values(m.get(H05_REWARD_ERRORS))
    if errs and max(errs) > 0:
        out.append(Finding("h05", "reward_errors", True, 3 + magnitude(1 + sum(errs)),
                           f"Reward functions raised {sum(errs):.0f} times (up to {max(errs):.0f} per batch): those "
                           "completions were not scored.", {f"{H05_REWARD_ERRORS} (sum)": sum(errs)},
                           measure=Measure(f"{H05_REWARD_ERRORS} (sum)", sum(errs), 0.0, exact=True)))
    audit = values(m.get(H05_REWARD_AUDIT_MISMATCH_SHARE))
    if audit and statistics.fmean(audit) > REWARD_AUDIT_MAX:
        a = statistics.fmean(audit)
        out.append(Finding("h05", "reward_audit", True, 3 + magnitude(1 + 100 * a),
                           f"Reward audit: for {a:.0%} of the audited episodes the reward the trainer used is not the "
                           f"reward of that episode's own text re-scored independently (largest difference "
                           f"{max(values(m.get(H05_REWARD_AUDIT_ABS_DIFF_MAX)) or [0.0]):.3g}): rewards are attached to "
                           "the wrong sample, read from the wrong turn, or cached.",
                           {f"{H05_REWARD_AUDIT_MISMATCH_SHARE} (mean)": a,
                            f"{H05_REWARD_AUDIT_MISMATCH} (sum)": sum(values(m.get(H05_REWARD_AUDIT_MISMATCH))),
                            f"{H05_REWARD_AUDIT_CHECKED} (sum)": sum(values(m.get(H05_REWARD_AUDIT_CHECKED)))},
                           measure=Measure(f"{H05_REWARD_AUDIT_MISMATCH_SHARE} (mean)", a, REWARD_AUDIT_MAX, exact=True,
                                           share=True)))
    # Every answer component present must be dead: an answering policy that is always wrong still
    # earns partial F1 now and then, a reward that never reads the answer earns none.
    dead, answered = answer_components_dead(m, params)
    confirmed = scorer_confirms_wrong_answers(m)
    if dead and answered >= ANSWER_PRESENT_MIN and confirmed:
        # the independent scorer reads the same answers and finds them wrong too: the reward reads the
        # answer; the answers are wrong (environment's answers_never_right names it)
        out.append(Finding("h05", "answer_reward_blind", False, 0.0,
                           f"{answered:.0%} of episodes end with an answer and the answer components are ~0, but "
                           f"an independent scorer of the same definition agrees on the {confirmed:.0f} answers it "
                           "checked and finds almost none right: the reward reads the answers; they are wrong "
                           "(environment stage, answers_never_right).",
                           {f"answered share (1 - {H04_NO_ANSWER_SHARE})": answered,
                            f"{H05_ANSWER_CHECK_CHECKED} (sum)": confirmed}))
    elif dead and answered >= ANSWER_PRESENT_MIN:
        ev = {f"{H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component=c)} (mean)": s for c, s, _ in dead}
        ev.update({f"{H05_COMPONENT_MEAN.of(component=c)} (max)": v for c, _, v in dead})
        ev[f"answered share (1 - {H04_NO_ANSWER_SHARE})"] = answered
        names = ", ".join(c for c, _, _ in dead)
        best = max(v for _, _, v in dead)
        out.append(Finding("h05", "answer_reward_blind", True, 2 + magnitude(answered / ANSWER_PRESENT_MIN * 10),
                           f"{answered:.0%} of episodes end with an answer, yet {names} is ~0 and constant in "
                           f"{min(s for _, s, _ in dead):.0%} of groups: the reward does not read the final answer "
                           "(wrong turn parsed, or brittle parsing), or the answers are all wrong.", ev,
                           measure=Measure(f"{H05_COMPONENT_MEAN.of(component=dead[0][0])} (max)", best, DEAD_MEAN,
                                           worse="below")))
    if not out:
        comps = components_logged(m, H05_COMPONENT_CORR_TOTAL)
        corr = {c: H05_COMPONENT_CORR_TOTAL.of(component=c) for c in comps}
        ev = {f"{corr[c]} (mean)": statistics.fmean(values(m[corr[c]])) for c in comps}
        if audit:
            ev[f"{H05_REWARD_AUDIT_MISMATCH_SHARE} (mean)"] = statistics.fmean(audit)
        if comps or errs or audit:
            out.append(Finding("h05", "reward_signal", False, 0.0,
                               "Every weighted answer component varies; no reward errors"
                               + ("; audited rewards match their episodes." if audit else "."), ev))
    return out


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
# A component "falls at the others' expense" only when its fall (fitted, per step) is at least this share of
# the total's rise: a trade costs the component something comparable to what the total gained. A public
# 1,130-step run's format reward drifted -0.002 (2.7% of the total's +0.074) at p < 0.05: no trade.
COMPONENT_FALL_MATERIAL = 0.1
# A reward function's role is read from its values first, its name only beside them: TRL's log names
# a function, it does not say which carries the task. A function that tells no completion apart
# (constant_funcs: the same value for the whole batch on at least CONSTANT_STEP_SHARE of the steps, so
# one that pays on 2 of 30 steps is constant too) is the run's problem when
#   - it is dead and the reward's main part: the value it gives everyone is 0 or below (nothing earned,
#     or a penalty every completion gets alike) and it makes up at least MAIN_SHARE of the reward's scale
#     (|its mean| over the sum of every function's |mean|): a constant -5 beside a 0-1 format reward,
#     whatever the -5 function is called;
#   - it is the reward's main part at any value and its name does not say format (a main reward that
#     every completion earns alike: the task solved by all, or a default);
#   - its name says it scores the task (correct, accuracy, answer, ...) and not the format: constant by
#     its values, the task by its name (a name alone never flags: the values must say constant).
# Otherwise it is a note: saturated (a format reward every completion earns) or a minor bonus nobody
# earns (a strict format no completion meets).
MAIN_SHARE = 0.5
TASK_REWARD_NAME = re.compile(r"correct|accura|answer|outcome|task|exact|\bem\b|_em_|f1|solve|pass|success")
FORMAT_REWARD_NAME = re.compile(r"format|xml|tag|length|len_|strict|soft|count|style|think")


@rule(stage="reward", checks={"reward_function_constant": Kind.SYMPTOM},
      reads=(*constant_funcs.reads, *tied_step_share.reads, *OURS["reward_funcs"]),
      thresholds=("CONSTANT_STEP_SHARE", "MAIN_SHARE"))
def _constant_reward_func(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    funcs = reward_funcs(m)
    if not funcs or _ours(m, "reward_funcs"):
        return []
    const = constant_funcs(m)
    means = {f: statistics.fmean(values(m.get(TRL_REWARDS.of(func=f, stat="mean")))) for f in funcs
             if values(m.get(TRL_REWARDS.of(func=f, stat="mean")))}
    scale = sum(abs(v) for v in means.values())
    out: list[Finding] = []
    check = " Check what it reads (field, tag, parser) on a few completions."
    if const and len(const) == len(funcs):
        tied = {f: tied_step_share(m, f) or 0.0 for f in const}
        ev = {f"rewards/{f}/mean (mean)": v for f, v in const.items()}
        ev.update({f"rewards/{f}/std = 0 (share of steps)": t for f, t in tied.items()})
        what = ", ".join(f"`{f}` = {v:.3g}" for f, v in const.items())
        # the evidence is the most constant of them (one that never tells two completions apart is
        # categorical); each is constant on at least CONSTANT_STEP_SHARE of the steps
        out.append(Finding("h05", "reward_function_constant", True, 3.0,
                           f"Every reward function gives every completion the same value on {min(tied.values()):.0%} "
                           f"or more of the logged steps ({what}): no completion is told apart from another, so there "
                           "is nothing to learn." + check, ev,
                           measure=Measure("reward functions tied (share of steps, most tied)", max(tied.values()),
                                           CONSTANT_STEP_SHARE, share=True)))
        return out
    for f in const:
        tied = tied_step_share(m, f) or 0.0
        given = tied_value(m, f)
        part = abs(means.get(f, 0.0)) / scale if scale > 0 else 0.0
        fmt = bool(FORMAT_REWARD_NAME.search(f.lower()))
        task = bool(TASK_REWARD_NAME.search(f.lower())) and not fmt
        main = part >= MAIN_SHARE
        ev = {f"rewards/{f}/std = 0 (share of steps)": tied, f"rewards/{f}/mean on those steps (median)": given,
              f"rewards/{f} share of the reward's scale": part}
        measure = Measure(f"rewards/{f}/std = 0 (share of steps)", tied, CONSTANT_STEP_SHARE, share=True)
        if (main and (given <= 0 or not fmt)) or task:
            others = ", ".join(f"`{g}`" for g in funcs if g not in const) or "nothing"
            why = f"{part:.0%} of the reward's scale" if main else "by its name the task's reward"
            out.append(Finding("h05", "reward_function_constant", True, 2.5,
                               f"Reward function `{f}` ({why}) gives every completion {given:.3g} on {tied:.0%} of the "
                               f"logged steps: the task no longer tells completions apart (a parser that returns a "
                               f"default, a penalty every completion gets, partial credit that is always the same, or "
                               f"questions every completion solves or none does), so the run learns only from "
                               f"{others}." + check, ev, measure=measure))
        elif given <= 0:
            out.append(Finding("h05", "reward_function_constant", False, 0.0,
                               f"Reward function `{f}` gives every completion {given:.3g} on {tied:.0%} of the logged "
                               f"steps ({part:.0%} of the reward's scale): it carries no signal, harmless unless it "
                               "was meant to carry the task.", ev, measure=measure))
        else:
            out.append(Finding("h05", "reward_function_constant", False, 0.0,
                               f"Reward function `{f}` is {given:.3g} for every completion on {tied:.0%} of the logged "
                               "steps (saturated: every completion earns it): it carries no signal, harmless.", ev,
                               measure=measure))
    varying = [f for f in funcs if f not in const and values(m.get(TRL_REWARDS.of(func=f, stat="std")))]
    if varying and not any(f.flagged for f in out):
        out.append(Finding("h05", "reward_function_constant", False, 0.0,
                           f"Reward functions that vary: {', '.join(varying)}. Whether each reward belongs to its "
                           "own completion (a shuffled or misaligned reward) cannot be seen in TRL's logs: run the "
                           "reward audit (`+hypothesis=h05`).", {}))
    return out


@rule(stage="reward", checks={"reward_rises_component_falls": Kind.SYMPTOM}, reads=(TRL_REWARD, TRL_REWARDS),
      needs=(TRL_REWARD,), thresholds=("TREND_P", "COMPONENT_FALL_MATERIAL"))
def _reward_vs_component(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    funcs = reward_funcs(m)
    total = _trend(m.get(TRL_REWARD))
    if len(funcs) < 2 or total is None or total[1] >= TREND_P:
        return []
    falling = {}
    for f in funcs:
        t = _trend(m.get(TRL_REWARDS.of(func=f, stat="mean")))
        # one-sided p for a fall, and a fall worth a trade: at least COMPONENT_FALL_MATERIAL of what
        # the total gained (a long run makes a 0.002 drift "significant" without costing anything)
        if t is not None and 1 - t[1] < TREND_P and -t[0] >= COMPONENT_FALL_MATERIAL * total[0]:
            falling[f] = t[0]
    if not falling:
        return []
    ev = {"reward slope per step": total[0], "p (reward rises)": total[1],
          **{f"rewards/{f}/mean slope per step": s for f, s in falling.items()}}
    names = ", ".join(f"`{f}`" for f in falling)
    cost = max(-s for s in falling.values()) / total[0]
    return [Finding("h05", "reward_rises_component_falls", True, 1 + magnitude(1 + 10 * len(falling) / len(funcs)),
                    f"The total reward rises while {names} falls: the policy gains on the other components at "
                    f"{names}'s expense (reward hacking, or weights that trade correctness for format). Check the "
                    "reward weights; run `+hypothesis=h05`.", ev,
                    measure=Measure("component's fall / total's rise", cost, COMPONENT_FALL_MATERIAL))]

# ---------------------------------------------------------------- at the point of use
# Read where the loss consumes its inputs (instruments/loss_inputs.py: the loss's own gradient against
# the rollout's references); the metrics, units and bounds are declared in base/catalogue.py.
# Episodes where overlapping scorers contradict each other (mean share): 1%, as components_disagree.
OVERLAP_DISAGREEMENT_MAX = 0.01


@rule(stage="reward", checks={"scorers_disagree_on_overlap": Kind.DEFECT},
      reads=(H05_SCORER_OVERLAP_DISAGREEMENT_SHARE, H05_SCORER_OVERLAP_CHECKED), needs=(H05_SCORER_OVERLAP_DISAGREEMENT_SHARE,),
      thresholds=("OVERLAP_DISAGREEMENT_MAX",))
def _scorers_agree(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    share = mean_of(m, H05_SCORER_OVERLAP_DISAGREEMENT_SHARE) or 0.0
    checked = sum(values(m.get(H05_SCORER_OVERLAP_CHECKED)))
    c = "scorers_disagree_on_overlap"
    return judged("h05", c, share > OVERLAP_DISAGREEMENT_MAX, 3 + magnitude(1 + 100 * share),
                  {f"{H05_SCORER_OVERLAP_DISAGREEMENT_SHARE} (mean)": share, f"{H05_SCORER_OVERLAP_CHECKED} (sum)": checked},
                  f"{share:.0%} of the episodes that cite every document they were shown score a lower citation "
                  "recall than retrieval recall: one of the two scorers reads other ids than the episode's "
                  "(another turn, another message)." + stage_sentence(c),
                  "The citation and retrieval scorers agree where they overlap." + stage_sentence(c),
                  Measure(f"{H05_SCORER_OVERLAP_DISAGREEMENT_SHARE} (mean)", share, OVERLAP_DISAGREEMENT_MAX, exact=True,
                          share=True))


def answer_components_dead(m: Mapping[str, History], params: Mapping[str, str]) -> tuple[list[tuple[str, float, float]], float]:
    """(the weighted answer components that are ~0 and constant in most groups, as (name, constant
    share, max mean), when every weighted one is; the answered share of episodes)."""
    answered = 1 - statistics.fmean(values(m.get(H04_NO_ANSWER_SHARE)) or [1.0])
    dead, live = [], 0
    for comp in ("answer_em", "answer_f1"):
        const = values(m.get(H05_COMPONENT_CONSTANT_GROUP_SHARE.of(component=comp)))
        mean = values(m.get(H05_COMPONENT_MEAN.of(component=comp)))
        if not const or not mean or num(params, f"reward.weights.{comp}", 1.0) == 0:
            continue
        if statistics.fmean(const) >= CONSTANT_SHARE and max(mean) < DEAD_MEAN:
            dead.append((comp, statistics.fmean(const), max(mean)))
        else:
            live += 1
    return (dead if not live else []), answered


def scorer_confirms_wrong_answers(m: Mapping[str, History]) -> float:
    """How many answers the independent scorer (instruments/answer_check.py) checked, when it agrees
    with the reward on them (within ANSWER_CHECK_MAX) and calls almost none an exact match (fewer than
    DEAD_MEAN of them, the line a dead answer component is drawn at); else 0."""
    checked = sum(values(m.get(H05_ANSWER_CHECK_CHECKED)))
    agree = (mean_of(m, H05_ANSWER_CHECK_DISAGREEMENT_SHARE) or 0.0) <= ANSWER_CHECK_MAX
    matched = values(m.get(H05_ANSWER_CHECK_MATCHED))
    if checked <= 0 or not matched or not agree or sum(matched) / checked >= DEAD_MEAN:
        return 0.0
    return checked


# ---------------------------------------------------------------- an independent scorer (instruments/answer_check.py)
# Episodes whose final answer the reward's answer_em/answer_f1 score differently from an exact match and
# F1 written independently from the same definition: any is one scorer wrong; 1% tolerates one episode
# in a hundred with a decode quirk (as components_disagree).
ANSWER_CHECK_MAX = 0.01


@rule(stage="reward", checks={"answer_scorer_wrong": Kind.DEFECT},
      reads=(H05_ANSWER_CHECK_DISAGREEMENT_SHARE, H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE, H05_ANSWER_CHECK_CHECKED,
             H05_ANSWER_CHECK_MATCHED),
      needs=(H05_ANSWER_CHECK_DISAGREEMENT_SHARE,), thresholds=("ANSWER_CHECK_MAX",))
def _answer_scorer(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    """The reward's answer scores against an independent scorer of the same definition, on every answered
    training episode: the share that disagree (a mean over the run), and, of the answers either scorer
    calls an exact match, the share the other does not (a one-sided normalisation reads ~1 there while
    the overall share stays small when few answers are right)."""
    share = mean_of(m, H05_ANSWER_CHECK_DISAGREEMENT_SHARE) or 0.0
    matched = [v for v in values(m.get(H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE))]
    match_share = statistics.fmean(matched) if matched else 0.0
    checked = sum(values(m.get(H05_ANSWER_CHECK_CHECKED)))
    ev = {f"{H05_ANSWER_CHECK_DISAGREEMENT_SHARE} (mean)": share,
          f"{H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE} (mean)": match_share,
          f"{H05_ANSWER_CHECK_CHECKED} (sum)": checked,
          f"{H05_ANSWER_CHECK_MATCHED} (sum)": sum(values(m.get(H05_ANSWER_CHECK_MATCHED)))}
    worst_key, worst = max(((f"{H05_ANSWER_CHECK_DISAGREEMENT_SHARE} (mean)", share),
                            (f"{H05_ANSWER_CHECK_MATCH_DISAGREEMENT_SHARE} (mean)", match_share)), key=lambda kv: kv[1])
    c = "answer_scorer_wrong"
    return judged("h05", c, worst > ANSWER_CHECK_MAX, 3 + magnitude(1 + 100 * worst), ev,
                  f"The reward's answer scores disagree with an independent exact match and F1 of the same "
                  f"definition on {share:.0%} of the answered episodes ({match_share:.0%} of the answers either "
                  "calls an exact match): the reward's answer scorer is wrong (a normalisation applied to one side, "
                  "another field read, a parser that drops part of the answer), so the policy is paid for "
                  "something else than right answers." + stage_sentence(c),
                  "The reward's answer scores agree with an independent scorer of the same definition."
                  + stage_sentence(c),
                  Measure(worst_key, worst, ANSWER_CHECK_MAX, exact=True, share=True))
