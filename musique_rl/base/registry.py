"""Named plug-ins: each is registered once, where it is written; the schema and the code read here.

Why a registry and not Hydra ``_target_``: users name plug-ins by the short words they type and
sweep over (``env.retriever=bm25,hybrid``, ``+fault=blind_context``); a ``_target_`` would put
module paths into every override, README command and MLflow param. The schema builds each key's
allowed values from its registry (``choices``), so a typo still fails at composition, before any
compute, with the registered names listed.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Any


class Registry:
    """Names -> plug-ins for one config key (the key names the culprit in every error)."""

    def __init__(self, key: str):
        self.key = key
        self._items: dict[str, Any] = {}

    def register(self, name: str, obj: Any = None) -> Any:
        """``@REG.register("name")`` on a class or function, or ``REG.register("name", obj)``."""

        def add(o: Any) -> Any:
            if name in self._items:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self._items[name] = o
            return o

        return add if obj is None else add(obj)

    def __getitem__(self, name: Any) -> Any:
        try:
            return self._items[str(name)]
        except KeyError:
            raise ValueError(f"{self.key}={str(name)!r}: choose from {sorted(self._items)}") from None

    def __contains__(self, name: Any) -> bool:
        return str(name) in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def values(self) -> list[Any]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def choices(self, enum_name: str, module: str, extra: tuple[str, ...] = ()) -> type[StrEnum]:
        """The registered names as a StrEnum for a typed schema field (``extra`` first: names the
        schema allows that are not plug-ins). ``module`` is where the enum is bound, so that a
        composed config pickles for submitit jobs."""
        names = list(extra) + [n for n in self._items if n not in extra]
        return StrEnum(enum_name, [(n, n) for n in names], module=module)

