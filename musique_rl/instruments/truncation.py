"""H04: hidden truncation. Which cap ended each episode, and what the context lost.

docs/failure_modes.md defect 8: in multi-turn the completion budget includes retrieved text; a tool result
that would overflow is dropped silently and the episode ends with no answer; a rolling context can
drop the question itself. The rollout records all of it on each Episode; this module counts it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from musique_rl.base.catalogue import (
    H04_BUDGET_CAP_SHARE,
    H04_COMPLETION_AT_CAP_SHARE,
    H04_COMPLETION_LEN_MAX,
    H04_COMPLETION_LEN_MEAN,
    H04_DROPPED_TOOL_RESULTS_MEAN,
    H04_DROPPED_TOOL_RESULTS_SHARE,
    H04_NO_ANSWER_SHARE,
    H04_PROMPT_AT_CAP_SHARE,
    H04_PROMPT_LEN_MAX,
    H04_PROMPT_LEN_MEAN,
    H04_QUESTION_LEFT_CONTEXT_SHARE,
    H04_STOP_REASON_SHARE,
)
from musique_rl.env.episode import EpisodeSummary, StopReason
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch

_ANSWER = re.compile(r"<answer>\s*[^<\s]", re.IGNORECASE)  # non-empty answer


def has_answer(messages: Sequence[dict[str, Any]]) -> bool:
    """True when the LAST assistant turn holds a non-empty `<answer>` (the turn the reward reads)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return bool(_ANSWER.search(str(m.get("content") or "")))
    return False


def episode_truncation(episodes: Sequence[EpisodeSummary]) -> dict[str, float]:
    """Shares over episodes: each stop reason, budget caps, dropped tool results, no answer, lost question."""
    n = len(episodes)
    if n == 0:
        return {}
    out: dict[str, float] = {}
    reasons = [e.stop_reason for e in episodes]
    for r in StopReason:
        out[H04_STOP_REASON_SHARE.of(reason=r)] = sum(x is r for x in reasons) / n
    out[H04_BUDGET_CAP_SHARE] = sum(x is not None and x.budget for x in reasons) / n
    dropped = [e.dropped_tool_results for e in episodes]
    out[H04_DROPPED_TOOL_RESULTS_MEAN] = sum(dropped) / n
    out[H04_DROPPED_TOOL_RESULTS_SHARE] = sum(d > 0 for d in dropped) / n
    out[H04_NO_ANSWER_SHARE] = sum(not has_answer(e.messages) for e in episodes) / n
    out[H04_QUESTION_LEFT_CONTEXT_SHARE] = sum(not e.question_in_context for e in episodes) / n
    return out


@torch.no_grad()
def length_stats(
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    max_prompt_tokens: int | None = None,
    max_completion_tokens: int | None = None,
) -> dict[str, float]:
    """Prompt and completion lengths (tokens, env tokens included) and the share at each cap."""
    p = prompt_mask.sum(dim=1).float()
    c = completion_mask.sum(dim=1).float()
    out = {
        H04_PROMPT_LEN_MEAN: float(p.mean()),
        H04_PROMPT_LEN_MAX: float(p.max()),
        H04_COMPLETION_LEN_MEAN: float(c.mean()),
        H04_COMPLETION_LEN_MAX: float(c.max()),
    }
    if max_prompt_tokens:
        out[H04_PROMPT_AT_CAP_SHARE] = float((p >= max_prompt_tokens).float().mean())
    if max_completion_tokens:
        out[H04_COMPLETION_AT_CAP_SHARE] = float((c >= max_completion_tokens).float().mean())
    return out


@BATCH_INSTRUMENTS.register("h04 lengths")
def batch_lengths(b: Batch) -> dict[str, float]:
    return length_stats(b.prompt_mask, b.completion_mask, b.max_prompt_tokens, b.max_completion_tokens)


@BATCH_INSTRUMENTS.register("h04 truncation")
def batch_truncation(b: Batch) -> dict[str, float]:
    return episode_truncation(b.episodes) if b.episodes else {}
