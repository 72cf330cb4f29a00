"""The help screen: every binding of the screen it was opened from, then the rest, from the binding table."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from moereplay.tui.bindings import AREA_TITLES, Area, bindings_for, commands_for


def _keys(keys: str) -> str:
    names = {
        "question_mark": "?",
        "slash": "/",
        "left_square_bracket": "[",
        "right_square_bracket": "]",
        "space": "space",
    }
    return ", ".join(names.get(key, key) for key in keys.split(","))


class HelpScreen(ModalScreen[None]):
    """Lists :data:`~moereplay.tui.bindings.COMMANDS`: this screen's areas first, then the global ones."""

    BINDINGS = bindings_for("help")

    def __init__(self, areas: Sequence[Area]) -> None:
        super().__init__()
        shown: list[Area] = [*areas, "global"]
        self.areas: tuple[Area, ...] = tuple(dict.fromkeys(shown))

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Static("[b]Key bindings[/b]  (escape closes; ids are keymap names)", id="help-title")
            table: DataTable[str] = DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("key", "does", "id")
            for area in self.areas:
                table.add_row(f"[b]{AREA_TITLES[area]}[/b]", "", "")
                for command in commands_for(area):
                    table.add_row(_keys(command.keys), command.description, command.id)
            yield table

    @property
    def listed_ids(self) -> tuple[str, ...]:
        return tuple(command.id for area in self.areas for command in commands_for(area))
