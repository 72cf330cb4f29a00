"""The variant matrix: one row per variant — the recorded output first, then the baseline replay, then the
mutations — one column per measure of the replay's verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.cells import cell_len
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
        self._set_columns(())

    def _set_columns(self, rows: Sequence[tuple[str | Text, ...]]) -> None:
        """Columns as wide as their header and the ``rows`` about to be shown. ``DataTable`` widens an auto-sized
        column only when idle, and keeps the lines it drew before that: a matrix drawn between a replay's rows
        arriving and the table going idle showed its numbers cut ("2.01e+0") until the next change — what a
        snapshot of the dialog over it caught on a loaded machine."""
        self.clear(columns=True)
        for index, column in enumerate(COLUMNS):
            width = max([cell_len(column), *(_width(row[index]) for row in rows)])
            if column == "verdict":  # as wide as the longest verdict, whatever rows come ("needs-kernel")
                width = max(width, *(len(verdict.value) for verdict in Verdict))
            self.add_column(column, width=width, key=column)

    def show(
        self, results: Sequence[VariantResult], pending: Sequence[str] = (), keep: str | None = None
    ) -> None:
        """The replay's ``results``, then ``pending`` labels (added since the last run) marked "not run"."""
        rows: dict[str, tuple[str | Text, ...]] = {}
        for result in results:
            rows.setdefault(result.label, result_cells(result))
        blanks = ("",) * (len(COLUMNS) - 3)
        for label in pending:
            rows.setdefault(label, (label, Text("not run", style="dim italic"), *blanks, "r reruns"))
        self._set_columns(tuple(rows.values()))
        for label, cells in rows.items():
            self.add_row(*cells, key=label)
        self.labels = tuple(rows)
        if keep in rows:
            self.move_cursor(row=self.labels.index(keep))

    @property
    def current_label(self) -> str | None:
        if not self.labels or self.cursor_row < 0:
            return None
        return self.labels[min(self.cursor_row, len(self.labels) - 1)]


def _width(cell: str | Text) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)
