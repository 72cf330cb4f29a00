"""Strategy ``mutations``: the smallest set of mutations that makes a failing call pass (ddmin).

Delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating Failure-Inducing Input", 2002) over a list of
mutations, looking for a subset whose outcome is *good*. A subset that still fails, fails with another signature,
or is invalid / unresolved does not count as passing, so ddmin never reduces on it — the result is a passing subset
from which removing any single mutation no longer passes (1-minimal).

The search first checks its premises: the baseline (no mutation) fails with the target signature and the full set
passes. Afterwards every mutation outside the minimal set is added to it alone, to say which do not matter
(``irrelevant``: still passes), which undo the fix (``interfering``: the failure returns) and which could not be
judged (``undetermined``).

Cost: at worst O(n²) probes for n mutations, typically O(k log n) for a k-element answer; plus n - k checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from moereplay.bisect.errors import BisectError
from moereplay.bisect.observation import Outcome, Signature, SignatureMatch
from moereplay.bisect.probes import SubsetProbe
from moereplay.bisect.search import Asking, Search

T = TypeVar("T")

MutationStatus = Literal["minimised", "baseline_passes", "baseline_unresolved", "full_set_does_not_pass"]


@dataclass(frozen=True)
class MutationResult:
    """The minimal passing mutation set and what the others do (indices into the search's mutation list)."""

    status: MutationStatus
    minimal: tuple[int, ...]
    irrelevant: tuple[int, ...]
    interfering: tuple[int, ...]
    undetermined: tuple[int, ...]
    labels: tuple[str, ...]
    target: Signature | None

    def names(self, indices: Sequence[int]) -> list[str]:
        return [self.labels[index] for index in indices]

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "minimal": self.names(self.minimal),
            "irrelevant": self.names(self.irrelevant),
            "interfering": self.names(self.interfering),
            "undetermined": self.names(self.undetermined),
            "minimal_indices": list(self.minimal),
            "target": None if self.target is None else self.target.to_json(),
        }

    def lines(self) -> tuple[str, ...]:
        if self.status == "baseline_passes":
            return ("nothing to minimise: the call passes without any mutation",)
        if self.status == "baseline_unresolved":
            return (
                "nothing to minimise: the unmutated call cannot be judged or fails with another signature",
            )
        if self.status == "full_set_does_not_pass":
            return ("nothing to minimise: the call does not pass even with every mutation applied",)
        lines = [
            "minimal passing set: " + ", ".join(self.names(self.minimal)),
            f"fixes: {self.target}",
        ]
        if self.irrelevant:
            lines.append("do not matter: " + ", ".join(self.names(self.irrelevant)))
        if self.interfering:
            lines.append("bring the failure back: " + ", ".join(self.names(self.interfering)))
        if self.undetermined:
            lines.append("could not be judged: " + ", ".join(self.names(self.undetermined)))
        return tuple(lines)


def split(elements: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``elements`` cut into ``parts`` contiguous chunks whose sizes differ by at most one (larger ones first)."""
    size, extra = divmod(len(elements), parts)
    chunks: list[tuple[int, ...]] = []
    start = 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        chunks.append(tuple(elements[start:end]))
        start = end
    return chunks


class MutationSearch(Search[SubsetProbe[T], MutationResult], Generic[T]):
    """ddmin over ``mutations`` (opaque to the search; the predicate applies the subset a probe names)."""

    kind = "mutations"

    def __init__(
        self,
        mutations: Sequence[T],
        *,
        labels: Sequence[str] | None = None,
        target: Signature | None = None,
        match: SignatureMatch = SignatureMatch.KINDS,
        check_others: bool = True,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(target=target, match=match, settings=settings)
        if not mutations:
            raise BisectError("no mutations to minimise")
        if labels is not None and len(labels) != len(mutations):
            raise BisectError(f"{len(labels)} labels for {len(mutations)} mutations")
        self.mutations = tuple(mutations)
        self.labels = tuple(labels) if labels is not None else tuple(str(item) for item in mutations)
        self.check_others = check_others

    def probe_of(self, indices: Sequence[int]) -> SubsetProbe[T]:
        ordered = tuple(sorted(indices))
        return SubsetProbe(
            ordered,
            tuple(self.mutations[index] for index in ordered),
            tuple(self.labels[index] for index in ordered),
        )

    def _config(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "check_others": self.check_others}

    def _finish(
        self, status: MutationStatus, minimal: Sequence[int] = (), **groups: list[int]
    ) -> MutationResult:
        return MutationResult(
            status,
            tuple(sorted(minimal)),
            tuple(groups.get("irrelevant", [])),
            tuple(groups.get("interfering", [])),
            tuple(groups.get("undetermined", [])),
            self.labels,
            self.target,
        )

    def _passes(self, indices: Sequence[int]) -> Asking[SubsetProbe[T], bool]:
        outcome = yield from self._ask_outcome(self.probe_of(indices))
        return outcome is Outcome.GOOD

    def _run(self) -> Asking[SubsetProbe[T], MutationResult]:
        self._set_progress("confirming the failure without mutations, then the fix with all of them")
        baseline = yield from self._ask(self.probe_of(()))
        self._adopt_target(baseline)
        outcome = self.classify(baseline)
        if outcome is Outcome.GOOD:
            return self._finish("baseline_passes")
        if outcome is Outcome.UNRESOLVED:
            return self._finish("baseline_unresolved")
        everything = list(range(len(self.mutations)))
        if not (yield from self._passes(everything)):
            return self._finish("full_set_does_not_pass")
        minimal = yield from self._ddmin(everything)
        groups: dict[str, list[int]] = {"irrelevant": [], "interfering": [], "undetermined": []}
        if self.check_others:
            self._set_progress(
                "checking each other mutation beside the minimal set",
                minimal=[self.labels[i] for i in minimal],
            )
            for index in everything:
                if index in minimal:
                    continue
                with_it = yield from self._ask_outcome(self.probe_of([*minimal, index]))
                if with_it is Outcome.GOOD:
                    groups["irrelevant"].append(index)
                elif with_it is Outcome.BAD:
                    groups["interfering"].append(index)
                else:
                    groups["undetermined"].append(index)
        return self._finish("minimised", minimal, **groups)

    def _ddmin(self, passing: list[int]) -> Asking[SubsetProbe[T], list[int]]:
        """Zeller's ddmin: ``passing`` passes and the empty set does not; returns a 1-minimal passing subset."""
        current = passing
        parts = 2
        while len(current) >= 2:
            chunks = split(current, parts)
            self._set_progress(
                f"{len(current)} mutations pass together; trying {parts} parts and their complements",
                passing=[self.labels[index] for index in current],
                parts=parts,
            )
            reduced = False
            for chunk in chunks:
                if (yield from self._passes(chunk)):
                    current, parts, reduced = list(chunk), 2, True
                    break
            if not reduced:
                for chunk in chunks:
                    complement = [index for index in current if index not in chunk]
                    if (yield from self._passes(complement)):
                        current, parts, reduced = complement, max(parts - 1, 2), True
                        break
            if not reduced:
                if parts >= len(current):
                    break
                parts = min(len(current), 2 * parts)
        return current
