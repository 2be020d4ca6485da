"""Tool-call formats: how a model writes a tool call in its text, read (``decode``) and written (``render``).

One module per format in this package; defining a ``ToolFormat`` subclass with a ``name`` registers
it (``TOOL_FORMATS``), and the schema's allowed values for ``model.tool_call_format`` come from that
registry. A format knows syntax only: which spans of a turn are calls and the JSON value each holds.
What a call means (a known tool, its required argument) is checked once for every format by
``tools.parse_tool_calls``, and running it is ``tools.execute``'s.

Model output is untrusted: ``decode`` never raises on any string; a span that is not valid JSON is
reported as an error for that call.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Iterator
from typing import Any

from musique_rl.base.registry import Registry

TOOL_FORMATS = Registry("model.tool_call_format")


class ToolFormat:
    """A model family's tool-call syntax. Subclass with ``name`` (the config value) and ``args_key``
    (the key its calls hold the arguments under), and implement ``decode`` and ``render``."""

    name: str
    args_key: str = "arguments"

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        TOOL_FORMATS.register(cls.name, cls())

    def decode(self, text: str) -> Iterator[tuple[Any, str | None]]:
        """Each call the turn attempts, in order, lazily (the caller stops after a cap): the decoded
        JSON value and None, or None and the error the model will see. Nothing = no call attempted."""
        raise NotImplementedError

    def render(self, name: str, arguments: dict) -> str:
        """An assistant turn holding one call, as the model's chat format writes it."""
        raise NotImplementedError


def loads(text: str) -> tuple[Any, str | None]:
    """(value, None) or (None, the model-facing error) for one call's JSON text."""
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        return None, f"tool call is not valid JSON ({type(e).__name__})"


def tool_format(name: str) -> ToolFormat:
    """The format named by ``model.tool_call_format`` (an error lists the registered ones)."""
    return TOOL_FORMATS[name]


# Every module of this package is a format: importing them here registers them, so a new format is
# one new file (no list to extend).
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
