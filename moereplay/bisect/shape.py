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

A dimension may *matter by alignment* (K not a multiple of the kernel's K tile, N not a whole swizzle slab …): it
then names a ``modulus``. The shrink walks only the legal values of the original's residue class (``value % modulus``
as in the original), so the misalignment that may be the bug is kept while the size shrinks; afterwards, at the final
shape, one value of every residue class present among the legal values is tried next to the minimal value and next to
the original value (:class:`AlignmentReport`). The dimension matters by alignment when some residues fail and others
pass, with no residue doing both: "K: matters by alignment — fails when K % 128 is 32 or 64 (K=32, 64, 2848, 2880),
passes when K % 128 is 0 or 96 (K=96, 128, 2784, 2816)".

Cost: per round and dimension one probe plus about log2(legal values) — rounds are few in practice (bounded by
``max_rounds``); per dimension with a modulus at most twice its residue classes more (at most
:data:`MAX_RESIDUES`).
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


MAX_RESIDUES = 16
"""Most residue classes a dimension with a modulus may have among its legal values (each costs up to two probes)."""


@dataclass(frozen=True)
class Dimension:
    """A shrinkable dimension: its legal values (ascending, unique) and its original value (one of them).

    ``modulus``: the failure may depend on ``value % modulus`` (see the module docstring); the shrink then keeps the
    original's residue and the report says which residues fail and which pass.
    """

    name: str
    values: tuple[int, ...]
    original: int
    modulus: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise BisectError("a dimension needs a name")
        if not self.values or list(self.values) != sorted(set(self.values)):
            raise BisectError(f"dimension {self.name}: legal values must be ascending and unique")
        if self.original not in self.values:
            raise BisectError(f"dimension {self.name}: original value {self.original} is not a legal value")
        if self.modulus is not None:
            if self.modulus < 2:
                raise BisectError(f"dimension {self.name}: a modulus must be at least 2, got {self.modulus}")
            if len(self.residues) > MAX_RESIDUES:
                raise BisectError(
                    f"dimension {self.name}: {len(self.residues)} residue classes modulo {self.modulus} among "
                    f"its values (at most {MAX_RESIDUES})"
                )

    @classmethod
    def stepped(
        cls,
        name: str,
        original: int,
        *,
        step: int = 1,
        minimum: int | None = None,
        modulus: int | None = None,
    ) -> Dimension:
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
        return cls(name, tuple(values), original, modulus)

    @classmethod
    def of(cls, item: Any) -> Dimension:
        """``item`` as a dimension: a :class:`Dimension`, an op's ``(name, legal values, original)`` or an object
        with ``name``, ``values``, ``original`` and optionally ``modulus`` (ops declare theirs without importing
        the bisection)."""
        if isinstance(item, Dimension):
            return item
        if isinstance(item, tuple):
            name, values, original = item
            return cls(str(name), tuple(int(value) for value in values), int(original))
        modulus = getattr(item, "modulus", None)
        return cls(
            str(item.name),
            tuple(int(value) for value in item.values),
            int(item.original),
            None if modulus is None else int(modulus),
        )

    @classmethod
    def choices(
        cls, name: str, values: Sequence[int], original: int, *, modulus: int | None = None
    ) -> Dimension:
        """Explicit legal values (any order, duplicates removed), keeping only those not above ``original``."""
        kept = sorted({value for value in values if value <= original} | {original})
        return cls(name, tuple(kept), original, modulus)

    @property
    def residues(self) -> tuple[int, ...]:
        """The residues ``value % modulus`` present among the legal values (empty without a modulus)."""
        if self.modulus is None:
            return ()
        return tuple(sorted({value % self.modulus for value in self.values}))

    @property
    def search_values(self) -> tuple[int, ...]:
        """The values the shrink walks: every legal value, or with a modulus those of the original's residue."""
        if self.modulus is None:
            return self.values
        residue = self.original % self.modulus
        return tuple(value for value in self.values if value % self.modulus == residue)

    def representatives(self, anchor: int) -> tuple[int, ...]:
        """For every residue class: its legal value nearest ``anchor`` (ties: the smaller), ascending."""
        if self.modulus is None:
            return ()
        modulus = self.modulus
        chosen = {
            residue: min(
                (value for value in self.values if value % modulus == residue),
                key=lambda value: (abs(value - anchor), value),
            )
            for residue in self.residues
        }
        return tuple(sorted(chosen.values()))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "values": list(self.values), "original": self.original}
        if self.modulus is not None:
            data["modulus"] = self.modulus
        return data


@dataclass(frozen=True)
class AlignmentReport:
    """What the residue probes of a dimension with a modulus found at the final shape.

    ``failing`` / ``passing`` / ``unresolved``: the values tried (ascending) by their outcome against the target.
    """

    modulus: int
    failing: tuple[int, ...]
    passing: tuple[int, ...]
    unresolved: tuple[int, ...]

    def _residues(self, values: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted({value % self.modulus for value in values}))

    @property
    def failing_residues(self) -> tuple[int, ...]:
        return self._residues(self.failing)

    @property
    def passing_residues(self) -> tuple[int, ...]:
        return self._residues(self.passing)

    @property
    def consistent(self) -> bool:
        """No residue both fails and passes: the residue alone decides (among the values tried)."""
        return not set(self.failing_residues) & set(self.passing_residues)

    @property
    def matters(self) -> bool:
        """Some residues fail, others pass, and no residue does both."""
        return bool(self.failing) and bool(self.passing) and self.consistent

    def to_json(self) -> dict[str, Any]:
        return {
            "modulus": self.modulus,
            "failing": list(self.failing),
            "passing": list(self.passing),
            "unresolved": list(self.unresolved),
            "failing_residues": list(self.failing_residues),
            "passing_residues": list(self.passing_residues),
            "matters": self.matters,
        }

    def describe(self, name: str) -> str:
        """One clause for people: which residues fail and which pass, with the values tried."""
        term = f"{name} % {self.modulus}"

        def listed(values: Sequence[int]) -> str:
            residues = [str(residue) for residue in self._residues(values)]
            words = residues[0] if len(residues) == 1 else ", ".join(residues[:-1]) + " or " + residues[-1]
            return f"{term} is {words} ({name}={', '.join(str(value) for value in values)})"

        parts = []
        if self.failing:
            parts.append(f"fails when {listed(self.failing)}")
        if self.passing:
            parts.append(f"passes when {listed(self.passing)}")
        if self.unresolved:
            parts.append(f"undecided at {name}={', '.join(str(value) for value in self.unresolved)}")
        return ", ".join(parts)


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
    alignment: AlignmentReport | None = None

    @property
    def by_alignment(self) -> bool:
        """The dimension matters through ``value % modulus`` (see :class:`AlignmentReport`)."""
        return self.alignment is not None and self.alignment.matters

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "original": self.original,
            "minimal": self.minimal,
            "role": self.role,
            "lost_at": self.lost_at,
            "lost_outcome": None if self.lost_outcome is None else self.lost_outcome.value,
        }
        if self.alignment is not None:
            data["alignment"] = self.alignment.to_json()
            data["by_alignment"] = self.by_alignment
        return data

    def describe(self) -> str:
        """The report's line for people (without the leading name)."""
        alignment = self.alignment
        if alignment is not None and alignment.matters:
            text = f"matters by alignment — {alignment.describe(self.name)}"
            if self.minimal != self.original:
                residue = self.minimal % alignment.modulus
                text += (
                    f"; keeping {self.name} % {alignment.modulus} = {residue} it shrank from {self.original} "
                    f"to {self.minimal}"
                )
            return text
        if self.role == "matters":
            text = f"matters (fails at {self.minimal}, passes at {self.lost_at})"
        elif self.role == "free":
            text = f"free (fails from {self.minimal} to {self.original})"
        elif self.role == "undetermined":
            text = f"undetermined (smaller values than {self.minimal} could not be judged)"
        else:
            text = f"untested (the original {self.original} is the minimum)"
        if alignment is None:
            return text
        term = f"{self.name} % {alignment.modulus}"
        if not alignment.passing and not alignment.unresolved:
            return f"{text}; {term} does not matter ({alignment.describe(self.name)})"
        if not alignment.consistent:
            return f"{text}; {term} alone does not decide it ({alignment.describe(self.name)})"
        return f"{text}; whether {term} matters is undetermined ({alignment.describe(self.name)})"


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
            lines.append(f"  {report.name}: {report.describe()}")
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
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(target=target, match=match, settings=settings)
        dimensions = [Dimension.of(dimension) for dimension in dimensions]
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
                values = dimension.search_values
                position = values.index(shape[dimension.name])
                if position == 0:
                    continue
                self._set_progress(
                    f"round {round_number}: shrinking {dimension.name} from {shape[dimension.name]}",
                    shape=dict(shape),
                    round=round_number,
                    dimension=dimension.name,
                )
                smallest = {**shape, dimension.name: values[0]}
                if (yield from self._holds(smallest)) is Outcome.BAD:
                    shape, changed = smallest, True
                    continue
                if position == 1:
                    continue

                def at(
                    index: int,
                    name: str = dimension.name,
                    walk: tuple[int, ...] = values,
                    base: Mapping[str, int] = shape,
                ) -> Asking[ShapeProbe, Outcome]:
                    return self._holds({**base, name: walk[index]})  # fmt: skip

                interval = yield from bisect_interval(0, position, at)
                if interval.first_known_bad != position:
                    shape = {**shape, dimension.name: values[interval.first_known_bad]}
                    changed = True
            if not changed:
                converged = True
                break
        alignments: dict[str, AlignmentReport] = {}
        for dimension in self.dimensions:
            if len(dimension.residues) > 1:
                alignments[dimension.name] = yield from self._alignment(dimension, shape)
        reports = tuple(
            self._report(dimension, shape, alignments.get(dimension.name)) for dimension in self.dimensions
        )
        return ShapeResult("shrunk", original, tuple(shape.items()), reports, self.target, converged)

    def _alignment(
        self, dimension: Dimension, shape: Mapping[str, int]
    ) -> Asking[ShapeProbe, AlignmentReport]:
        """Try every residue class of ``dimension`` next to its final and its original value, at the final shape."""
        assert dimension.modulus is not None
        tried: list[int] = []
        for anchor in dict.fromkeys((shape[dimension.name], dimension.original)):
            tried.extend(value for value in dimension.representatives(anchor) if value not in tried)
        self._set_progress(
            f"alignment: {dimension.name} % {dimension.modulus} at {', '.join(str(value) for value in tried)}",
            shape=dict(shape),
            dimension=dimension.name,
            modulus=dimension.modulus,
            values=list(tried),
        )
        found: dict[Outcome, list[int]] = {outcome: [] for outcome in Outcome}
        for value in tried:
            outcome = yield from self._holds({**shape, dimension.name: value})
            found[outcome].append(value)
        return AlignmentReport(
            dimension.modulus,
            tuple(sorted(found[Outcome.BAD])),
            tuple(sorted(found[Outcome.GOOD])),
            tuple(sorted(found[Outcome.UNRESOLVED])),
        )

    def _report(
        self, dimension: Dimension, shape: Mapping[str, int], alignment: AlignmentReport | None = None
    ) -> DimensionReport:
        value = shape[dimension.name]
        name, original = dimension.name, dimension.original
        if alignment is not None and alignment.matters:
            nearest = min(alignment.passing, key=lambda passing: (abs(passing - value), passing))
            return DimensionReport(name, original, value, "matters", nearest, Outcome.GOOD, alignment)
        values = dimension.search_values
        position = values.index(value)
        if original == values[0]:
            return DimensionReport(name, original, value, "untested", None, None, alignment)
        if position == 0:
            return DimensionReport(name, original, value, "free", None, None, alignment)
        for smaller in reversed(values[:position]):
            observation = self.observation_for(self.probe_of({**shape, name: smaller}))
            if observation is None:
                continue
            outcome = self.classify(observation)
            if outcome is Outcome.UNRESOLVED:
                continue
            role: DimensionRole = "matters" if outcome is Outcome.GOOD else "undetermined"
            return DimensionReport(name, original, value, role, smaller, outcome, alignment)
        return DimensionReport(name, original, value, "undetermined", None, None, alignment)
