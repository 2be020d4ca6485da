"""Stage "inputs": data, prompts and token budgets (h04)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from musique_rl.base.catalogue import (
    BUDGET_SHARE_MAX,
    H02_LOSS_ASSISTANT_LEFT_OUT_SHARE,
    H04_BUDGET_CAP_SHARE,
    H04_COMPLETION_LEN_MAX,
    H04_DROPPED_TOOL_RESULTS_SHARE,
    H04_NO_ANSWER_SHARE,
    H04_PROMPT_AT_CAP_SHARE,
    H04_QUESTION_LEFT_CONTEXT_SHARE,
    TRL_COMPLETIONS,
    TRL_COMPLETIONS_CLIPPED_RATIO,
)
from musique_rl.doctor.evidence import Measure
from musique_rl.doctor.findings import Finding, History, judged, magnitude, mean_of, num, rule, values
from musique_rl.doctor.stages.loss import LEFT_OUT_MAX
from musique_rl.doctor.step import Kind
from musique_rl.doctor.trl_rules import CLIPPED_MAX, OURS, _ours, clipped_share

BUDGETS = (H04_BUDGET_CAP_SHARE, H04_DROPPED_TOOL_RESULTS_SHARE, H04_QUESTION_LEFT_CONTEXT_SHARE, H04_PROMPT_AT_CAP_SHARE,
           H04_NO_ANSWER_SHARE)
# Budgets binding on (nearly) every episode starve everything downstream: no episode ends with an
# answer, so every reward is the budget's. 0.95: one episode in 20 may still finish.
BUDGET_STARVES = 0.95
# TRL's completion lengths (completions/{stat})
MEAN_LENGTH = TRL_COMPLETIONS.of(stat="mean_length")
MEAN_TERMINATED_LENGTH = TRL_COMPLETIONS.of(stat="mean_terminated_length")


def budget_stops_unreached(m: Mapping[str, History], params: Mapping[str, str]) -> tuple[int, int, float] | None:
    """(steps whose episodes are said to end at a token budget while no episode of the step is as long as
    the smallest budget, steps with any episode said to end at a budget, that length), or None when
    the run does not log both or its config names no budget.

    An exact invariant: an episode cut by the turn budget holds at least ``env.max_tokens_per_turn``
    sampled tokens, one cut by the episode budget ``env.max_completion_tokens`` tokens, so a step with a
    budget stop has a completion at least min(both) long. A stop reason the lengths refute is the
    episode loop's reading of how a turn ended, not a budget.

    The lengths are the batch's completion masks: they are the episodes' own only while the loss keeps
    every sampled token (``h02/loss_assistant_left_out_share``, measured where the loss consumes the
    mask). A mask cut after the rollout shortens them; then they refute nothing (None)."""
    if (mean_of(m, H02_LOSS_ASSISTANT_LEFT_OUT_SHARE) or 0.0) > LEFT_OUT_MAX:
        return None
    per_turn, per_episode = num(params, "env.max_tokens_per_turn", 0.0), num(params, "env.max_completion_tokens", 0.0)
    budget = min(b for b in (per_turn, per_episode) if b > 0) if per_turn > 0 or per_episode > 0 else 0.0
    longest = dict(m.get(H04_COMPLETION_LEN_MAX) or [])
    claims = [(s, v) for s, v in (m.get(H04_BUDGET_CAP_SHARE) or []) if v > 0 and s in longest]
    if not budget or not claims:
        return None
    return sum(1 for s, _ in claims if longest[s] < budget), len(claims), budget


@rule(stage="inputs", checks={"question_left_context": Kind.DEFECT, "budgets_binding": Kind.SYMPTOM},
      reads=(*BUDGETS, H04_COMPLETION_LEN_MAX, H02_LOSS_ASSISTANT_LEFT_OUT_SHARE), needs=BUDGETS, thresholds=("BUDGET_SHARE_MAX", "BUDGET_STARVES"))
def _budgets(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    means = {k: statistics.fmean(values(m.get(k))) for k in BUDGETS if values(m.get(k))}
    ev = {f"{k} (mean)": v for k, v in means.items()}
    out: list[Finding] = []
    if H04_QUESTION_LEFT_CONTEXT_SHARE in means:
        # an exact invariant: the question is in every context the policy reads
        lost = means[H04_QUESTION_LEFT_CONTEXT_SHARE]
        out += judged("h04", "question_left_context", lost > 0, 3 + magnitude(1 + 100 * lost), ev,
                      f"In {lost:.0%} of episodes the question itself was truncated out of the context.",
                      "The question stays in every episode's context.",
                      Measure(f"{H04_QUESTION_LEFT_CONTEXT_SHARE} (mean)", lost, 0.0, exact=True, share=True))
    binding = (H04_BUDGET_CAP_SHARE, H04_DROPPED_TOOL_RESULTS_SHARE, H04_PROMPT_AT_CAP_SHARE)
    worst_key = max((k for k in binding if k in means), key=lambda k: means[k], default=None)
    if worst_key is None:
        return out
    w = means[worst_key]
    what = {H04_BUDGET_CAP_SHARE: "end at a token budget",
            H04_DROPPED_TOOL_RESULTS_SHARE: "silently lose a tool result to the budget",
            H04_PROMPT_AT_CAP_SHARE: "start with the prompt at its token cap"}[worst_key]
    na = means.get(H04_NO_ANSWER_SHARE)
    tail = f"; {na:.0%} end with no answer" if na is not None else ""
    starves = w >= BUDGET_STARVES and (na is None or na >= BUDGET_STARVES)
    measure = Measure(f"{worst_key} (mean)", w, BUDGET_SHARE_MAX, share=True)
    unreached = budget_stops_unreached(m, params)
    if w > BUDGET_SHARE_MAX and worst_key == H04_BUDGET_CAP_SHARE and unreached and unreached[0] == unreached[1]:
        # the lengths refute the stop reasons: environment's stop_reasons_contradict_lengths says so
        out.append(Finding("h04", "budgets_binding", False, 0.0,
                           f"{w:.0%} of episodes are said to end at a token budget, but on every such step no "
                           f"episode is {unreached[2]:.0f} tokens long (the smallest budget): no budget binds; the "
                           "stop reasons are wrong (environment stage, stop_reasons_contradict_lengths).", ev,
                           measure=measure))
    elif w > BUDGET_SHARE_MAX:
        out.append(Finding("h04", "budgets_binding", True, 2 + magnitude(w / BUDGET_SHARE_MAX),
                           f"Token budgets truncate the episodes: {w:.0%} of episodes {what}{tail}. The reward is capped "
                           "by the budget, not by the policy (raise env.max_tokens_per_turn / env.max_completion_tokens).",
                           ev, starves=starves, measure=measure))
    else:
        out.append(Finding("h04", "budgets_binding", False, 0.0, "Token budgets rarely bind.", ev, measure=measure))
    return out


# ---------------------------------------------------------------- over TRL's own metric names (trl_rules.OURS)
@rule(stage="inputs", checks={"completions_truncated": Kind.SYMPTOM},
      reads=(TRL_COMPLETIONS_CLIPPED_RATIO, MEAN_LENGTH, MEAN_TERMINATED_LENGTH, *OURS["truncation"]),
      needs=(TRL_COMPLETIONS_CLIPPED_RATIO,), thresholds=("CLIPPED_MAX",))
def _truncation(m: Mapping[str, History], params: Mapping[str, str]) -> list[Finding]:
    if _ours(m, "truncation"):
        return []
    c = clipped_share(m) or 0.0
    ev = {f"{TRL_COMPLETIONS_CLIPPED_RATIO} (mean)": c}
    mean_len = values(m.get(MEAN_LENGTH))
    term = values(m.get(MEAN_TERMINATED_LENGTH))
    if mean_len:
        ev[f"{MEAN_LENGTH} (mean)"] = statistics.fmean(mean_len)
    if term:
        ev[f"{MEAN_TERMINATED_LENGTH} (mean)"] = statistics.fmean(term)
    budget = num(params, "max_completion_length", 0.0)
    if budget:
        ev["max_completion_length (param)"] = budget
    ended = (f"; the completions that do end are {statistics.fmean(term):.3g} tokens long on average"
             if term and statistics.fmean(term) > 0 else "; no completion ever ends before the budget")
    measure = Measure(f"{TRL_COMPLETIONS_CLIPPED_RATIO} (mean)", c, CLIPPED_MAX, share=True)
    return judged("h04", "completions_truncated", c > CLIPPED_MAX, 2 + magnitude(c / CLIPPED_MAX), ev,
                  f"{c:.0%} of completions are cut at max_completion_length{ended}: the budget, not the policy, "
                  "decides those rewards (raise max_completion_length, or mask_truncated_completions=True so "
                  "cut completions do not train).",
                  f"{c:.0%} of completions are truncated.", measure)
