"""Strategy ``calls``: the first bad item of an ordered stream (the capture's calls, ordered by step and layer).

Assumes the stream is monotone — good before the first bad item, bad from there on — as ``git bisect`` assumes of
history. The known-bad end is probed first (it confirms the failure and, without a given target, fixes the signature
being hunted); the known-good end is trusted (default: a virtual good item before the first). Items that fail with
another signature, or cannot be judged, are skipped; when skips leave several candidates the result is the range.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from moereplay.bisect.errors import BisectError
from moereplay.bisect.interval import Interval, bisect_interval
from moereplay.bisect.observation import Outcome, Signature, SignatureMatch
from moereplay.bisect.probes import ItemProbe
from moereplay.bisect.search import Asking, Search

T = TypeVar("T")

FirstBadStatus = Literal["found", "ambiguous", "no_failure", "unresolved_end"]


@dataclass(frozen=True)
class FirstBadResult:
    """Where the stream turns bad.

    ``found``: ``first_bad`` is the index; ``ambiguous``: skips leave ``candidates`` (ascending, the last one known
    bad); ``no_failure``: the known-bad end passes; ``unresolved_end``: the known-bad end cannot be judged or fails
    with another signature. ``last_good`` is ``None`` when no item was known or found good.
    """

    status: FirstBadStatus
    first_bad: int | None
    candidates: tuple[int, ...]
    last_good: int | None
    labels: tuple[str, ...]
    target: Signature | None
    numbers: tuple[int, ...] = ()
    """The candidates' numbers as the person knows them (a capture's call numbers); empty: their positions."""

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "first_bad": self.first_bad,
            "candidates": list(self.candidates),
            "candidate_labels": list(self.labels),
            "candidate_numbers": list(self.numbers or self.candidates),
            "last_good": self.last_good,
            "target": None if self.target is None else self.target.to_json(),
        }

    def lines(self) -> tuple[str, ...]:
        if self.status == "found":
            if self.numbers:  # the label names the call by its number already
                return (f"first bad: {self.labels[0]}", f"failure: {self.target}")
            return (f"first bad: {self.labels[0]} (item {self.first_bad})", f"failure: {self.target}")
        if self.status == "ambiguous":
            listed = ", ".join(
                label if self.numbers else f"{label} (item {index})"
                for index, label in zip(self.candidates, self.labels, strict=True)
            )
            return (
                f"first bad is one of {len(self.candidates)} (skips left it ambiguous): {listed}",
                f"failure: {self.target}",
            )
        if self.status == "no_failure":
            return ("no failure: the known-bad end of the stream passes",)
        return ("unresolved: the known-bad end of the stream cannot be judged or fails differently",)


class FirstBadSearch(Search[ItemProbe[T], FirstBadResult], Generic[T]):
    """Binary search for the first bad item; ``known_good`` / ``known_bad`` bound the search (indices)."""

    kind = "calls"

    def __init__(
        self,
        items: Sequence[T],
        *,
        labels: Sequence[str] | None = None,
        known_good: int | None = None,
        known_bad: int | None = None,
        target: Signature | None = None,
        match: SignatureMatch = SignatureMatch.KINDS,
        numbers: Sequence[int] | None = None,
        noun: str = "item",
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """``numbers``: each item's number as the person typed it (a capture's call numbers; default the positions),
        used with ``noun`` ("call") in progress and result messages; ``known_good`` / ``known_bad`` stay positions."""
        super().__init__(target=target, match=match, settings=settings)
        if not items:
            raise BisectError("the stream to bisect is empty")
        if labels is not None and len(labels) != len(items):
            raise BisectError(f"{len(labels)} labels for {len(items)} items")
        if numbers is not None and len(numbers) != len(items):
            raise BisectError(f"{len(numbers)} numbers for {len(items)} items")
        self.numbers = tuple(numbers) if numbers is not None else None
        self.noun = noun
        self.items = tuple(items)
        self.labels = tuple(labels) if labels is not None else tuple(str(item) for item in items)
        self.known_good = -1 if known_good is None else known_good
        self.known_bad = len(items) - 1 if known_bad is None else known_bad
        if not -1 <= self.known_good < self.known_bad < len(items):
            raise BisectError(
                f"need -1 <= known good < known bad < {len(items)}, got {self.known_good} and {self.known_bad}"
            )

    def _number(self, index: int) -> int:
        return index if self.numbers is None else self.numbers[index]

    def probe_at(self, index: int) -> ItemProbe[T]:
        return ItemProbe(index, self.items[index], self.labels[index])

    def _config(self) -> dict[str, Any]:
        # A capture may hold thousands of calls: the log header keeps a digest of the labels, not the list.
        digest = hashlib.sha256(json.dumps(self.labels).encode()).hexdigest()[:16]
        return {
            "items": len(self.items),
            "labels_sha256": digest,
            "known_good": self.known_good,
            "known_bad": self.known_bad,
        }

    def _narrowed(self, interval: Interval) -> None:
        low, high = interval.last_good + 1, interval.first_known_bad
        skipped = f", {len(interval.skipped)} skipped" if interval.skipped else ""
        self._set_progress(
            f"first bad is one of {self.noun}s {self._number(low)}..{self._number(high)} "
            f"({high - low + 1} left{skipped})",
            last_good=interval.last_good,
            first_known_bad=interval.first_known_bad,
            skipped=list(interval.skipped),
        )

    def _run(self) -> Asking[ItemProbe[T], FirstBadResult]:
        self._set_progress(
            f"confirming the failure at the known-bad end, {self.noun} {self._number(self.known_bad)}"
        )
        observation = yield from self._ask(self.probe_at(self.known_bad))
        self._adopt_target(observation)
        outcome = self.classify(observation)
        if outcome is not Outcome.BAD:
            status: FirstBadStatus = "no_failure" if outcome is Outcome.GOOD else "unresolved_end"
            return FirstBadResult(status, None, (), None, (), self.target)
        interval = yield from bisect_interval(
            self.known_good,
            self.known_bad,
            lambda index: self._ask_outcome(self.probe_at(index)),
            self._narrowed,
        )
        last_good = None if interval.last_good < 0 else interval.last_good
        candidates = interval.candidates
        labels = tuple(self.labels[index] for index in candidates)
        numbers = () if self.numbers is None else tuple(self.numbers[index] for index in candidates)
        if interval.exact:
            return FirstBadResult(
                "found", interval.first_known_bad, candidates, last_good, labels, self.target, numbers
            )
        return FirstBadResult("ambiguous", None, candidates, last_good, labels, self.target, numbers)
