"""Scripted policies: the ceiling (oracle), the floor (no_tool), and replay of stored episodes.

They produce episodes in the shape rollouts produce (docs/architecture.md), through the same
prompts, tool-call parser and tool execution, so scoring them tests the environment end to end.

- oracle:  the task's best episode (``Task.oracle``). For musique it follows
           ``question_decomposition``: one ``retrieve_documents`` call per hop whose query is that
           hop's sub-question with ``#k`` replaced by hop k's answer, then cites the supporting
           paragraphs and answers the gold answer. With the golden retriever it scores the
           maximum of every component; with bm25 its retrieval recall measures the retriever.
- no_tool: answers at once, without retrieving: a well-formed answer of "unknown" with no
           citation (format 1, everything else 0 unless the gold answer is literally unknown).
- replay:  re-scores stored episodes, a jsonl of {"id": record id, "messages": [...]} (e.g. an
           earlier run's episodes.jsonl), without generating anything (hypothesis h05).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from musique_rl.base.registry import Registry
from musique_rl.env.config import EnvConfig
from musique_rl.env.episode import EpisodeSummary, StopReason
from musique_rl.env.parsing import final_text
from musique_rl.env.prompts import build_messages
from musique_rl.env.tasks import task_for
from musique_rl.env.tools import parse_tool_calls

log = logging.getLogger(__name__)


def _episode(record: dict, messages: list[dict], stop_reason: StopReason, tool_calls: int, tool_errors: int) -> dict:
    return EpisodeSummary(record["id"], messages, stop_reason, sum(m["role"] == "assistant" for m in messages),
                          tool_calls, tool_errors).as_dict()


def oracle_episode(record: dict, env_cfg: EnvConfig, retriever: Any, tool_call_format: str = "hermes") -> dict:
    """The ceiling: the run's task writes its best episode (musique_rl/env/tasks/)."""
    messages, calls, errors = task_for(env_cfg).oracle(record, env_cfg, retriever, tool_call_format)
    return _episode(record, messages, StopReason.ANSWER, calls, errors)


def no_tool_episode(record: dict, env_cfg: EnvConfig) -> dict:
    messages = build_messages(record, env_cfg)
    messages.append({"role": "assistant", "content": final_text("I have no documents.", [], "unknown")})
    return _episode(record, messages, StopReason.ANSWER, 0, 0)


def _count_tool_calls(messages: list[dict], fmt: str) -> tuple[int, int]:
    calls = sum(len(parse_tool_calls(m.get("content") or "", fmt)) for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), str))
    errors = sum(1 for m in messages if m.get("role") == "tool" and str(m.get("content", "")).startswith("Error:"))
    return calls, errors


def replay_episodes(path: str, records_by_id: dict[str, dict], tool_call_format: str = "hermes") -> Iterator[dict]:
    """Stored episodes whose record is loaded; a line with an unknown id is skipped and counted
    (logged), a malformed line is an error naming the file and line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"replay_path={path!r}: file not found")
    missing = 0
    yielded = 0
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ep = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"replay_path={path!r} line {lineno}: not valid JSON ({e})") from e
        if not isinstance(ep, dict) or not isinstance(ep.get("messages"), list) or "id" not in ep:
            raise ValueError(f"replay_path={path!r} line {lineno}: expected an object with 'id' and a 'messages' list")
        if ep["id"] not in records_by_id:
            missing += 1
            continue
        calls, errors = _count_tool_calls(ep["messages"], str(tool_call_format))
        out = {
            "id": ep["id"],
            "messages": ep["messages"],
            "stop_reason": ep.get("stop_reason", "replay"),
            "num_turns": ep.get("num_turns", sum(m.get("role") == "assistant" for m in ep["messages"] if isinstance(m, dict))),
            "tool_calls": ep.get("tool_calls", calls),
            "tool_errors": ep.get("tool_errors", errors),
            "dropped_tool_results": ep.get("dropped_tool_results", 0),
            "question_in_context": ep.get("question_in_context", True),
        }
        yielded += 1
        yield out
    if missing:
        log.warning("replay: %d episode(s) in %s name records not in env.data; skipped", missing, path)
    if not yielded:
        raise ValueError(f"replay_path={path!r}: no episode matches a record of env.data ({missing} unknown ids)")


# ---------------------------------------------------------------- the registry
# The scripted policies by the name `policy=` gives them: (env, records, tool_call_format=,
# replay_path=) -> episodes. The schema's `policy` values are these plus `model`, the configured LLM
# (rollouts, in the RL core).
POLICIES = Registry("policy")


@POLICIES.register("oracle")
def oracle_episodes(env_cfg: EnvConfig, records: list[dict], *, tool_call_format: str,
                    replay_path: str | None = None) -> Iterator[dict]:
    from musique_rl.env.retrieval import build_retriever

    retriever = build_retriever(env_cfg, records)
    return (oracle_episode(r, env_cfg, retriever, tool_call_format) for r in records)


@POLICIES.register("no_tool")
def no_tool_episodes(env_cfg: EnvConfig, records: list[dict], *, tool_call_format: str,
                     replay_path: str | None = None) -> Iterator[dict]:
    return (no_tool_episode(r, env_cfg) for r in records)


@POLICIES.register("replay")
def replayed_episodes(env_cfg: EnvConfig, records: list[dict], *, tool_call_format: str,
                      replay_path: str | None = None) -> Iterator[dict]:
    if not replay_path:
        raise ValueError("policy=replay needs replay_path=<jsonl of {id, messages}> (e.g. an earlier episodes.jsonl)")
    return replay_episodes(replay_path, {r["id"]: r for r in records}, tool_call_format)
