"""hermes (Qwen2.5, Qwen3): ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``.

An unclosed final ``<tool_call>`` (generation stopped on the closing tag) is read to the end."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from musique_rl.env.tool_formats import ToolFormat, loads

_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class Hermes(ToolFormat):
    name = "hermes"
    args_key = "arguments"

    def decode(self, text: str) -> Iterator[tuple[Any, str | None]]:
        for match in _CALL_RE.finditer(text):
            yield loads(match.group(1).strip())

    def render(self, name: str, arguments: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
