"""Strategy ``shape``: the smallest shape that still fails with the target signature.

The caller names the dimensions (experts, tokens, top_k, N, K …), each with its legal values — the kernel's
multiples, minimum and any other rule the op knows — and optionally a ``legal`` check across dimensions (top_k ≤
experts …); shapes it rejects are never run. Building a call of a given shape is the predicate's business.

The search confirms the original shape fails, then repeats rounds until nothing shrinks: for each dimension in
turn it tries the dimension's minimum (greedy), and failing that binary-searches the legal values between the
minimum and the current value for the smallest one at which the failure holds (unresolved values are skipped, as
in ``git bisect``). Afterwards each dimension is reported as ``matters`` (the next smaller value tried at the final
shape loses the failure), ``free`` (it shrank to its minimum and the failure held: it can vary freely between its
minimum and original values), ``undetermined`` (the smaller values could not be judged) or ``untested`` (the
original was already the minimum).

Cost: per round and dimension one probe plus about log2(legal values) — rounds are few in practice (bounded by
``max_rounds``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from moereplay.bisect.errors import BisectError
from moereplay.bisect.interval import bisect_interval
from moereplay.bisect.observation import Observation, Outcome, Signature, SignatureMatch
from moereplay.bisect.probes import ShapeProbe
from moereplay.bisect.search import Asking, Search

DimensionRole = Literal["matters", "free", "undetermined", "untested"]
ShapeStatus = Literal["shrunk", "not_reproduced"]


@dataclass(frozen=True)
class Dimension:
    """A shrinkable dimension: its legal values (ascending, unique) and its original value (one of them)."""

    name: str
    values: tuple[int, ...]
    original: int

    def __post_init__(self) -> None:
        if not self.name:
            raise BisectError("a dimension needs a name")
        if not self.values or list(self.values) != sorted(set(self.values)):
            raise BisectError(f"dimension {self.name}: legal values must be ascending and unique")
        if self.original not in self.values:
            raise BisectError(f"dimension {self.name}: original value {self.original} is not a legal value")

    @classmethod
    def stepped(cls, name: str, original: int, *, step: int = 1, minimum: int | None = None) -> Dimension:
        """Values ``minimum, minimum + step, …`` up to ``original`` (which is kept even off the step).

        ``minimum`` defaults to ``step`` (e.g. K in multiples of 16: ``stepped("K", 2944, step=16)``).
        """
        low = step if minimum is None else minimum
        if step < 1:
            raise BisectError(f"dimension {name}: step must be positive, got {step}")
        if low > original:
            raise BisectError(f"dimension {name}: minimum {low} exceeds the original value {original}")
        values = list(range(low, original + 1, step))
        if values[-1] != original:
            values.append(original)
        return cls(name, tuple(values), original)

    @classmethod
    def choices(cls, name: str, values: Sequence[int], original: int) -> Dimension:
        """Explicit legal values (any order, duplicates removed), keeping only those not above ``original``."""
        kept = sorted({value for value in values if value <= original} | {original})
        return cls(name, tuple(kept), original)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "values": list(self.values), "original": self.original}


@dataclass(frozen=True)
class DimensionReport:
    """How one dimension came out: its final value and whether the failure depends on it.

    ``lost_at`` is the largest smaller value tried at the final shape that was judged (``None`` if none was), and
    ``lost_outcome`` its outcome there — ``good`` for a dimension that ``matters``.
    """

    name: str
    original: int
    minimal: int
    role: DimensionRole
    lost_at: int | None
    lost_outcome: Outcome | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "original": self.original,
            "minimal": self.minimal,
            "role": self.role,
            "lost_at": self.lost_at,
            "lost_outcome": None if self.lost_outcome is None else self.lost_outcome.value,
        }


@dataclass(frozen=True)
class ShapeResult:
    """The minimal failing shape (dimension order as given) and a report per dimension."""

    status: ShapeStatus
    original: tuple[tuple[str, int], ...]
    minimal: tuple[tuple[str, int], ...]
    dimensions: tuple[DimensionReport, ...]
    target: Signature | None
    converged: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "original": dict(self.original),
            "minimal": dict(self.minimal),
            "dimensions": [report.to_json() for report in self.dimensions],
            "converged": self.converged,
            "target": None if self.target is None else self.target.to_json(),
        }

    def lines(self) -> tuple[str, ...]:
        if self.status == "not_reproduced":
            return ("not reproduced: the original shape does not fail with the target signature",)
        shape = " ".join(f"{name}={value}" for name, value in self.minimal)
        lines = [f"minimal failing shape: {shape}", f"failure: {self.target}"]
        for report in self.dimensions:
            if report.role == "matters":
                detail = f"matters (fails at {report.minimal}, passes at {report.lost_at})"
            elif report.role == "free":
                detail = f"free (fails from {report.minimal} to {report.original})"
            elif report.role == "undetermined":
                detail = f"undetermined (smaller values than {report.minimal} could not be judged)"
            else:
                detail = f"untested (the original {report.original} is the minimum)"
            lines.append(f"  {report.name}: {detail}")
        if not self.converged:
            lines.append("(stopped after the maximum number of rounds; the shape may shrink further)")
        return tuple(lines)


ILLEGAL_NOTE = "illegal shape (rejected by the legal-shape rule, not run)"


class ShapeSearch(Search[ShapeProbe, ShapeResult]):
    """Shrink ``dimensions`` while the failure signature holds."""

    kind = "shape"

    def __init__(
        self,
        dimensions: Sequence[Dimension],
        *,
        legal: Callable[[Mapping[str, int]], bool] | None = None,
        target: Signature | None = None,
        match: SignatureMatch = SignatureMatch.KINDS,
        max_rounds: int = 8,
    ) -> None:
        super().__init__(target=target, match=match)
        if not dimensions:
            raise BisectError("no dimensions to shrink")
        names = [dimension.name for dimension in dimensions]
        if len(set(names)) != len(names):
            raise BisectError(f"duplicate dimension names in {names}")
        if max_rounds < 1:
            raise BisectError("max_rounds must be at least 1")
        self.dimensions = tuple(dimensions)
        self.legal = legal
        self.max_rounds = max_rounds

    def probe_of(self, shape: Mapping[str, int]) -> ShapeProbe:
        return ShapeProbe(tuple((dimension.name, shape[dimension.name]) for dimension in self.dimensions))

    def _config(self) -> dict[str, Any]:
        return {
            "dimensions": [dimension.to_json() for dimension in self.dimensions],
            "max_rounds": self.max_rounds,
        }

    def _holds(self, shape: Mapping[str, int]) -> Asking[ShapeProbe, Outcome]:
        """Whether the failure holds at ``shape`` (bad), is lost (good) or cannot be told (unresolved)."""
        probe = self.probe_of(shape)
        if self.legal is not None and self.observation_for(probe) is None and not self.legal(shape):
            self._remember(probe, Observation.unresolved(ILLEGAL_NOTE))
        outcome = yield from self._ask_outcome(probe)
        return outcome

    def _run(self) -> Asking[ShapeProbe, ShapeResult]:
        shape = {dimension.name: dimension.original for dimension in self.dimensions}
        original = tuple(shape.items())
        observation = yield from self._ask(self.probe_of(shape))
        self._adopt_target(observation)
        if self.classify(observation) is not Outcome.BAD:
            return ShapeResult("not_reproduced", original, original, (), self.target, True)
        converged = False
        for round_number in range(1, self.max_rounds + 1):
            changed = False
            for dimension in self.dimensions:
                position = dimension.values.index(shape[dimension.name])
                if position == 0:
                    continue
                self._set_progress(
                    f"round {round_number}: shrinking {dimension.name} from {shape[dimension.name]}",
                    shape=dict(shape),
                    round=round_number,
                    dimension=dimension.name,
                )
                smallest = {**shape, dimension.name: dimension.values[0]}
                if (yield from self._holds(smallest)) is Outcome.BAD:
                    shape, changed = smallest, True
                    continue
                if position == 1:
                    continue

                def at(
                    index: int, dimension: Dimension = dimension, base: Mapping[str, int] = shape
                ) -> Asking[ShapeProbe, Outcome]:
                    return self._holds({**base, dimension.name: dimension.values[index]})

                interval = yield from bisect_interval(0, position, at)
                if interval.first_known_bad != position:
                    shape = {**shape, dimension.name: dimension.values[interval.first_known_bad]}
                    changed = True
            if not changed:
                converged = True
                break
        reports = tuple(self._report(dimension, shape) for dimension in self.dimensions)
        return ShapeResult("shrunk", original, tuple(shape.items()), reports, self.target, converged)

    def _report(self, dimension: Dimension, shape: Mapping[str, int]) -> DimensionReport:
        value = shape[dimension.name]
        position = dimension.values.index(value)
        if dimension.original == dimension.values[0]:
            return DimensionReport(dimension.name, dimension.original, value, "untested", None, None)
        if position == 0:
            return DimensionReport(dimension.name, dimension.original, value, "free", None, None)
        for smaller in reversed(dimension.values[:position]):
            observation = self.observation_for(self.probe_of({**shape, dimension.name: smaller}))
            if observation is None:
                continue
            outcome = self.classify(observation)
            if outcome is Outcome.UNRESOLVED:
                continue
            role: DimensionRole = "matters" if outcome is Outcome.GOOD else "undetermined"
            return DimensionReport(dimension.name, dimension.original, value, role, smaller, outcome)
        return DimensionReport(dimension.name, dimension.original, value, "undetermined", None, None)
