"""What the policy sees at the start of an episode: system prompt, user message, tool schemas.

Kept short on purpose: the embedded tiny model has a 2k-token context and a 512-token byte-level
BPE (roughly 2-3 characters a token), so the system prompt is budgeted at ~100 tokens. The tool
call syntax itself is not spelled out here: the chat template renders the tool schemas
(`tool_schemas`) in the model's own format (hermes / llama3_json), the same way when sampling and
when training (docs/failure_modes.md defect 2).
"""

from __future__ import annotations

from typing import Any

from musique_rl.env.tools import format_documents

# The final-answer format every reward parses (musique_rl/env/parsing.py).
ANSWER_FORMAT = "<think>reasoning</think>\n<cite>ids</cite>\n<answer>short answer</answer>"

SYSTEM_PROMPT = (
    "Answer the multi-hop question. Search with retrieve_documents(query), one fact per query; "
    "results start with 'Document ID: n'. When you know the answer, reply:\n" + ANSWER_FORMAT + "\n"
    "cite the ids of the documents you used."
)

# Single-step mode (env.supporting_in_prompt, hypothesis h07): documents in the prompt, no tools.
SYSTEM_PROMPT_NO_TOOLS = (
    "Answer the multi-hop question from the documents given. Reply:\n" + ANSWER_FORMAT + "\n"
    "cite the ids of the documents you used."
)

# The control task (env.task=arith): one assistant turn, no tool, no documents, no citation.
ARITH_ANSWER_FORMAT = "<think>working</think>\n<answer>number</answer>"
ARITH_SYSTEM_PROMPT = "Solve the arithmetic word problem. Reply:\n" + ARITH_ANSWER_FORMAT


def is_arith(env_cfg: Any) -> bool:
    """The single-turn control task (``env.task=arith``, musique_rl/env/arith.py)."""
    return str(getattr(env_cfg, "task", "musique")) == "arith"


_RETRIEVE = {
    "type": "function",
    "function": {
        "name": "retrieve_documents",
        "description": "Search the documents; returns the best matches with their ids.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look for"}},
            "required": ["query"],
        },
    },
}

_GET_DOCUMENT = {
    "type": "function",
    "function": {
        "name": "get_document",
        "description": "Return one document by its id.",
        "parameters": {
            "type": "object",
            "properties": {"id": {"type": "string", "description": "a document id"}},
            "required": ["id"],
        },
    },
}


def tool_schemas(env_cfg: Any) -> list[dict]:
    """OpenAI function schemas offered to the model (none in single-step mode or the arith task)."""
    if env_cfg.supporting_in_prompt or is_arith(env_cfg):
        return []
    schemas = [_RETRIEVE]
    if env_cfg.get_document_tool:
        schemas.append(_GET_DOCUMENT)
    return [dict(s) for s in schemas]


def build_messages(record: dict, env_cfg: Any) -> list[dict]:
    """System + user messages for one record.

    With ``env.supporting_in_prompt`` the supporting paragraphs (ids as in the tool results) are
    rendered before the question, and no tool is offered: the whole task is one assistant turn.
    Under ``env.task=arith`` the question alone, under the task's own system prompt (no tool).
    """
    if is_arith(env_cfg):
        return [
            {"role": "system", "content": ARITH_SYSTEM_PROMPT},
            {"role": "user", "content": f"Question: {record['question']}"},
        ]
    if env_cfg.supporting_in_prompt:
        supporting = [p for p in record["paragraphs"] if p.get("is_supporting")]
        user = f"{format_documents(supporting)}\n\nQuestion: {record['question']}"
        return [
            {"role": "system", "content": SYSTEM_PROMPT_NO_TOOLS},
            {"role": "user", "content": user},
        ]
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Question: {record['question']}"},
    ]
