"""What a bisect predicate reports about one probe: an outcome and the signature of the failure.

A search hunts *one* bug. It carries the *target* signature of the original failure; a probe that fails with
another signature is a different bug and counts as :attr:`Outcome.UNRESOLVED`, so the search does not drift.
Invalid shapes or mutations and crashes of another kind are unresolved too — never "passing".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moereplay.bisect.errors import BisectLogError


class Outcome(enum.Enum):
    """The judgement of one probe, from the search's point of view."""

    GOOD = "good"  # the failure is absent (the call passes)
    BAD = "bad"  # the call fails
    UNRESOLVED = "unresolved"  # neither: invalid variant, a crash of another kind, a different failure


class Decider(enum.Enum):
    """Who decided a step: the predicate (``auto``) or a person overriding it (``person``)."""

    AUTO = "auto"
    PERSON = "person"


@dataclass(frozen=True, slots=True)
class Signature:
    """A small, comparable fingerprint of a failure.

    ``verdict`` is the replay verdict (``corrupt``, ``nonfinite``, ``crash`` …), ``finding_kinds`` the kinds of the
    findings that explain it, ``experts`` the experts whose output rows are affected (empty when unknown).
    """

    verdict: str
    finding_kinds: frozenset[str] = frozenset()
    experts: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.verdict:
            raise ValueError("a signature needs a verdict")
        object.__setattr__(self, "finding_kinds", frozenset(self.finding_kinds))
        object.__setattr__(self, "experts", frozenset(self.experts))

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "finding_kinds": sorted(self.finding_kinds),
            "experts": sorted(self.experts),
        }

    @classmethod
    def from_json(cls, data: Any) -> Signature:
        if not isinstance(data, Mapping) or not isinstance(data.get("verdict"), str):
            raise BisectLogError(f"malformed signature {data!r}")
        kinds = data.get("finding_kinds", [])
        experts = data.get("experts", [])
        if not isinstance(kinds, list) or not all(isinstance(kind, str) for kind in kinds):
            raise BisectLogError(f"malformed finding kinds {kinds!r}")
        if not isinstance(experts, list) or not all(
            isinstance(expert, int) and not isinstance(expert, bool) for expert in experts
        ):
            raise BisectLogError(f"malformed expert set {experts!r}")
        return cls(data["verdict"], frozenset(kinds), frozenset(experts))

    def __str__(self) -> str:
        text = self.verdict
        if self.finding_kinds:
            text += " [" + ", ".join(sorted(self.finding_kinds)) + "]"
        if self.experts:
            text += " experts " + ",".join(str(expert) for expert in sorted(self.experts))
        return text


class SignatureMatch(enum.Enum):
    """How strictly an observed failure must resemble the target to count as the same bug.

    ``kinds`` (verdict and finding kinds) is the usual choice: the affected experts legitimately change from one
    call to the next, or when a shape shrinks, while the kind of the defect does not.
    """

    EXACT = "exact"  # verdict, finding kinds and affected experts all equal
    KINDS = "kinds"  # verdict and finding kinds equal
    VERDICT = "verdict"  # verdict equal
    ANY = "any"  # any failure

    def matches(self, target: Signature | None, observed: Signature | None) -> bool:
        """Whether ``observed`` is the same bug as ``target``; no target (``None``) accepts any failure.

        An observed failure without a signature only matches when there is no target (or under ``any``).
        """
        if target is None or self is SignatureMatch.ANY:
            return True
        if observed is None:
            return False
        if self is SignatureMatch.VERDICT:
            return observed.verdict == target.verdict
        if self is SignatureMatch.KINDS:
            return (observed.verdict, observed.finding_kinds) == (target.verdict, target.finding_kinds)
        return observed == target


@dataclass(frozen=True, slots=True)
class Observation:
    """The predicate's report on one probe.

    ``signature`` describes the failure of a ``BAD`` observation (``None`` for ``GOOD``; for ``UNRESOLVED`` it may
    say what went wrong instead). ``note`` is one human line: why it is unresolved, which variant ran, …
    """

    outcome: Outcome
    signature: Signature | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.outcome is Outcome.GOOD and self.signature is not None:
            raise ValueError("a good observation has no failure signature")

    @classmethod
    def good(cls, note: str = "") -> Observation:
        return cls(Outcome.GOOD, None, note)

    @classmethod
    def bad(cls, signature: Signature | None, note: str = "") -> Observation:
        return cls(Outcome.BAD, signature, note)

    @classmethod
    def unresolved(cls, note: str = "", signature: Signature | None = None) -> Observation:
        return cls(Outcome.UNRESOLVED, signature, note)

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "signature": None if self.signature is None else self.signature.to_json(),
            "note": self.note,
        }

    @classmethod
    def from_json(cls, data: Any) -> Observation:
        if not isinstance(data, Mapping):
            raise BisectLogError(f"malformed observation {data!r}")
        try:
            outcome = Outcome(data.get("outcome"))
        except ValueError as error:
            raise BisectLogError(f"unknown outcome {data.get('outcome')!r}") from error
        raw_signature = data.get("signature")
        signature = None if raw_signature is None else Signature.from_json(raw_signature)
        note = data.get("note", "")
        if not isinstance(note, str):
            raise BisectLogError(f"malformed observation note {note!r}")
        try:
            return cls(outcome, signature, note)
        except ValueError as error:
            raise BisectLogError(f"inconsistent observation {data!r}: {error}") from error

    def __str__(self) -> str:
        text = self.outcome.value
        if self.signature is not None:
            text += f": {self.signature}"
        if self.note:
            text += f" ({self.note})"
        return text


def classify(observation: Observation, target: Signature | None, match: SignatureMatch) -> Outcome:
    """The outcome a search acts on: a failure that is not the target bug is unresolved (drift guard)."""
    if observation.outcome is Outcome.BAD and not match.matches(target, observation.signature):
        return Outcome.UNRESOLVED
    return observation.outcome
