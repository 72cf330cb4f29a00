"""The diff view: baseline (offline: the recorded output), variant and reference side by side over a window of rows
and columns.

Each pane shows the same window; a value over the tolerance is red, NaN / Inf magenta, rows the kernel does not write
are dim. The window moves with the arrow keys (a column step moves by a whole window) and ``f`` jumps to the first
element over the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from moereplay.tui.bindings import bindings_for
from moereplay.tui.error_grid import ErrorField
from moereplay.tui.replays import VariantTensors

CELL_WIDTH = 8
ROW_LABEL_WIDTH = 10
PANE_GAP = 3


@dataclass(frozen=True, eq=False)
class DiffPanes:
    """What the diff view draws: the chosen variant, and the row it is set beside (errors of each vs its reference):
    the baseline, or offline the recorded output (``baseline_label``)."""

    label: str
    variant: VariantTensors
    variant_errors: ErrorField
    baseline: VariantTensors | None = None
    baseline_errors: ErrorField | None = None
    baseline_label: str = "baseline"


def format_value(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        for digits in (4, 3, 2):
            text = f"{value:.{digits}g}"
            if len(text) <= CELL_WIDTH:
                return text
    return f"{value:.1e}".replace("e-0", "e-").replace("e+0", "e+")


def row_label(tensors: VariantTensors, row: int) -> str:
    """``12 t3 e5``: the row, its token and its expert when the reference says."""
    text = str(row)
    rows = tensors.rows
    if rows is not None and 0 <= row < rows.rows:
        token, expert = int(rows.token[row]), int(rows.expert[row])
        if token >= 0:
            text += f" t{token}"
        if expert >= 0:
            text += f" e{expert}"
    return text[:ROW_LABEL_WIDTH]


class DiffView(Widget, can_focus=True):
    """Three panes over one window; :attr:`origin` is the window's top-left ``(row, col)``."""

    BINDINGS = bindings_for("diff")

    DEFAULT_CSS = """
    DiffView { height: 1fr; padding: 0 1; }
    DiffView:focus { background: $boost; }
    """

    origin: reactive[tuple[int, int]] = reactive((0, 0))

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.panes: DiffPanes | None = None
        self.note = "no replay yet"

    def show(self, panes: DiffPanes | None, note: str = "") -> None:
        self.panes = panes
        self.note = note
        self.origin = self.validate_origin(self.origin)
        self.refresh()

    # ------------------------------------------------------------------------------------------ geometry

    @property
    def window(self) -> tuple[int, int]:
        """How many rows and columns of the output the window shows at the current size."""
        width, height = self.content_region.width or 80, self.content_region.height or 20
        columns = (width - ROW_LABEL_WIDTH - 2 * PANE_GAP) // 3 // (CELL_WIDTH + 1)
        return max(1, height - 3), max(1, columns)

    def validate_origin(self, origin: tuple[int, int]) -> tuple[int, int]:
        if self.panes is None:
            return (0, 0)
        rows, cols = self.panes.variant.shape
        window_rows, window_cols = self.window
        row = max(0, min(origin[0], rows - window_rows))
        col = max(0, min(origin[1], cols - window_cols))
        return (row, col)

    def action_move_window(self, rows: int, cols: int) -> None:
        _, window_cols = self.window
        self.origin = (self.origin[0] + rows, self.origin[1] + cols * window_cols)

    def action_first_bad(self) -> None:
        if self.panes is None:
            return
        found = self.panes.variant_errors.first_bad()
        if found is None:
            self.notify(f"{self.panes.label}: no element over the tolerance")
            return
        self.show_element(*found)

    def show_element(self, row: int, col: int) -> None:
        """Move the window so that ``(row, col)`` is in it, near the top left."""
        self.origin = (row - 1, col)

    # ------------------------------------------------------------------------------------------ drawing

    def render(self) -> RenderableType:
        panes = self.panes
        if panes is None:
            return Text(self.note, style="dim italic")
        rows, cols = panes.variant.shape
        window_rows, window_cols = self.window
        row0, col0 = self.origin
        row1, col1 = min(rows, row0 + window_rows), min(cols, col0 + window_cols)
        errors = panes.variant_errors
        head = Text()
        head.append(panes.label, style="bold")
        head.append(
            f"  rows {row0}–{row1 - 1} of {rows}, cols {col0}–{col1 - 1} of {cols}"
            f"  tolerance {errors.tolerance_name} {errors.tolerance:g}",
            style="dim",
        )
        table = Table(box=None, padding=(0, 0), pad_edge=False, show_edge=False, collapse_padding=True)
        table.add_column("row", width=ROW_LABEL_WIDTH, no_wrap=True, style="dim", header_style="dim")
        peer = panes.baseline_label
        middle = "variant" if panes.label != peer else f"variant = {peer}"
        panes_shown = (
            (peer, panes.baseline, panes.baseline_errors),
            (middle, panes.variant, errors),
            ("reference", panes.variant, None),
        )
        pane_width = (col1 - col0) * (CELL_WIDTH + 1)
        titles = Text(" " * ROW_LABEL_WIDTH)
        for number, (title, _, _) in enumerate(panes_shown):
            titles.append(title.center(pane_width)[:pane_width], style="bold reverse")
            if number < 2:
                titles.append(" " * PANE_GAP)
            for col in range(col0, col1):
                table.add_column(
                    str(col), width=CELL_WIDTH + 1, justify="right", no_wrap=True, header_style="dim"
                )
            if number < 2:
                table.add_column("", width=PANE_GAP, no_wrap=True)
        written = panes.variant.written
        for row in range(row0, row1):
            cells: list[str | Text] = [row_label(panes.variant, row)]
            dim = not bool(written[row])
            for number, (_, tensors, pane_errors) in enumerate(panes_shown):
                for col in range(col0, col1):
                    if number == 2:
                        value = float(panes.variant.reference[row, col])
                    elif tensors is None:
                        cells.append(Text("—", style="dim"))
                        continue
                    else:
                        value = float(tensors.output[row, col])
                    cells.append(self._cell(value, pane_errors, row, col, dim))
                if number < 2:
                    cells.append(Text(" │ ", style="dim"))
            table.add_row(*cells)
        return Group(head, titles, table)

    @staticmethod
    def _cell(value: float, errors: ErrorField | None, row: int, col: int, dim: bool) -> Text:
        text = format_value(value)
        if dim:
            return Text(text, style="dim")
        if errors is None:
            return Text(text)
        marker = errors.marker(row, col)
        if marker in ("nan", "inf"):
            return Text(text, style="bold magenta")
        if float(errors.relative[row, col]) > errors.tolerance:
            return Text(text, style="bold red" if marker == "large" else "red")
        return Text(text, style="green")
