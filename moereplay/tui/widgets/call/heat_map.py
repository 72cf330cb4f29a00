"""The heat map: one line per output row, one cell per block of columns, shaded by the block's worst error.

Shades are multiples of the tolerance; ``N`` marks a block holding NaN where the reference is finite, ``I`` Inf,
``!`` a value more than :data:`~moereplay.tui.error_grid.LARGE_RELATIVE_ERROR` row scales away. The right column is
the row's maximum, the bottom line each block's. Enter shows the cell in the diff view.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.text import Text
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from moereplay.tui.bindings import bindings_for
from moereplay.tui.error_grid import ErrorField, ErrorGrid
from moereplay.tui.replays import VariantTensors
from moereplay.tui.widgets.call.diff_view import row_label

LABEL_WIDTH = 12
SUMMARY_WIDTH = 9

SHADES: tuple[tuple[float, str, str], ...] = (
    (0.1, "·", "green"),
    (1.0, "▪", "bright_green"),
    (10.0, "▒", "yellow"),
    (100.0, "▓", "dark_orange"),
    (float("inf"), "█", "red"),
)
"""(upper bound as a multiple of the tolerance, glyph, colour), in order."""

MARKERS = {"nan": ("N", "bold magenta"), "inf": ("I", "bold magenta"), "large": ("!", "bold red")}


def shade(relative: float, tolerance: float) -> tuple[str, str]:
    ratio = relative / tolerance if tolerance > 0 else relative
    for bound, glyph, colour in SHADES:
        if ratio <= bound:
            return glyph, colour
    return SHADES[-1][1], SHADES[-1][2]


def legend() -> Text:
    text = Text()
    for bound, glyph, colour in SHADES:
        label = "more" if bound == float("inf") else f"≤{bound:g}×tol"
        text.append(glyph, style=colour)
        text.append(f" {label}  ", style="dim")
    for glyph, colour in MARKERS.values():
        text.append(glyph, style=colour)
        text.append(" ", style="dim")
    text.append("NaN Inf large", style="dim")
    return text


class HeatMap(Widget, can_focus=True):
    """Draws an :class:`~moereplay.tui.error_grid.ErrorField` binned to the widget's width."""

    BINDINGS = bindings_for("heatmap")

    DEFAULT_CSS = """
    HeatMap { height: 1fr; padding: 0 1; }
    HeatMap:focus { background: $boost; }
    """

    cursor: reactive[tuple[int, int]] = reactive((0, 0))

    @dataclass
    class CellChosen(Message):
        """Enter on a cell: show rows/columns of it in the diff view."""

        heat_map: HeatMap
        row: int
        first_column: int

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.errors: ErrorField | None = None
        self.tensors: VariantTensors | None = None
        self.label = ""
        self.note = "no replay yet"
        self._grid: ErrorGrid | None = None
        self._top = 0

    def show(
        self, errors: ErrorField | None, tensors: VariantTensors | None, label: str = "", note: str = ""
    ) -> None:
        self.errors, self.tensors, self.label, self.note = errors, tensors, label, note
        self._grid = None
        self.cursor = self.validate_cursor(self.cursor)
        self.refresh()

    # ------------------------------------------------------------------------------------------ geometry

    @property
    def grid(self) -> ErrorGrid | None:
        """The grid at the current width (rebuilt when the width changes the block size)."""
        if self.errors is None:
            return None
        cells = max(1, (self.content_region.width or 80) - LABEL_WIDTH - SUMMARY_WIDTH - 2)
        cols = self.errors.shape[1]
        block = max(1, -(-cols // cells))
        if self._grid is None or self._grid.block != block:
            self._grid = self.errors.grid(block)
        return self._grid

    @property
    def visible_rows(self) -> int:
        return max(1, (self.content_region.height or 20) - 4)

    def validate_cursor(self, cursor: tuple[int, int]) -> tuple[int, int]:
        grid = self.grid
        if grid is None:
            return (0, 0)
        return (max(0, min(cursor[0], grid.rows - 1)), max(0, min(cursor[1], grid.blocks - 1)))

    def watch_cursor(self, cursor: tuple[int, int]) -> None:
        row = cursor[0]
        if row < self._top:
            self._top = row
        elif row >= self._top + self.visible_rows:
            self._top = row - self.visible_rows + 1
        self.refresh()

    def action_move_cursor(self, rows: int, blocks: int) -> None:
        self.cursor = (self.cursor[0] + rows, self.cursor[1] + blocks)

    def action_open_cell(self) -> None:
        grid = self.grid
        if grid is None:
            return
        row, block = self.cursor
        self.post_message(self.CellChosen(self, row, grid.columns(block)[0]))

    def describe_cursor(self) -> str:
        grid, tensors = self.grid, self.tensors
        if grid is None or tensors is None:
            return ""
        row, block = self.cursor
        first, last = grid.columns(block)
        parts = [tensors.describe_row(row), f"cols {first}–{last}"]
        if not bool(grid.written[row]):
            parts.append("not written by the kernel")
        else:
            parts.append(f"max rel {float(grid.maximum[row, block]):.3g}")
            for name, counts in (("NaN", grid.nan), ("Inf", grid.inf), ("large", grid.large)):
                count = int(counts[row, block])
                if count:
                    parts.append(f"{count} {name}")
        return " · ".join(parts)

    # ------------------------------------------------------------------------------------------ drawing

    def render(self) -> RenderableType:
        grid = self.grid
        tensors = self.tensors
        if grid is None or tensors is None:
            return Text(self.note, style="dim italic")
        tolerance = grid.tolerance
        head = Text()
        head.append(self.label, style="bold")
        head.append(f"  {grid.rows} rows × {grid.cols} cols, {grid.block} cols per cell  ", style="dim")
        lines = [head, legend()]
        row_max = grid.row_maximum()
        cursor_row, cursor_block = self.cursor
        for row in range(self._top, min(grid.rows, self._top + self.visible_rows)):
            line = Text(row_label(tensors, row).ljust(LABEL_WIDTH), style="dim")
            written = bool(grid.written[row])
            for block in range(grid.blocks):
                glyph, style = self._glyph(grid, row, block, written, tolerance)
                if (row, block) == (cursor_row, cursor_block) and self.has_focus:
                    style += " reverse"
                line.append(glyph, style=style)
            summary = f" {float(row_max[row]):.1e}" if written else " —"
            line.append(summary, style=shade(float(row_max[row]), tolerance)[1] if written else "dim")
            lines.append(line)
        bottom = Text("block max".ljust(LABEL_WIDTH), style="dim")
        for value in grid.block_maximum().tolist():
            glyph, style = shade(float(value), tolerance)
            bottom.append(glyph, style=style)
        lines.append(bottom)
        lines.append(Text(self.describe_cursor(), style="italic"))
        return Group(*lines)

    @staticmethod
    def _glyph(grid: ErrorGrid, row: int, block: int, written: bool, tolerance: float) -> tuple[str, str]:
        if not written:
            return " ", "dim"
        marker = grid.marker(row, block)
        if marker is not None:
            return MARKERS[marker]
        return shade(float(grid.maximum[row, block]), tolerance)
