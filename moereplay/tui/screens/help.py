"""The help screen: every binding of the screen it was opened from, then the rest, from the binding table."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from moereplay.tui.bindings import AREA_TITLES, Area, bindings_for, commands_for

KEY_NAMES = {
    "question_mark": "?",
    "slash": "/",
    "left_square_bracket": "[",
    "right_square_bracket": "]",
}


def key_text(keys: str) -> str:
    """``"question_mark,f1"`` → ``"?, f1"``."""
    return ", ".join(KEY_NAMES.get(key, key) for key in keys.split(","))


def area_table(area: Area) -> Table:
    table = Table(
        title=AREA_TITLES[area],
        title_justify="left",
        title_style="bold",
        expand=True,
        box=None,
        padding=(0, 1),
    )
    table.add_column("key", style="bold cyan", no_wrap=True, ratio=1)
    table.add_column("does", ratio=3)
    table.add_column("id", style="dim", no_wrap=True, ratio=2)
    for command in commands_for(area):
        table.add_row(key_text(command.keys), command.description, command.id)
    return table


class HelpScreen(ModalScreen[None]):
    """Lists :data:`~moereplay.tui.bindings.COMMANDS`: this screen's areas first, then the global ones."""

    BINDINGS = bindings_for("help")

    def __init__(self, areas: Sequence[Area]) -> None:
        super().__init__()
        shown: list[Area] = [*areas, "global"]
        self.areas: tuple[Area, ...] = tuple(dict.fromkeys(shown))

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Static(
                "[b]Key bindings[/b] · escape closes · ids name bindings in a keymap", id="help-title"
            )
            for area in self.areas:
                yield Static(area_table(area), classes="help-area")

    @property
    def listed_ids(self) -> tuple[str, ...]:
        """Binding ids in the order the screen lists them."""
        return tuple(command.id for area in self.areas for command in commands_for(area))
