"""H07: the shape of multi-turn episodes: turns, tool calls, tool failures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch


def episode_shape(episodes: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means over episodes of turns and tool calls; tool failure rate = failed calls / calls."""
    n = len(episodes)
    if n == 0:
        return {}
    turns = [int(e.get("num_turns", 0) or 0) for e in episodes]
    calls = [int(e.get("tool_calls", 0) or 0) for e in episodes]
    errors = [int(e.get("tool_errors", 0) or 0) for e in episodes]
    return {
        "h07/turns_mean": sum(turns) / n,
        "h07/tool_calls_mean": sum(calls) / n,
        "h07/no_tool_call_share": sum(c == 0 for c in calls) / n,
        "h07/tool_failure_rate": sum(errors) / max(sum(calls), 1),
        # A void turn is an assistant turn with neither a tool call nor an answer: the rollout ends
        # the episode there (stop_reason "no_tool_call"), whatever the tool-call format.
        "h07/void_turn_share": sum(e.get("stop_reason") == "no_tool_call" for e in episodes) / max(sum(turns), 1),
        "h07/void_episode_share": sum(e.get("stop_reason") == "no_tool_call" for e in episodes) / n,
    }


@BATCH_INSTRUMENTS.register("h07 episode shape")
def batch_shape(b: Batch) -> dict[str, float]:
    return episode_shape([dict(e) for e in b.episodes]) if b.episodes else {}
