"""Where a replay's time goes: seconds per phase, summed over the variants a session judged.

A session times its own phases (``load``, ``apply``, ``reference``, ``kernel_roundtrip``, ``compare``,
``findings`` …) and adds the phases its kernel worker reports (``worker.materialise``, ``worker.kernel`` …), so a
benchmark can print a breakdown without a profiler. Cost: two ``perf_counter`` calls per phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class PhaseTimes:
    """Seconds and counts per named phase (insertion ordered)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def merge(self, seconds: Mapping[str, float], prefix: str = "") -> None:
        for name, value in seconds.items():
            self.add(prefix + name, float(value))

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def table(self, per: int = 0) -> str:
        """One line per phase: total ms, calls, and ms per ``per`` items (variants) when given."""
        lines = []
        for name, seconds in self.seconds.items():
            line = f"  {name:<28} {seconds * 1e3:9.1f} ms  ×{self.counts.get(name, 0):<4}"
            if per:
                line += f" {seconds * 1e3 / per:8.2f} ms/variant"
            lines.append(line)
        return "\n".join(lines)
