"""What an episode came to, typed: why it stopped (``StopReason``) and its ``EpisodeSummary``.

The rollout (core/rollout.py) decides the stop reason and fills the summary; the instruments read it
(h04's stop-reason shares, h07's void turns); ``as_dict`` is the episode dict of docs/architecture.md
that rewards, TRL's reward kwargs and ``episodes.jsonl`` hold, with the stop reason as its string.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class StopReason(StrEnum):
    """Why an episode ended (its string is what episodes.jsonl and the ``h04/stop_<reason>_share`` keys hold)."""

    ANSWER = "answer"  # a turn with a final <answer>
    MAX_TURNS = "max_turns"  # env.max_turns reached (a last tool call is not executed)
    TURN_BUDGET = "turn_budget"  # a turn cut at env.max_tokens_per_turn
    EPISODE_BUDGET = "episode_budget"  # env.max_completion_tokens over all assistant + tool ids
    NO_TOOL_CALL = "no_tool_call"  # a void turn: neither a tool call nor an answer

    @property
    def budget(self) -> bool:
        """A token cap ended the episode (as opposed to the turn cap or the policy)."""
        return self in (StopReason.TURN_BUDGET, StopReason.EPISODE_BUDGET)


@dataclass(frozen=True)
class EpisodeSummary:
    """One episode as the rewards and instruments read it (docs/architecture.md, "Episode")."""

    id: str  # the record's id
    messages: list[dict] = field(default_factory=list)  # the whole chat, system and user included
    stop_reason: StopReason | None = None
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    dropped_tool_results: int = 0  # tool results the episode budget dropped
    question_in_context: bool = True  # False: the prompt was cut and the question went with it

    def as_dict(self) -> dict[str, Any]:
        """The episode dict (rewards, TRL's reward kwargs, episodes.jsonl): the stop reason as a string."""
        return {
            "id": self.id,
            "messages": self.messages,
            "stop_reason": None if self.stop_reason is None else str(self.stop_reason),
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "dropped_tool_results": self.dropped_tool_results,
            "question_in_context": self.question_in_context,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpisodeSummary:
        """An episode dict read back (a stored or scripted episode); a stop reason that is none of
        ``StopReason``'s (a replayed episode's "replay") reads as None."""
        try:
            reason: StopReason | None = StopReason(d.get("stop_reason"))
        except ValueError:
            reason = None
        return cls(str(d.get("id", "")), list(d.get("messages") or []), reason,
                   int(d.get("num_turns", 0) or 0), int(d.get("tool_calls", 0) or 0),
                   int(d.get("tool_errors", 0) or 0), int(d.get("dropped_tool_results", 0) or 0),
                   bool(d.get("question_in_context", True)))
