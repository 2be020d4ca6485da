"""Stage "environment": tools and the tool results the policy reads (h07, h04's tool-result audit)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    H02_LOSS_ASSISTANT_LEFT_OUT_SHARE,
    H04_BUDGET_CAP_SHARE,
    H04_COMPLETION_LEN_MAX,
    H04_NO_ANSWER_SHARE,
    H04_STOP_REASON_SHARE,
    H04_TOOL_RESULTS_ALTERED,
    H04_TOOL_RESULTS_ALTERED_SHARE,
    H05_ANSWER_CHECK_CHECKED,
    H05_ANSWER_CHECK_DISAGREEMENT_SHARE,
    H05_ANSWER_CHECK_MATCHED,
    H05_COMPONENT_CONSTANT_GROUP_SHARE,
    H05_COMPONENT_MEAN,
    H07_TOOL_CALLS_MEAN,
    H07_TOOL_FAILURE_RATE,
    H07_TURNS_MEAN,
    H07_VOID_EPISODE_SHARE,
    H07_VOID_TURN_SHARE,
    TOOL_FAILURE_MAX,
)
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import Finding, History, judged, magnitude, num, rule, stage_sentence, values
from musique_rl.doctor.stages.inputs import budget_stops_unreached
from musique_rl.doctor.stages.reward import (
    ANSWER_PRESENT_MIN,
    DEAD_MEAN,
    answer_components_dead,
    scorer_confirms_wrong_answers,
)
from musique_rl.doctor.step import Kind

# H04: share of tool results that differ from their source. Any difference is a defect (a tool
# result is a copy of its document); 5% tolerates one odd result per 20 audited (a decode that does
# not round-trip) without hiding a systematic defect.
TOOL_ALTERED_MAX = 0.05


# ---------------------------------------------------------------- field alarms (tier 1: other causes possible)
# Void turns: an assistant turn with neither a tool call nor an answer ends the episode
# (stop_reason no_tool_call). The warm-started tiny policy has ~8% such episodes before training;
# above a quarter of the episodes in the last quarter of the run, the policy or the tool-call
# parser has stopped producing actions (a format the parser does not read, a chatty collapse).
VOID_EPISODE_MAX = 0.25


@rule(stage="environment", checks={"void_turns": Kind.SYMPTOM}, reads=(H07_VOID_EPISODE_SHARE, H07_VOID_TURN_SHARE),
      needs=(H07_VOID_EPISODE_SHARE,), thresholds=("VOID_EPISODE_MAX",))
def _void_turns(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    void = values(m.get(H07_VOID_EPISODE_SHARE))
    q = max(1, len(void) // 4)
    last = statistics.fmean(void[-q:])
    ev = {f"{H07_VOID_EPISODE_SHARE} (first)": void[0], f"{H07_VOID_EPISODE_SHARE} (last quarter)": last,
          f"{H07_VOID_TURN_SHARE} (last)": (values(m.get(H07_VOID_TURN_SHARE)) or [0.0])[-1]}
    measure = Measure(f"{H07_VOID_EPISODE_SHARE} (last quarter)", last, VOID_EPISODE_MAX, share=True)
    return judged("h07", "void_turns", last > VOID_EPISODE_MAX, 1 + magnitude(last / VOID_EPISODE_MAX), ev,
                  f"{last:.0%} of the episodes (last quarter of the run) end in a void turn, neither a tool call nor "
                  "an answer: the policy writes text the tool-call parser does not read, or has collapsed into "
                  "chatter (check model.tool_call_format against what the model writes).",
                  f"Void turns: {last:.0%} of episodes in the last quarter.", measure)


@rule(stage="environment", checks={"tool_results_altered": Kind.DEFECT},
      reads=(H04_TOOL_RESULTS_ALTERED_SHARE, H04_TOOL_RESULTS_ALTERED), needs=(H04_TOOL_RESULTS_ALTERED_SHARE,),
      thresholds=("TOOL_ALTERED_MAX",))
def _tool_results_altered(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    a = statistics.fmean(values(m.get(H04_TOOL_RESULTS_ALTERED_SHARE)))
    ev = {f"{H04_TOOL_RESULTS_ALTERED_SHARE} (mean)": a,
          f"{H04_TOOL_RESULTS_ALTERED} (sum)": sum(values(m.get(H04_TOOL_RESULTS_ALTERED)))}
    measure = Measure(f"{H04_TOOL_RESULTS_ALTERED_SHARE} (mean)", a, TOOL_ALTERED_MAX, exact=True, share=True)
    return judged("h04", "tool_results_altered", a > TOOL_ALTERED_MAX, 3 + magnitude(1 + 100 * a), ev,
                  f"{a:.0%} of the tool results the model saw differ from their source documents (cut, altered, or "
                  "under another document's id) between the retriever and the prompt: the policy reads a different "
                  "environment from the one the reward assumes.",
                  f"Tool results match their source documents ({a:.0%} differ).", measure)


@rule(stage="environment", checks={"tool_failures": Kind.SYMPTOM},
      reads=(H07_TOOL_FAILURE_RATE, H07_TOOL_CALLS_MEAN, H07_TURNS_MEAN), needs=(H07_TOOL_FAILURE_RATE,),
      thresholds=("TOOL_FAILURE_MAX",))
def _tool_failures(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    fail = values(m.get(H07_TOOL_FAILURE_RATE))
    ev = {f"{H07_TOOL_FAILURE_RATE} (mean)": statistics.fmean(fail),
          f"{H07_TOOL_CALLS_MEAN} (mean)": statistics.fmean(values(m.get(H07_TOOL_CALLS_MEAN)) or [0.0]),
          f"{H07_TURNS_MEAN} (mean)": statistics.fmean(values(m.get(H07_TURNS_MEAN)) or [0.0])}
    f = statistics.fmean(fail)
    measure = Measure(f"{H07_TOOL_FAILURE_RATE} (mean)", f, TOOL_FAILURE_MAX, share=True)
    return judged("h07", "tool_failures", f > TOOL_FAILURE_MAX, 1 + magnitude(f / TOOL_FAILURE_MAX), ev,
                  f"{f:.0%} of tool calls fail: the multi-turn machinery, not the policy's choices, decides the episodes.",
                  f"Tool calls mostly succeed ({f:.0%} fail).", measure)


# The episode loop's reading of how each turn ended (an answer, a tool call, a budget, the turn cap),
# checked against what the episodes measure: a budget stop on an episode shorter than every budget, or a
# turn-cap stop on episodes with fewer turns than the cap, is a stop the loop misread (the turn ended on
# its stop id and was filed as cut; a turn counted against a cap it has not reached), and every later
# turn of the episode is lost with it.
MAX_TURNS_SHARE = H04_STOP_REASON_SHARE.of(reason="max_turns")
# turns per episode are logged as a mean: a step's mean below the least the turn-cap stops imply by more
# than this (float round-off of a mean over a batch) refutes them
TURNS_SLACK = 0.01


def turn_stops_unreached(m: Mapping[str, History], params: Mapping[str, str]) -> tuple[int, int, float] | None:
    """(steps whose turn-cap stops the turn counts refute, steps with a turn-cap stop, the cap), or None.
    An episode stopped by ``env.max_turns`` has that many turns, every other at least one, so a step whose
    share s of episodes stopped so has a mean of at least s x cap + (1 - s) turns."""
    cap = num(params, "env.max_turns", 0.0)
    turns = dict(m.get(H07_TURNS_MEAN) or [])
    claims = [(s, v) for s, v in (m.get(MAX_TURNS_SHARE) or []) if v > 0 and s in turns]
    if cap < 2 or not claims:
        return None
    return sum(1 for s, v in claims if turns[s] < v * cap + (1 - v) - TURNS_SLACK), len(claims), cap


@rule(stage="environment", checks={"stop_reasons_contradict_lengths": Kind.DEFECT},
      reads=(H04_BUDGET_CAP_SHARE, H04_COMPLETION_LEN_MAX, H02_LOSS_ASSISTANT_LEFT_OUT_SHARE, MAX_TURNS_SHARE,
             H07_TURNS_MEAN),
      needs=(H04_BUDGET_CAP_SHARE,))
def _stop_reasons(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    claims = {"token budget": budget_stops_unreached(m, params), "turn cap": turn_stops_unreached(m, params)}
    claims = {k: v for k, v in claims.items() if v is not None}
    if not claims:
        return []
    what, (bad, claimed, limit) = max(claims.items(), key=lambda kv: kv[1][0] / kv[1][1])
    share = bad / claimed
    c = "stop_reasons_contradict_lengths"
    ev = {f"steps with a {k} stop": float(v[1]) for k, v in claims.items()}
    ev.update({f"of them refuted by the episodes ({k})": float(v[0]) for k, v in claims.items()})
    ev[f"the {what} (config)"] = limit
    measured = ("no episode is as long as the smallest budget" if what == "token budget"
                else "the episodes hold fewer turns than the cap")
    return judged("h04", c, share > 0.5, 3 + magnitude(1 + 10 * share), ev,
                  f"On {bad} of the {claimed} steps whose episodes are said to end at the {what} ({limit:.0f}), "
                  f"{measured}: those turns ended before any such limit, and the episode loop filed them as cut "
                  "(it misreads how a turn ended: its stop id, the generator's stopped flag, the turn count), "
                  "ending the episode there." + stage_sentence(c),
                  "Every episode said to end at a token budget or the turn cap reached it." + stage_sentence(c),
                  Measure("stops the episodes refute (share of steps)", share, 0.0, exact=True, share=True))


# Answers present, the reward's answer components ~0, and an independent scorer agreeing that none is
# right: the reward reads the answers (reward stage cleared by a measurement), the policy answers wrong
# on every episode. A fingerprint with upstream causes (every tool call refused, results cut, a context
# the policy was not trained to read: the prompt, the tool turns' tokens), hence a symptom here, where
# the policy reads what it answers from.
@rule(stage="environment", checks={"answers_never_right": Kind.SYMPTOM},
      reads=(H04_NO_ANSWER_SHARE, H05_COMPONENT_CONSTANT_GROUP_SHARE, H05_COMPONENT_MEAN, H05_ANSWER_CHECK_CHECKED,
             H05_ANSWER_CHECK_DISAGREEMENT_SHARE, H05_ANSWER_CHECK_MATCHED),
      needs=(H05_ANSWER_CHECK_CHECKED, H05_ANSWER_CHECK_MATCHED))
def _answers_never_right(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    dead, answered = answer_components_dead(m, params)
    confirmed = scorer_confirms_wrong_answers(m)
    if not dead or answered < ANSWER_PRESENT_MIN or not confirmed:
        return []
    best = max(v for _, _, v in dead)
    c = "answers_never_right"
    ev = {f"answered share (1 - {H04_NO_ANSWER_SHARE})": answered, f"{H05_ANSWER_CHECK_CHECKED} (sum)": confirmed,
          **{f"{H05_COMPONENT_MEAN.of(component=n)} (max)": v for n, _, v in dead}}
    return [Finding("h07", c, True, 2.0,
                    f"{answered:.0%} of episodes end with an answer and almost none is right: the reward and an "
                    f"independent scorer agree on the {confirmed:.0f} answers checked. The reward reads the answers; the policy "
                    "cannot find them in what it reads (the tool results, or a context it was not trained on: the "
                    "prompt, the tokens of the tool turns)." + stage_sentence(c), ev,
                    measure=Measure(f"{H05_COMPONENT_MEAN.of(component=dead[0][0])} (max)", best, DEAD_MEAN,
                                    worse="below"))]
