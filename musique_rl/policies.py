"""Scripted policies: the ceiling (oracle), the floor (no_tool), and replay of stored episodes.

They produce episodes in the shape rollouts produce (docs/architecture.md), through the same
prompts, tool-call parser and tool execution, so scoring them tests the environment end to end.

- oracle:  follows ``question_decomposition``: one ``retrieve_documents`` call per hop whose
           query is that hop's sub-question with ``#k`` replaced by hop k's answer, then cites the
           supporting paragraphs and answers the gold answer. With the golden retriever it scores
           the maximum of every component; with bm25 its retrieval recall measures the retriever.
- no_tool: answers at once, without retrieving: a well-formed answer of "unknown" with no
           citation (format 1, everything else 0 unless the gold answer is literally unknown).
- replay:  re-scores stored episodes, a jsonl of {"id": record id, "messages": [...]} (e.g. an
           earlier run's episodes.jsonl), without generating anything (hypothesis h05).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from musique_rl.prompts import build_messages
from musique_rl.tools import content_id, execute, parse_tool_calls

log = logging.getLogger(__name__)

_REF_RE = re.compile(r"#(\d+)")


def _fmt(env_or_cfg: Any) -> str:
    f = env_or_cfg
    return str(getattr(f, "value", f))


def tool_call_text(name: str, arguments: dict, fmt: str) -> str:
    """An assistant turn holding one tool call, written as the model's chat format writes it."""
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments})
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def final_text(think: str, cite_ids: list[str], answer: str) -> str:
    return f"<think>{think}</think>\n<cite>{', '.join(cite_ids)}</cite>\n<answer>{answer}</answer>"


def sub_questions(record: dict) -> list[str]:
    """Each hop's question with ``#k`` references replaced by hop k's answer."""
    steps = record["question_decomposition"]
    answers = [s["answer"] for s in steps]

    def fill(m: re.Match) -> str:
        k = int(m.group(1))
        return answers[k - 1] if 1 <= k <= len(answers) else m.group(0)

    return [" ".join(_REF_RE.sub(fill, s["question"]).split()) for s in steps]


def _supporting_ids(record: dict, scope: str) -> list[str]:
    """Supporting paragraph ids in hop order, as the retriever of ``scope`` names them."""
    by_idx = {p["idx"]: p for p in record["paragraphs"]}
    out: dict[str, None] = {}
    for s in record["question_decomposition"]:
        p = by_idx.get(s.get("paragraph_support_idx"))
        if p is not None:
            out.setdefault(content_id(p["title"], p["paragraph_text"]) if scope == "corpus" else str(p["idx"]), None)
    return list(out)


def _episode(record: dict, messages: list[dict], stop_reason: str, tool_calls: int, tool_errors: int) -> dict:
    return {
        "id": record["id"],
        "messages": messages,
        "stop_reason": stop_reason,
        "num_turns": sum(m["role"] == "assistant" for m in messages),
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "dropped_tool_results": 0,
        "question_in_context": True,
    }


def oracle_episode(record: dict, env_cfg: Any, retriever: Any, tool_call_format: str = "hermes") -> dict:
    fmt = _fmt(tool_call_format)
    scope = _fmt(env_cfg.scope)
    messages = build_messages(record, env_cfg)
    calls = errors = 0
    if not env_cfg.supporting_in_prompt:
        for q in sub_questions(record)[: max(int(env_cfg.max_turns) - 1, 0)]:  # leave a turn to answer
            text = tool_call_text("retrieve_documents", {"query": q}, fmt)
            messages.append({"role": "assistant", "content": text})
            for call in parse_tool_calls(text, fmt):  # the real parser: the oracle tests it too
                res = execute(call, record, retriever, env_cfg)
                calls += 1
                errors += not res.ok
                messages.append({"role": "tool", "content": res.content})
    think = " -> ".join(s["answer"] for s in record["question_decomposition"])
    messages.append({"role": "assistant", "content": final_text(think, _supporting_ids(record, scope), record["answer"])})
    return _episode(record, messages, "answer", calls, errors)


def no_tool_episode(record: dict, env_cfg: Any) -> dict:
    messages = build_messages(record, env_cfg)
    messages.append({"role": "assistant", "content": final_text("I have no documents.", [], "unknown")})
    return _episode(record, messages, "answer", 0, 0)


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
        calls, errors = _count_tool_calls(ep["messages"], _fmt(tool_call_format))
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
