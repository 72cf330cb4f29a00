"""How messages say a count: ``plural(1, "call")`` is "1 call", ``plural(3, "call")`` is "3 calls".

Rank 0 (imports nothing of moereplay), so the file format, replay, the TUI and the CLI all word counts alike.
"""

from __future__ import annotations

from collections.abc import Iterable


def plural(number: int, noun: str, many: str | None = None) -> str:
    """``number`` and ``noun``, the noun in the plural unless ``number`` is 1 (``many``: an irregular plural,
    default ``noun + "s"``)."""
    return f"{number} {noun if number == 1 else (many if many is not None else noun + 's')}"


def index_range(count: int, noun: str) -> str:
    """The indices ``0 … count-1`` of ``count`` things: "no calls", "call 0", "calls 0-4"."""
    if count <= 0:
        return f"no {noun}s"
    return f"{noun} 0" if count == 1 else f"{noun}s 0-{count - 1}"


def row_ranges(rows: Iterable[int], *, limit: int = 12) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``"0-2, 5, 7-8"`` (at most ``limit`` ranges, then ``…``)."""
    ordered = sorted(set(int(r) for r in rows))
    if not ordered:
        return "none"
    ranges: list[str] = []
    start = prev = ordered[0]
    for row in ordered[1:]:
        if row == prev + 1:
            prev = row
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = row
    ranges.append(str(start) if start == prev else f"{start}-{prev}")
    if len(ranges) > limit:
        return ", ".join(ranges[:limit]) + f", … ({len(ordered)} in all)"
    return ", ".join(ranges)
