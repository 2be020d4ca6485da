"""The retrieval tools: checking the tool calls a model wrote, executing them, rendering documents.

Model output is untrusted: a malformed call (bad JSON, unknown tool, missing or empty argument)
becomes a ``ToolCall`` with ``error`` set, and executing it returns an error message for the model
(``ToolResult.ok = False``), counted by the caller. Nothing here raises on model text.

Document ids: in question scope a document's id is its paragraph ``idx`` (as the original researcher's
vf_musique: "0".."19"); in corpus scope it is ``content_id(title, text)``, a short hash of the
paragraph, so a record's supporting paragraphs keep recognisable ids in any corpus that holds them
(rewards match on either form, see ``paragraph_ids``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from musique_rl.env.config import EnvConfig
from musique_rl.env.tool_formats import tool_format

TOOL_ARGS = {"retrieve_documents": "query", "get_document": "id"}  # tool -> its one required argument
# A turn with more calls than this gets them plus one error call: a degenerate policy that repeats
# a call 100,000 times must not stall the rollout (measured: 85 s to parse and run one such turn).
MAX_CALLS_PER_TURN = 16

_DOC_ID_RE = re.compile(r"^Document ID: (\S+)", re.MULTILINE)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set for a malformed call; the message the model will see


@dataclass
class ToolResult:
    content: str  # what goes into the {"role": "tool"} message
    ok: bool
    doc_ids: list[str] = field(default_factory=list)
    error: str | None = None


# ---------------------------------------------------------------- documents
def content_id(title: str, text: str) -> str:
    """Corpus-scope id of a paragraph: 'c' + 7 hex digits of sha1(title + text)."""
    return "c" + hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:7]


def paragraph_ids(paragraph: dict) -> set[str]:
    """Every id under which a record paragraph can appear in a tool result (either scope)."""
    return {str(paragraph["idx"]), content_id(paragraph["title"], paragraph["paragraph_text"])}


def as_document(paragraph: dict) -> dict:
    """A record paragraph as a question-scope document {id, title, text}."""
    return {"id": str(paragraph["idx"]), "title": paragraph["title"], "text": paragraph["paragraph_text"]}


def format_documents(docs: list[dict]) -> str:
    """Render documents in the original researcher's format, a blank line between them.

    Accepts documents ({id, title, text}) or raw MuSiQue paragraphs ({idx, title, paragraph_text}).
    """
    blocks = []
    for d in docs:
        if "paragraph_text" in d:
            d = as_document(d)
        blocks.append(f"Document ID: {d['id']}\n# {d['title']}\n{d['text']}")
    return "\n\n".join(blocks)


def parse_document_ids(tool_content: str) -> list[str]:
    """Ids of the documents rendered in a tool result, in order (error messages hold none)."""
    if not isinstance(tool_content, str):
        return []
    return _DOC_ID_RE.findall(tool_content)


# ---------------------------------------------------------------- parsing calls
def _validate(obj: Any, args_key: str) -> ToolCall:
    """Turn one decoded JSON value into a ToolCall, with an error if it is not a valid call."""
    if not isinstance(obj, dict):
        return ToolCall(name="", error="tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", error="tool call has no 'name'")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return ToolCall(name=name, error=f"arguments of {name} are not valid JSON")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name=name, error=f"arguments of {name} must be an object")
    if name not in TOOL_ARGS:
        return ToolCall(name=name, arguments=args, error=f"unknown tool '{name}'; use one of {sorted(TOOL_ARGS)}")
    key = TOOL_ARGS[name]
    value = args.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # get_document(3) is a fair request for id "3"
    if not isinstance(value, str) or not value.strip():
        return ToolCall(name=name, arguments=args, error=f"{name} needs a non-empty '{key}' string")
    return ToolCall(name=name, arguments={**args, key: value.strip()})


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """All tool calls in one assistant turn, valid or not (empty list = no call attempted).

    ``fmt`` (``model.tool_call_format``) names the syntax (musique_rl/env/tool_formats/); each call
    it finds is then checked here, the same for every format."""
    if not isinstance(text, str):
        return []
    form = tool_format(fmt)
    calls: list[ToolCall] = []
    for obj, err in form.decode(text):
        if len(calls) == MAX_CALLS_PER_TURN:
            calls.append(ToolCall(name="", error=f"more than {MAX_CALLS_PER_TURN} tool calls in one turn; the rest were ignored"))
            break
        calls.append(ToolCall(name="", error=err) if err else _validate(obj, form.args_key))
    return calls


# ---------------------------------------------------------------- executing calls
def _error(msg: str) -> ToolResult:
    return ToolResult(content=f"Error: {msg}", ok=False, error=msg)


def execute(call: ToolCall, record: dict, retriever: Any, env_cfg: EnvConfig) -> ToolResult:
    """Run one call against ``retriever`` for ``record``. Errors become the tool message; never raises
    for model-caused problems (a bug in a retriever still raises: that is ours, not the model's)."""
    if call.error:
        return _error(call.error)
    if env_cfg.supporting_in_prompt:
        return _error("no tools are available in this task; answer from the documents given")
    if call.name == "retrieve_documents":
        docs = retriever.retrieve(call.arguments["query"], record, env_cfg.top_n)
        if not docs:
            return ToolResult(content="No documents found.", ok=True)
        return ToolResult(content=format_documents(docs), ok=True, doc_ids=[d["id"] for d in docs])
    if call.name == "get_document":
        if not env_cfg.get_document_tool:
            return _error("unknown tool 'get_document'; use retrieve_documents")
        doc = retriever.get(call.arguments["id"], record)
        if doc is None:
            return _error(f"no document with id '{call.arguments['id']}'")
        return ToolResult(content=format_documents([doc]), ok=True, doc_ids=[doc["id"]])
    return _error(f"unknown tool '{call.name}'")
