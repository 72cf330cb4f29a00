"""The variant matrix: one row per variant — the recorded output first, then the baseline replay, then the
mutations — one column per measure of the replay's verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from moereplay.replay.results import VariantResult, Verdict

VERDICT_STYLES = {
    "ok": "bold green",
    "memory-dependent": "bold dark_orange",
    "corrupt": "bold red",
    "nonfinite": "bold magenta",
    "crash": "bold red reverse",
    "invalid": "yellow",
    "needs-kernel": "dim",
}

COLUMNS = (
    "variant",
    "verdict",
    "bad rows",
    "max rel",
    "rms rel",
    "max abs",
    "NaN",
    "Inf",
    "exact",
    "guard",
    "s",
    "note",
)


def _number(value: float) -> str:
    if math.isnan(value):
        return "—"
    if math.isinf(value):
        return "inf"
    return f"{value:.2e}"


def _exact(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "no")


def result_cells(result: VariantResult) -> tuple[str | Text, ...]:
    verdict = Text(result.verdict.value, style=VERDICT_STYLES.get(result.verdict.value, ""))
    bad = f"{result.bad_rows}/{result.rows}" if result.rows else "—"
    seconds = "—" if result.elapsed_s is None else f"{result.elapsed_s:.3f}"
    note = result.reason or result.tolerance
    return (
        result.label,
        verdict,
        bad,
        _number(result.max_rel),
        _number(result.rms_rel),
        _number(result.max_abs),
        str(result.nan),
        str(result.inf),
        _exact(result.bit_exact),
        result.guard.value,
        seconds,
        note,
    )


class VariantMatrix(DataTable[str | Text]):
    """Rows keyed by variant label; :meth:`show` fills it from a report plus the labels not run yet."""

    DEFAULT_CSS = """
    VariantMatrix { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.labels: tuple[str, ...] = ()

    def on_mount(self) -> None:
        for column in COLUMNS:
            # the verdict column as wide as the longest verdict from the start ("needs-kernel"): a column that
            # widens when such a row arrives moves the others under a dialog drawn over the matrix
            width = max(len(verdict.value) for verdict in Verdict) if column == "verdict" else None
            self.add_column(column, width=width, key=column)

    def show(
        self, results: Sequence[VariantResult], pending: Sequence[str] = (), keep: str | None = None
    ) -> None:
        """The replay's ``results``, then ``pending`` labels (added since the last run) marked "not run"."""
        self.clear()
        labels: list[str] = []
        for result in results:
            if result.label in labels:
                continue
            self.add_row(*result_cells(result), key=result.label)
            labels.append(result.label)
        for label in pending:
            if label in labels:
                continue
            blanks = ("",) * (len(COLUMNS) - 3)
            self.add_row(label, Text("not run", style="dim italic"), *blanks, "r reruns", key=label)
            labels.append(label)
        self.labels = tuple(labels)
        if keep in labels:
            self.move_cursor(row=labels.index(keep))

    @property
    def current_label(self) -> str | None:
        if not self.labels or self.cursor_row < 0:
            return None
        return self.labels[min(self.cursor_row, len(self.labels) - 1)]
