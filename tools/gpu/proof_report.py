"""What a one-call GPU proof script needs around its cases: a clock with a budget, one-line failures that let the
other cases go on, output flushed line by line, markdown tables, and a JSON summary rewritten as it grows (so a
call cut at its time limit still brings back what was done). Used by ``tools/gpu/fused_moe_proof.py``."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def say(text: str) -> None:
    print(text, flush=True)


def number(value: Any) -> str:
    """``1.23e-03``; ``-`` for nothing or NaN."""
    return "-" if value is None or value != value else f"{value:.2e}"


def finite(value: float | None) -> float | None:
    """JSON has no NaN: ``None`` for it."""
    return None if value is None or value != value else value


def one_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:300]


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    say(f"\n### {title}\n")
    say("| " + " | ".join(headers) + " |")
    say("|" + "---|" * len(headers))
    for row in rows:
        say("| " + " | ".join(str(cell).replace("|", "/") for cell in row) + " |")
    say("")


class Run:
    """The clock (``budget_s``: no case starts after it), the failures and the JSON summary in ``out``."""

    def __init__(self, out: Path, name: str, budget_s: float, settings: dict[str, Any]) -> None:
        self.out, self.name, self.budget_s, self.start = out, name, budget_s, time.monotonic()
        self.summary: dict[str, Any] = {"settings": {k: str(v) for k, v in settings.items()}, "failures": []}
        self.skipped: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def over_budget(self, what: str, spare_s: float = 0.0) -> bool:
        """Whether the budget, less ``spare_s`` kept for later work, is spent (then ``what`` is noted as
        skipped)."""
        if self.elapsed() <= self.budget_s - spare_s:
            return False
        say(
            f"  skipped {what}: the {self.budget_s:.0f} s budget is spent ({spare_s:.0f} s kept for later parts)"
        )
        self.skipped.append(what)
        self.summary["failures"].append({"case": what, "error": "skipped: time budget"})
        return True

    # Callable[..., ...], called with no argument: mypy rejects the callers' lambdas, whose defaults bind loop
    # variables, as Callable[[], ...] (python/mypy#15459)
    def attempt(self, what: str, action: Callable[..., Any]) -> Any:
        """``action()``, or ``None`` after a one-line failure (the traceback goes to the summary)."""
        try:
            return action()
        except Exception as error:
            say(f"  FAILED {what}: {one_line(error)}")
            self.summary["failures"].append({"case": what, "error": traceback.format_exc(limit=8)})
            return None

    def save(self) -> Path:
        self.summary["elapsed_s"] = round(self.elapsed(), 1)
        path = self.out / f"{self.name}.json"
        path.write_text(json.dumps(self.summary, indent=1, default=str), encoding="utf-8")
        return path
