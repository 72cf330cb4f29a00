"""The call table: a virtual table over a capture's index that decodes only the rows on screen.

Textual's ``DataTable`` measures every row it is given (≈1.7 s for 10,000 rows, measured), so the browser draws
its rows itself on the Line API: :meth:`CallTable.render_line` asks the :class:`~moereplay.tui.catalog.CallCatalog`
for the one row it draws, and the row count comes from the file's index. A 10,000-call capture paints in the time it
takes to decode a screenful of call records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from moereplay.tui.bindings import bindings_for
from moereplay.tui.catalog import CallCatalog, CallSummary

STATUS_TEXT = {"completed": "completed", "inputs_saved": "no output", "failed": "failed"}
"""How a call's status reads in the table (``inputs_saved``: the process never got past the kernel)."""

VERDICT_CLASSES = {
    "ok": "call-table--ok",
    "memory-dependent": "call-table--bad",
    "corrupt": "call-table--bad",
    "nonfinite": "call-table--bad",
    "crash": "call-table--bad",
    "invalid": "call-table--invalid",
    "needs-kernel": "call-table--running",
    "running": "call-table--running",
    "error": "call-table--invalid",
}


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    key: str


def layout_columns(width: int, index_digits: int) -> tuple[Column, ...]:
    """Columns fitted to ``width`` cells: the key shapes take what the fixed columns leave (rank only when wide)."""
    fixed = [
        Column("#", max(3, index_digits), "index"),
        Column("op", 21, "op"),
        Column("layer", 5, "layer"),
        Column("step", 5, "step"),
    ]
    if width >= 100:
        fixed.append(Column("rank", 4, "rank"))
    tail = [Column("status", 9, "status"), Column("verdict", 9, "verdict")]
    used = sum(column.width + 1 for column in (*fixed, *tail))
    shapes = Column("key shapes", max(10, width - used - 1), "shapes")
    return (*fixed, shapes, *tail)


def _cell(text: str, width: int, right: bool = False) -> str:
    if len(text) > width:
        return text[: max(0, width - 1)] + "…"
    return text.rjust(width) if right else text.ljust(width)


def _number(value: int | None) -> str:
    return "" if value is None else str(value)


class CallTable(ScrollView, can_focus=True):
    """A cursor over ``rows`` (call indices, in display order) of a catalog."""

    BINDINGS = bindings_for("table")

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "call-table--header",
        "call-table--cursor",
        "call-table--ok",
        "call-table--bad",
        "call-table--invalid",
        "call-table--running",
        "call-table--warning",
    }

    DEFAULT_CSS = """
    CallTable { height: 1fr; }
    CallTable > .call-table--header { text-style: bold; background: $panel; }
    CallTable > .call-table--cursor { background: $accent 40%; }
    CallTable:focus > .call-table--cursor { background: $accent; color: $text; }
    CallTable > .call-table--ok { color: $success; }
    CallTable > .call-table--bad { color: $error; text-style: bold; }
    CallTable > .call-table--invalid { color: $warning; }
    CallTable > .call-table--running { color: $secondary; text-style: italic; }
    CallTable > .call-table--warning { color: $warning; }
    """

    cursor: reactive[int] = reactive(0, always_update=True)

    @dataclass
    class Highlighted(Message):
        """The cursor moved to call ``index`` (``None``: the table is empty)."""

        table: CallTable
        index: int | None

    @dataclass
    class Selected(Message):
        """Enter or a click on call ``index``."""

        table: CallTable
        index: int

    def __init__(
        self,
        catalog: CallCatalog,
        verdict_of: Callable[[int], str | None],
        *,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.catalog = catalog
        self.verdict_of = verdict_of
        self.rows: Sequence[int] = catalog.indices
        self._digits = len(str(max(catalog.indices, default=0)))
        self._update_virtual_size()

    # ------------------------------------------------------------------------------------------ data

    def set_rows(self, rows: Sequence[int], keep: int | None = None) -> None:
        """Show ``rows``; the cursor stays on call ``keep`` when it is among them, else goes to the top."""
        self.rows = rows
        self._update_virtual_size()
        position = 0
        if keep is not None:
            try:
                position = list(rows).index(keep) if len(rows) < 200_000 else 0
            except ValueError:
                position = 0
        self.cursor = position
        self.refresh()

    @property
    def current(self) -> int | None:
        """The call index under the cursor."""
        if not self.rows:
            return None
        return self.rows[min(self.cursor, len(self.rows) - 1)]

    def current_summary(self) -> CallSummary | None:
        index = self.current
        return None if index is None else self.catalog.summary(index)

    def move_to_call(self, index: int) -> bool:
        try:
            self.cursor = list(self.rows).index(index)
        except ValueError:
            return False
        return True

    def refresh_call(self, index: int) -> None:
        """A verdict for call ``index`` arrived: redraw its line if it is on screen."""
        try:
            position = list(self.rows).index(index) if len(self.rows) < 200_000 else None
        except ValueError:
            return
        top = round(self.scroll_y)
        if position is None:
            self.refresh()
        elif top <= position < top + self._page:
            self.refresh_line(position + 1)  # virtual lines: the header is line 0

    def _update_virtual_size(self) -> None:
        self.virtual_size = Size(max(self.size.width, 40), len(self.rows) + 1)

    # ------------------------------------------------------------------------------------------ cursor

    @property
    def _page(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def validate_cursor(self, value: int) -> int:
        return max(0, min(value, len(self.rows) - 1)) if self.rows else 0

    def watch_cursor(self, old: int, new: int) -> None:
        top = round(self.scroll_y)
        if new < top:
            self.scroll_to(y=new, animate=False, immediate=True)
        elif new > top + self._page - 1:
            self.scroll_to(y=new - self._page + 1, animate=False, immediate=True)
        self.refresh()
        self.post_message(self.Highlighted(self, self.current))

    def action_cursor(self, delta: int) -> None:
        self.cursor += delta

    def action_page(self, direction: int) -> None:
        self.cursor += direction * self._page

    def action_first(self) -> None:
        self.cursor = 0

    def action_last(self) -> None:
        self.cursor = len(self.rows) - 1

    def key_enter(self) -> None:
        index = self.current
        if index is not None:
            self.post_message(self.Selected(self, index))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y == 0:
            return
        position = round(self.scroll_y) + offset.y - 1
        if 0 <= position < len(self.rows):
            if position == self.cursor and event.chain >= 2:
                self.post_message(self.Selected(self, self.rows[position]))
            self.cursor = position

    def on_resize(self, event: events.Resize) -> None:
        self._update_virtual_size()

    # ------------------------------------------------------------------------------------------ drawing

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        columns = layout_columns(width, self._digits)
        if y == 0:
            header = self.get_component_rich_style("call-table--header")
            text = " ".join(_cell(column.title, column.width, column.key == "index") for column in columns)
            return Strip([Segment(_cell(text, width), header)], width)
        position = round(self.scroll_y) + y - 1
        if position >= len(self.rows):
            return Strip.blank(width, self.rich_style)
        index = self.rows[position]
        summary = self.catalog.summary(index)
        verdict = self.verdict_of(index)
        base = self.rich_style
        if position == self.cursor:
            base = base + self.get_component_rich_style("call-table--cursor")
        segments: list[Segment] = []
        for number, column in enumerate(columns):
            if number:
                segments.append(Segment(" ", base))
            text, style = self._cell_text(column.key, summary, verdict)
            cell_style = base if style is None else base + style
            segments.append(Segment(_cell(text, column.width, column.key == "index"), cell_style))
        used = sum(len(segment.text) for segment in segments)
        if used < width:
            segments.append(Segment(" " * (width - used), base))
        return Strip(segments).crop(0, width)

    def _cell_text(self, key: str, summary: CallSummary, verdict: str | None) -> tuple[str, Style | None]:
        if key == "index":
            return str(summary.index), None
        if key == "op":
            return summary.op, None
        if key == "layer":
            return _number(summary.layer), None
        if key == "step":
            return _number(summary.step), None
        if key == "rank":
            return _number(summary.rank), None
        if key == "shapes":
            return summary.shapes, None
        if key == "status":
            text = STATUS_TEXT.get(summary.status, summary.status)
            warn = summary.status != "completed"
            return text, self.get_component_rich_style("call-table--warning", partial=True) if warn else None
        if verdict is None:
            return "", None
        component = VERDICT_CLASSES.get(verdict)
        return verdict, None if component is None else self.get_component_rich_style(component, partial=True)
