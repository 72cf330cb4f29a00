"""The browser's filter / search line: ``op:marlin* layer:3 step:10-12 status:completed verdict:corrupt text``.

Terms are ANDed. ``field:value`` terms: ``op`` (a glob), ``layer`` / ``step`` / ``rank`` / ``call`` (a number or an
inclusive range ``a-b``), ``status`` (prefix of inputs_saved / completed / failed), ``verdict`` (a call's headline:
the worse of its recorded output and its replay — ok, memory-dependent, corrupt, nonfinite, crash, invalid,
needs-kernel; ``bad`` for any failure, ``none`` for calls not replayed yet). Any other word is matched as a substring of the row's index, op,
site, status and key shapes. Parsing never raises: a malformed term is kept as free text and reported in
:attr:`CallFilter.problems`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from moereplay.tui.catalog import CallSummary

NUMERIC_FIELDS = ("layer", "step", "rank", "call")
FIELDS = ("op", "status", "verdict", *NUMERIC_FIELDS)
FAILING = frozenset({"memory-dependent", "corrupt", "nonfinite", "crash"})


@dataclass(frozen=True)
class NumberRange:
    low: int
    high: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.low <= value <= self.high


def _range(text: str) -> NumberRange | None:
    low, dash, high = text.partition("-")
    try:
        if not dash:
            value = int(low)
            return NumberRange(value, value)
        return NumberRange(int(low), int(high))
    except ValueError:
        return None


@dataclass(frozen=True)
class CallFilter:
    """A parsed filter line (see the module docstring)."""

    text: str = ""
    op: str | None = None
    status: str | None = None
    verdict: str | None = None
    numbers: dict[str, NumberRange] = field(default_factory=dict)
    words: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> CallFilter:
        op = status = verdict = None
        numbers: dict[str, NumberRange] = {}
        words: list[str] = []
        problems: list[str] = []
        for term in text.split():
            name, colon, value = term.partition(":")
            name = name.lower()
            if not colon or name not in FIELDS or not value:
                words.append(term.lower())
                continue
            if name == "op":
                op = value
            elif name == "status":
                status = value.lower()
            elif name == "verdict":
                verdict = value.lower()
            else:
                parsed = _range(value)
                if parsed is None:
                    problems.append(f"{name}: {value!r} is not a number or a range a-b")
                    words.append(term.lower())
                else:
                    numbers[name] = parsed
        return cls(text.strip(), op, status, verdict, numbers, tuple(words), tuple(problems))

    @property
    def empty(self) -> bool:
        return not self.text

    def matches(self, row: CallSummary, verdict: str | None) -> bool:
        if self.op is not None and not fnmatch.fnmatchcase(row.op, self.op):
            return False
        if self.status is not None and not row.status.startswith(self.status):
            return False
        if self.verdict is not None and not _verdict_matches(self.verdict, verdict):
            return False
        values = {"layer": row.layer, "step": row.step, "rank": row.rank, "call": row.index}
        if any(values[name] not in allowed for name, allowed in self.numbers.items()):
            return False
        if self.words:
            haystack = row.text()
            return all(word in haystack for word in self.words)
        return True


def _verdict_matches(wanted: str, verdict: str | None) -> bool:
    if wanted == "none":
        return verdict is None
    if wanted == "bad":
        return verdict in FAILING
    return verdict is not None and verdict.startswith(wanted)
