"""Binary search for the first bad index between a good and a bad one, with skips handled like ``git bisect``.

Shared by the call-stream, shape and pack strategies. The ordered items are assumed monotone: good up to some
index, bad from there on. An unresolved probe is a *skip*: the search tries the untested index nearest the middle
instead, and when only skipped indices remain between the last good and the first bad, it stops and reports the
whole range — the first bad is one of the skipped indices or the first known bad.

Cost: about log2(bad - good) probes, plus one per skip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

from moereplay.bisect.observation import Observation, Outcome

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class Interval:
    """Where the first bad index lies after a search.

    ``last_good`` is the largest index known good (the search's lower bound, possibly a virtual ``-1``),
    ``first_known_bad`` the smallest index known bad, ``skipped`` the unresolved indices strictly between them.
    """

    last_good: int
    first_known_bad: int
    skipped: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.last_good >= self.first_known_bad:
            raise ValueError(f"empty interval ({self.last_good}, {self.first_known_bad}]")
        if any(not self.last_good < index < self.first_known_bad for index in self.skipped):
            raise ValueError("skipped indices must lie inside the interval")

    @property
    def exact(self) -> bool:
        """Whether the first bad index is known (nothing is left between the last good and the first bad)."""
        return self.first_known_bad == self.last_good + 1

    @property
    def candidates(self) -> tuple[int, ...]:
        """Every index that may be the first bad one, ascending."""
        return (*self.skipped, self.first_known_bad)


def bisect_interval(
    good: int,
    bad: int,
    ask: Callable[[int], Generator[P, Observation, Outcome]],
    on_narrow: Callable[[Interval], None] | None = None,
) -> Generator[P, Observation, Interval]:
    """Narrow ``(good, bad]`` to the first bad index; ``ask(index)`` observes one index and classifies it.

    ``good`` and ``bad`` are known (or assumed) already and are not asked about. Each step asks the index nearest
    the middle that is not yet skipped (ties go to the lower index). ``on_narrow`` hears the interval before each
    question (for progress displays).
    """
    if good >= bad:
        raise ValueError(f"bisect needs good < bad, got {good} and {bad}")
    skipped: set[int] = set()
    while True:
        middle = (good + bad) / 2
        pick = _nearest_untested(good, bad, middle, skipped)
        if pick is None:
            break
        if on_narrow is not None:
            on_narrow(Interval(good, bad, tuple(sorted(index for index in skipped if good < index < bad))))
        outcome = yield from ask(pick)
        if outcome is Outcome.GOOD:
            good = pick
        elif outcome is Outcome.BAD:
            bad = pick
        else:
            skipped.add(pick)
    return Interval(good, bad, tuple(sorted(index for index in skipped if good < index < bad)))


def _nearest_untested(good: int, bad: int, middle: float, skipped: set[int]) -> int | None:
    """The index strictly inside ``(good, bad)`` and not skipped that is nearest ``middle`` (ties: the lower).

    Merges the indices below and above the middle in order of distance, so the cost is proportional to the skips
    near the middle, not to the interval.
    """
    low = math.floor(middle)
    high = low + 1
    while low > good or high < bad:
        take_low = low > good and (high >= bad or middle - low <= high - middle)
        index = low if take_low else high
        if take_low:
            low -= 1
        else:
            high += 1
        if good < index < bad and index not in skipped:
            return index
    return None
