"""The things a search asks the predicate about.

Each probe has a ``key`` — plain, hashable, JSON-able data that identifies it within its search (a search caches
observations by key, and a resumed session checks each recorded key against the probe the search asks for) —
and a human ``label``. The items themselves (capture calls, mutations, kernel packs) ride along, unlogged, so a
predicate gets what it needs without a lookup.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Probe(Protocol):
    """What every probe offers the session and its log."""

    @property
    def key(self) -> Hashable: ...

    @property
    def label(self) -> str: ...


def key_json(key: Any) -> Any:
    """A probe key (or config) as it reads back from a JSON log (tuples become lists), for comparing with it."""
    return json.loads(json.dumps(key))


@dataclass(frozen=True)
class ItemProbe(Generic[T]):
    """One item of an ordered sequence: a call of the capture stream, a kernel pack, a legal dimension value."""

    index: int
    item: T = field(compare=False, hash=False)
    label: str = field(default="", compare=False, hash=False)

    @property
    def key(self) -> int:
        return self.index


@dataclass(frozen=True)
class SubsetProbe(Generic[T]):
    """A subset of a list of mutations, as ascending indices into that list (empty = the baseline call)."""

    indices: tuple[int, ...]
    items: tuple[T, ...] = field(default=(), compare=False, hash=False)
    labels: tuple[str, ...] = field(default=(), compare=False, hash=False)

    @property
    def key(self) -> tuple[int, ...]:
        return self.indices

    @property
    def label(self) -> str:
        if not self.indices:
            return "{} (baseline)"
        return "{" + ", ".join(self.labels) + "}"


@dataclass(frozen=True)
class ShapeProbe:
    """A shape to try: one value per dimension, in the search's dimension order."""

    values: tuple[tuple[str, int], ...]

    @property
    def key(self) -> tuple[tuple[str, int], ...]:
        return self.values

    @property
    def shape(self) -> Mapping[str, int]:
        return dict(self.values)

    @property
    def label(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.values)
