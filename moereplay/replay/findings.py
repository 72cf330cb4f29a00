"""Findings: what a replay learned, as typed data in the op's domain terms (rows, tokens, experts, arguments).

The CLI and the TUI render findings; nothing decides anything from their ``message`` text. ``evidence`` holds
plain JSON-able values (numbers, strings, lists) so a report serialises without special cases.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moereplay.wording import row_ranges  # noqa: F401  (re-exported: its callers import it from here)


class FindingKind(enum.Enum):
    """What a finding is about."""

    CORRUPT_ROWS = "corrupt_rows"  # which rows are wrong, by slot / token / expert / block
    NONFINITE = "nonfinite"  # NaN / Inf, by row, column range and expert
    NONDETERMINISM = "nondeterminism"  # outputs differ across --repeat
    CONTRACT_VIOLATION = "contract_violation"  # an argument is not what the kernel reads
    OOB_WRITE = "oob_write"  # guard bytes changed
    OOB_READ = "oob_read"  # output depends on guard content
    MEMORY_DEPENDENT = (
        "memory_dependent"  # the call's verdict: its output depends on bytes outside its tensors
    )
    FIDELITY = "fidelity"  # the replay is not bit-exact with the recording: where, by how much, and why
    WRONG_COEFFICIENT = "wrong_coefficient"  # decomposition: a term got the wrong per-row coefficient
    UNEXPLAINED = "unexplained"  # bad rows the decomposition cannot express in the ingredients
    DIAGNOSIS = "diagnosis"  # the conclusion the evidence supports: kernel or caller
    SANITIZER = "sanitizer"  # compute-sanitizer memcheck report
    CRASH = "crash"  # a variant killed its worker / CUDA context


@dataclass(frozen=True)
class Finding:
    """One thing a replay learned.

    ``variant``: label of the variant it is about (``"baseline"`` for the captured call). ``rows``: affected output
    rows (sorted). ``columns``: an inclusive ``(first, last)`` column range when localised. ``confidence`` in
    ``[0, 1]``: how much of the relevant evidence the statement explains. ``suggestions``: mutation specs
    (``"cast topk_weights=float32"``) that would test the finding.
    """

    kind: FindingKind
    message: str
    variant: str = "baseline"
    evidence: Mapping[str, Any] = field(default_factory=dict)
    rows: tuple[int, ...] = ()
    columns: tuple[int, int] | None = None
    confidence: float = 1.0
    suggestions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"confidence {self.confidence} outside [0, 1]")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "message": self.message,
            "variant": self.variant,
            "evidence": dict(self.evidence),
            "rows": list(self.rows),
            "columns": list(self.columns) if self.columns is not None else None,
            "confidence": round(self.confidence, 4),
            "suggestions": list(self.suggestions),
        }


def expected_nondeterminism(finding: Finding, cause: str) -> Finding:
    """``finding`` (a :attr:`FindingKind.NONDETERMINISM`) restated as expected: the launch reduces in an order that
    varies between runs (``cause``, e.g. ``"atomic add"``) and every repeat stayed within the rounding bound.
    ``evidence["expected"]`` is True; the kind stays, so a reader filtering on it still sees the fact."""
    return Finding(
        finding.kind,
        f"{cause}: reduction order varies between runs, expected; differences within the rounding bound "
        f"({finding.message})",
        finding.variant,
        {**finding.evidence, "expected": True, "cause": cause},
        rows=finding.rows,
        columns=finding.columns,
        confidence=finding.confidence,
        suggestions=finding.suggestions,
    )
