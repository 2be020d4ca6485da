"""llama3_json (Llama 3.1): a bare JSON object ``{"name": .., "parameters": {..}}``, optionally after
``<|python_tag|>``, several separated by ';' or newlines. A turn that does not start with ``{`` is
prose or a final answer: no call attempted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from musique_rl.env.tool_formats import ToolFormat

_PREFIX = "<|python_tag|>"
_SEP_RE = re.compile(r"[\s;]*")


class Llama3Json(ToolFormat):
    name = "llama3_json"
    args_key = "parameters"

    def decode(self, text: str) -> Iterator[tuple[Any, str | None]]:
        stripped = text.strip()
        if stripped.startswith(_PREFIX):
            stripped = stripped[len(_PREFIX) :].strip()
        if not stripped.startswith("{"):
            return
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(stripped):
            try:
                obj, end = decoder.raw_decode(stripped, pos)
            except (ValueError, RecursionError) as e:
                yield None, f"tool call is not valid JSON ({type(e).__name__})"
                return
            yield obj, None
            pos = _SEP_RE.match(stripped, end).end()  # no slicing: linear in the text length
            if not stripped.startswith("{", pos):
                return

    def render(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments})
