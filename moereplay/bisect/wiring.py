"""What the ``moereplay bisect`` command asks for, and the interface that turns it into a search and a predicate.

The command builds a :class:`BisectRequest` from its options and hands it to a :class:`Wiring`, which opens the
capture, builds the :class:`~moereplay.bisect.search.Search` for the strategy and a predicate that judges a probe by
replaying it. The default wiring (:mod:`moereplay.bisect.replay_wiring`) uses the replay engine; tests and other
front ends may inject their own. Nothing here imports torch or the replay engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from moereplay.bisect.errors import BisectError
from moereplay.bisect.observation import Observation, SignatureMatch
from moereplay.bisect.search import Search

StrategyName = Literal["calls", "mutations", "shape", "packs"]
STRATEGIES: tuple[StrategyName, ...] = ("calls", "mutations", "shape", "packs")


@dataclass(frozen=True)
class BisectRequest:
    """A bisect as the user asked for it.

    ``call``: the failing call (``mutations``, ``shape``, ``packs``), or the known-bad end of the stream
    (``calls``; default the last call of the selection). ``good``: a call known good (``calls`` only).
    ``op`` / ``layer``: restrict the stream of calls. ``mutations``: mutation specs as ``moereplay run`` writes them
    (``flip mul_topk_weights``, ``set moe_block_size=64``, ``fill 0xff`` …) — for ``mutations`` the candidates
    (empty: the wiring proposes some), for the other strategies changes applied to every probe (``fill 0xff`` to
    hunt an out-of-bounds read).
    ``packs``: kernel pack directories, oldest first. ``dimensions``: names of the shape dimensions to shrink
    (empty: all the op declares). ``backend``: as ``moereplay run --backend``. ``nonfinite`` (``calls`` only): a
    call is bad when its output holds NaN or Inf, even where the exact reference makes them too — the first call
    where they appear, whose diagnosis then says whether the kernel made them or was given them.
    """

    capture: Path
    strategy: StrategyName
    call: int | None = None
    good: int | None = None
    op: str | None = None
    layer: int | None = None
    mutations: tuple[str, ...] = ()
    packs: tuple[str, ...] = ()
    dimensions: tuple[str, ...] = ()
    backend: str | None = None
    match: SignatureMatch = SignatureMatch.KINDS
    nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise BisectError(f"unknown strategy {self.strategy!r} (one of {', '.join(STRATEGIES)})")
        if self.strategy == "packs" and len(self.packs) < 2:
            raise BisectError("--strategy packs needs at least two --pack options, oldest first")
        if self.strategy != "calls" and self.good is not None:
            raise BisectError("--good only applies to --strategy calls")
        if self.strategy != "calls" and self.nonfinite:
            raise BisectError("--nonfinite only applies to --strategy calls")

    @property
    def log_tag(self) -> str | None:
        """What distinguishes this session's default log from other sessions of the same strategy."""
        if self.strategy == "calls":
            return "nonfinite" if self.nonfinite else None
        return None if self.call is None else f"call{self.call}"

    def with_call(self, call: int | None) -> BisectRequest:
        """This request about ``call`` (the one a wiring chose when ``--call`` was left out); unchanged for ``None``."""
        return self if call is None or call == self.call else replace(self, call=call)


@dataclass(frozen=True)
class Prepared:
    """A search ready to run, the predicate that judges its probes, and a short description for people."""

    search: Search[Any, Any]
    predicate: Callable[[Any], Observation]
    description: str
    call: int | None = None
    """The call a one-call search is about (``--call``, or the capture's only call when it was left out)."""


class Wiring(Protocol):
    """Turns a request into a prepared search (raises a ``MoereplayError`` subclass when it cannot)."""

    def prepare(self, request: BisectRequest) -> Prepared: ...
