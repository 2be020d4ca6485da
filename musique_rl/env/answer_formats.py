"""Answer formats: where a model puts its reasoning, and what assistant message a sampled turn becomes
(``model.answer_format``; each model config file chooses it: ``model=qwen3-8b`` sets ``thinking``).

- ``tags`` (Qwen2.5, Llama-3.1, the tiny model): the reasoning is ordinary text in the reply,
  ``<think>..</think>\\n<cite>..</cite>\\n<answer>..</answer>`` (the task's prompt shows it); the message
  content is the turn's text as sampled.
- ``thinking`` (Qwen3): the reasoning goes in the model's own thinking block, which Qwen3 opens every
  turn with in thinking mode (its chat template's ``enable_thinking``, passed true), and the reply
  (``<cite>``/``<answer>``, or a tool call) follows it:
  ``<think>\\nreasoning\\n</think>\\n\\n<cite>ids</cite>\\n<answer>short answer</answer>``.

Why ``thinking`` on Qwen3: ``<think>`` and ``</think>`` are Qwen3's own reasoning tokens (ids 151667
and 151668), and its chat template moves whatever precedes ``</think>`` in an assistant message into
its thinking block. An answer format with its own ``<think>`` tag after Qwen3's block therefore
re-renders as something else (the template splits at the LAST ``</think>``, so the tag's reasoning
vanishes), and a Qwen3 model asked for it writes two thinking blocks. Reading the reasoning where the
model writes it keeps one block, keeps the episode's messages rendering to the ids that were sampled
(tests/test_qwen3_answer_format.py), and needs no change to the tags models.

A ``thinking`` turn becomes ``{"content": reply, "reasoning_content": reasoning}``: the field Qwen3's
template renders as the block (``<think>\\n`` + reasoning + ``\\n</think>\\n\\n`` + reply, whatever the
turn's position in the episode) and the one vLLM's reasoning parsers fill. The block ends at the first
``</think>`` (what follows is the reply, as vLLM reads it). A turn that opens a block and never closes
it (cut at the turn budget while thinking) has no reply: its text is kept under
``unclosed_reasoning``, and ``reasoning_content`` is None. The tools and the rewards read ``content``
only (musique_rl/env/parsing.py ``parse_message``), so a tool call or an ``<answer>`` inside the
reasoning is never run or scored, and the ``format`` reward counts the block itself, not a ``<think>``
tag in the reply.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from musique_rl.base.registry import Registry
from musique_rl.env.parsing import final_text

ANSWER_FORMATS = Registry("model.answer_format")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class AnswerFormat:
    """Where the reasoning goes. Subclass with ``name`` (the config value); defining it registers it."""

    name: ClassVar[str]
    # Extra variables for the chat template (sampling and training render with the same ones).
    template_kwargs: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        ANSWER_FORMATS.register(cls.name, cls())

    def message(self, text: str) -> dict:
        """The assistant message of a sampled turn's text (never raises)."""
        raise NotImplementedError

    def final_text(self, think: str, cite_ids: list[str], answer: str) -> str:
        """A final turn as the model writes it in this format (scripted policies, tests)."""
        raise NotImplementedError

    def prompt(self, messages: list[dict]) -> list[dict]:
        """The task's messages (``Task.messages``, written for ``tags``) as this format asks for the reply."""
        return messages


class Tags(AnswerFormat):
    name = "tags"

    def message(self, text: str) -> dict:
        return {"role": "assistant", "content": text}

    def final_text(self, think: str, cite_ids: list[str], answer: str) -> str:
        return final_text(think, cite_ids, answer)


# The reasoning element of a task's reply format (``<think>reasoning</think>``, ``<think>working</think>``).
_THINK_ELEMENT_RE = re.compile(r"<think>[^<]*</think>\n?")


class Thinking(AnswerFormat):
    name = "thinking"
    template_kwargs = {"enable_thinking": True}  # Qwen3's default, said explicitly: the block is the reasoning

    def message(self, text: str) -> dict:
        head, closed, reply = text.partition(THINK_CLOSE)
        if not closed:
            opened, _, rest = text.partition(THINK_OPEN)
            if THINK_OPEN in text and not opened.strip():  # still thinking when the turn ended
                return {"role": "assistant", "content": "", "reasoning_content": None, "unclosed_reasoning": rest}
            return {"role": "assistant", "content": text, "reasoning_content": None}  # no block: all reply
        # What Qwen3's template does to an assistant message holding a block (reasoning after the
        # last <think> before </think>, newlines stripped; the reply's leading newlines dropped), so the
        # message renders as the template would render the raw turn.
        reasoning = head.rpartition(THINK_OPEN)[2].strip("\n")
        return {"role": "assistant", "content": reply.lstrip("\n"), "reasoning_content": reasoning}

    def final_text(self, think: str, cite_ids: list[str], answer: str) -> str:
        return f"<think>\n{think}\n</think>\n\n<cite>{', '.join(cite_ids)}</cite>\n<answer>{answer}</answer>"

    def prompt(self, messages: list[dict]) -> list[dict]:
        """The reply format the system prompt shows loses its ``<think>`` element: the model's own block
        holds the reasoning, and asking for the tag as well would have it write a second one."""
        return [
            {**m, "content": _THINK_ELEMENT_RE.sub("", m["content"])}
            if m.get("role") == "system" and isinstance(m.get("content"), str) else m
            for m in messages
        ]


def answer_format(name: str) -> AnswerFormat:
    """The format named by ``model.answer_format`` (an error lists the registered ones)."""
    return ANSWER_FORMATS[name]


def of_message(message: Any) -> AnswerFormat:
    """The format an assistant message was written in: ``thinking`` when it carries the block's field.
    For a second reading of a turn's text in the same shape (the reward audit re-decodes ids)."""
    thinking = isinstance(message, dict) and ("reasoning_content" in message or "unclosed_reasoning" in message)
    return ANSWER_FORMATS["thinking" if thinking else "tags"]
