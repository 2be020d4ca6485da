"""Reading the final answer from an episode: ``<think>``, ``<cite>``, ``<answer>``.

The answer is read from an assistant message's ``content``; where the model reasons in its own thinking
block (``model.answer_format=thinking``, musique_rl/env/answer_formats.py) the message holds that block
as ``reasoning_content`` and ``<think>`` is that block, so nothing inside the reasoning is ever read as
the answer or the citations. The answer is read from the LAST assistant turn (reading the first was the original
researcher's defect 9, docs/failure_modes.md). Citations are lenient about syntax (``1, 3``, ``[1, 3]``, ``1 3``, ``Document 3``,
duplicates) and strict about existence: ids outside ``valid_ids`` are dropped. Nothing here raises
on any string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TAGS = ("think", "cite", "answer")
_ID_TOKEN_RE = re.compile(r"[A-Za-z0-9_\-]+")


@dataclass
class FinalAnswer:
    think: str | None = None  # None = tag absent (not closed)
    cite: str | None = None
    answer: str | None = None
    cited_ids: list[str] = field(default_factory=list)  # unique, in order of first mention

    @property
    def tags_present(self) -> dict[str, bool]:
        return {t: getattr(self, t) is not None for t in TAGS}


def final_text(think: str, cite_ids: list[str], answer: str) -> str:
    """A final turn in the answer format read here (what the scripted policies write)."""
    return f"<think>{think}</think>\n<cite>{', '.join(cite_ids)}</cite>\n<answer>{answer}</answer>"


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last closed ``<tag>...</tag>`` pair, stripped; None when there is none.

    Why rfind instead of a regex: linear on huge strings, and 'last closed pair' is well defined
    for nested or repeated tags (``<answer>a<answer>b</answer>`` -> ``b``).
    """
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    opening = f"<{tag}>"
    start = text.rfind(opening, 0, close)
    if start < 0:
        return None
    return text[start + len(opening) : close].strip()


def parse_citations(cite: str | None, valid_ids: set[str] | None = None) -> list[str]:
    """Ids in a ``<cite>`` body, unique in order; tokens not in ``valid_ids`` are ignored.

    Tokenising on anything but letters, digits, '-' and '_' accepts ``1, 3``, ``[1, 3]``, ``1 3``,
    ``Document 3`` and ``ids: 1;3``; the word 'Document' is then dropped as not a valid id. Without
    ``valid_ids`` only numeric tokens count.
    """
    if not cite:
        return []
    seen: dict[str, None] = {}
    for tok in _ID_TOKEN_RE.findall(cite):
        if tok.isdigit():
            tok = tok.lstrip("0") or "0"  # "03" -> "3" (no int(): huge digit strings raise)
        ok = tok in valid_ids if valid_ids is not None else tok.isdigit()
        if ok:
            seen.setdefault(tok, None)
    return list(seen)


def parse_final(text: str, valid_ids: set[str] | None = None) -> FinalAnswer:
    """Parse one assistant turn's text; a non-string gives an empty FinalAnswer."""
    if not isinstance(text, str):
        return FinalAnswer()
    think, cite, answer = (extract_tag(text, t) for t in TAGS)
    return FinalAnswer(think=think, cite=cite, answer=answer, cited_ids=parse_citations(cite, valid_ids))


def parse_message(message, valid_ids: set[str] | None = None) -> FinalAnswer:
    """Parse one assistant message: its ``content`` as ``parse_final`` does; a message of the
    ``thinking`` answer format (it has ``reasoning_content``) counts ``think`` as its thinking block,
    present when the block was closed, whatever ``<think>`` tags its reply holds."""
    if not isinstance(message, dict):
        return FinalAnswer()
    final = parse_final(_content_text(message.get("content")), valid_ids)
    if "reasoning_content" in message:
        reasoning = message["reasoning_content"]
        final.think = reasoning.strip() if isinstance(reasoning, str) else None
    return final


def _content_text(content) -> str:
    """Message content as text (OpenAI content may be a list of {"type": "text", "text": ..} parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def assistant_message(messages, which: str = "last") -> dict:
    """The last (or, for the planted fault ``first_turn_reward``, the first) assistant message; {} when none."""
    if not isinstance(messages, list):
        return {}
    turns = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    if not turns:
        return {}
    return turns[-1] if which == "last" else turns[0]


def assistant_turn(messages, which: str = "last") -> str:
    """Text (``content``) of the last (or, for the planted fault ``first_turn_reward``, the first) assistant turn."""
    return _content_text(assistant_message(messages, which).get("content"))
