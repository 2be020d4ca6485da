"""H07: the shape of multi-turn episodes: turns, tool calls, tool failures."""

from __future__ import annotations

from collections.abc import Sequence

from musique_rl.base.catalogue import (
    H07_NO_TOOL_CALL_SHARE,
    H07_TOOL_CALLS_MEAN,
    H07_TOOL_FAILURE_RATE,
    H07_TURNS_MEAN,
    H07_VOID_EPISODE_SHARE,
    H07_VOID_TURN_SHARE,
)
from musique_rl.env.episode import EpisodeSummary, StopReason
from musique_rl.instruments.batch import BATCH_INSTRUMENTS, Batch


def episode_shape(episodes: Sequence[EpisodeSummary]) -> dict[str, float]:
    """Means over episodes of turns and tool calls; tool failure rate = failed calls / calls."""
    n = len(episodes)
    if n == 0:
        return {}
    turns = [e.num_turns for e in episodes]
    calls = [e.tool_calls for e in episodes]
    errors = [e.tool_errors for e in episodes]
    void = sum(e.stop_reason is StopReason.NO_TOOL_CALL for e in episodes)
    return {
        H07_TURNS_MEAN: sum(turns) / n,
        H07_TOOL_CALLS_MEAN: sum(calls) / n,
        H07_NO_TOOL_CALL_SHARE: sum(c == 0 for c in calls) / n,
        H07_TOOL_FAILURE_RATE: sum(errors) / max(sum(calls), 1),
        # A void turn is an assistant turn with neither a tool call nor an answer: the rollout ends
        # the episode there (StopReason.NO_TOOL_CALL), whatever the tool-call format.
        H07_VOID_TURN_SHARE: void / max(sum(turns), 1),
        H07_VOID_EPISODE_SHARE: void / n,
    }


@BATCH_INSTRUMENTS.register("h07 episode shape")
def batch_shape(b: Batch) -> dict[str, float]:
    return episode_shape(b.episodes) if b.episodes else {}
