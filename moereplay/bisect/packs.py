"""Strategy ``packs``: the first kernel pack (vLLM release) in an ordered list where the behaviour changes.

Two packs (A vs B) are simply a list of two. Both ends are run first; their *behaviours* (outcome, and for a failure
its signature under the search's match policy) must differ, or there is nothing to find. Between them the search
bisects: a pack that behaves like the first one is on the old side, one that behaves like the last is on the new
side, anything else (a pack that cannot run the call, a third kind of failure) is skipped — so the search finds
where *this* change happened, whether it is a regression (good → bad) or a fix (bad → good).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from moereplay.bisect.errors import BisectError
from moereplay.bisect.interval import Interval, bisect_interval
from moereplay.bisect.observation import Observation, Outcome, SignatureMatch
from moereplay.bisect.probes import ItemProbe
from moereplay.bisect.search import Asking, Search

T = TypeVar("T")

PackStatus = Literal["found", "ambiguous", "no_change", "endpoint_unresolved"]


def same_behaviour(first: Observation, second: Observation, match: SignatureMatch) -> bool:
    """Whether two observations show the same behaviour: equal outcomes and, for failures, matching signatures."""
    if first.outcome is not second.outcome:
        return False
    if first.outcome is Outcome.BAD:
        return match.matches(first.signature, second.signature) and match.matches(
            second.signature, first.signature
        )
    return True


@dataclass(frozen=True)
class PackResult:
    """Where the behaviour changes along the pack list (indices into it).

    ``found``: ``first_changed`` is the first pack behaving like the last one; ``ambiguous``: skips leave
    ``candidates``; ``no_change``: both ends behave alike; ``endpoint_unresolved``: an end cannot be judged.
    ``before`` / ``after`` are the observations at the first and last packs.
    """

    status: PackStatus
    first_changed: int | None
    candidates: tuple[int, ...]
    labels: tuple[str, ...]
    before: Observation | None
    after: Observation | None

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "first_changed": None if self.first_changed is None else self.labels[self.first_changed],
            "first_changed_index": self.first_changed,
            "candidates": [self.labels[index] for index in self.candidates],
            "before": None if self.before is None else self.before.to_json(),
            "after": None if self.after is None else self.after.to_json(),
        }

    def lines(self) -> tuple[str, ...]:
        change = f"{self.before} -> {self.after}"
        if self.status == "found":
            assert self.first_changed is not None
            previous = self.labels[self.first_changed - 1]
            return (f"behaviour changes at {self.labels[self.first_changed]} (after {previous}): {change}",)
        if self.status == "ambiguous":
            listed = ", ".join(self.labels[index] for index in self.candidates)
            return (f"behaviour changes at one of: {listed} (skips left it ambiguous): {change}",)
        if self.status == "no_change":
            return (f"no change: {self.labels[0]} and {self.labels[-1]} behave alike ({self.before})",)
        return (f"unresolved: an end of the pack list cannot be judged ({change})",)


class PackSearch(Search[ItemProbe[T], PackResult], Generic[T]):
    """Bisect an ordered list of at least two packs (the predicate runs the call on the pack a probe names)."""

    kind = "packs"

    def __init__(
        self,
        packs: Sequence[T],
        *,
        labels: Sequence[str] | None = None,
        match: SignatureMatch = SignatureMatch.KINDS,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(target=None, match=match, settings=settings)
        if len(packs) < 2:
            raise BisectError("comparing packs needs at least two")
        if labels is not None and len(labels) != len(packs):
            raise BisectError(f"{len(labels)} labels for {len(packs)} packs")
        self.packs = tuple(packs)
        self.labels = tuple(labels) if labels is not None else tuple(str(pack) for pack in packs)
        self._ends: tuple[Observation, Observation] | None = None

    def classify(self, observation: Observation) -> Outcome:
        """Once both ends are known: ``good`` behaves like the first pack, ``bad`` like the last, else unresolved."""
        if self._ends is None or observation.outcome is Outcome.UNRESOLVED:
            return observation.outcome
        before, after = self._ends
        if same_behaviour(observation, before, self.match):
            return Outcome.GOOD
        if same_behaviour(observation, after, self.match):
            return Outcome.BAD
        return Outcome.UNRESOLVED

    def probe_at(self, index: int) -> ItemProbe[T]:
        return ItemProbe(index, self.packs[index], self.labels[index])

    def _config(self) -> dict[str, Any]:
        return {"labels": list(self.labels)}

    def _narrowed(self, interval: Interval) -> None:
        low, high = interval.last_good + 1, interval.first_known_bad
        self._set_progress(
            f"behaviour changes between {self.labels[low - 1]} and {self.labels[high]}",
            last_old=interval.last_good,
            first_new=interval.first_known_bad,
            skipped=list(interval.skipped),
        )

    def _run(self) -> Asking[ItemProbe[T], PackResult]:
        last = len(self.packs) - 1
        self._set_progress(f"running both ends: {self.labels[0]} and {self.labels[last]}")
        before = yield from self._ask(self.probe_at(0))
        after = yield from self._ask(self.probe_at(last))
        for end in (after, before):
            self._adopt_target(end)
        if Outcome.UNRESOLVED in (before.outcome, after.outcome):
            return PackResult("endpoint_unresolved", None, (), self.labels, before, after)
        if same_behaviour(before, after, self.match):
            return PackResult("no_change", None, (), self.labels, before, after)
        self._ends = (before, after)
        interval = yield from bisect_interval(
            0, last, lambda index: self._ask_outcome(self.probe_at(index)), self._narrowed
        )
        if interval.exact:
            return PackResult(
                "found", interval.first_known_bad, interval.candidates, self.labels, before, after
            )
        return PackResult("ambiguous", None, interval.candidates, self.labels, before, after)
