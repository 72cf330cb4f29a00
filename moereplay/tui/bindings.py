"""Every key binding of the TUI, as data: one :class:`Command` per action, with a stable id and a description.

Screens take their ``BINDINGS`` from :func:`bindings_for`; the help screen lists :data:`COMMANDS` for the screen in
front plus the global ones. The ids (``browser.open``, ``bisect.good`` …) are Textual binding ids, so a user keymap
(``App.set_keymap``) can rebind any of them without touching the code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from textual.binding import Binding, BindingType

Area = Literal["global", "browser", "table", "call", "diff", "heatmap", "bisect", "modal", "help"]

AREA_TITLES: dict[Area, str] = {
    "global": "Everywhere",
    "browser": "Call browser",
    "table": "Call table (browser)",
    "call": "Call view",
    "diff": "Diff view (call view, Diff tab)",
    "heatmap": "Heat map (call view, Heat map tab)",
    "bisect": "Bisect session",
    "modal": "Dialogs",
    "help": "This help",
}


@dataclass(frozen=True)
class Command:
    """One bindable action.

    ``id``: ``<area>.<name>``, unique and stable (keymaps refer to it). ``keys``: Textual key names, comma-separated
    for alternatives. ``action``: the Textual action string. ``show``: whether the footer shows it.
    """

    id: str
    keys: str
    action: str
    description: str
    show: bool = True
    priority: bool = False

    @property
    def area(self) -> Area:
        area = self.id.split(".", 1)[0]
        assert area in AREA_TITLES, area
        return area

    def binding(self) -> Binding:
        return Binding(
            self.keys, self.action, self.description, show=self.show, priority=self.priority, id=self.id
        )


COMMANDS: tuple[Command, ...] = (
    # everywhere
    Command("global.help", "question_mark,f1", "app.help", "Help"),
    Command("global.quit", "ctrl+q", "app.quit", "Quit", show=False, priority=True),
    # the call browser
    Command("browser.open", "enter", "open_call", "Open call"),
    Command("browser.filter", "slash", "focus_filter", "Filter"),
    Command("browser.clear_filter", "escape", "clear_filter", "Clear filter", show=False),
    Command("browser.replay", "r", "replay_selected", "Replay"),
    Command("browser.replay_all", "R", "replay_visible", "Replay all shown"),
    Command("browser.stop", "x", "stop_replays", "Stop replays", show=False),
    Command("browser.next_failure", "n", "next_failure", "Next failure", show=False),
    Command("browser.previous_failure", "N", "previous_failure", "Previous failure", show=False),
    Command("browser.bisect", "b", "bisect", "Bisect"),
    Command("browser.quit", "q", "app.quit", "Quit"),
    # the call table
    Command("table.up", "up,k", "cursor(-1)", "Previous call", show=False),
    Command("table.down", "down,j", "cursor(1)", "Next call", show=False),
    Command("table.page_up", "pageup", "page(-1)", "Page up", show=False),
    Command("table.page_down", "pagedown", "page(1)", "Page down", show=False),
    Command("table.first", "home", "first", "First call", show=False),
    Command("table.last", "end", "last", "Last call", show=False),
    # the call view
    Command("call.arguments", "1", "show_tab('arguments')", "Arguments", show=False),
    Command("call.variants", "2", "show_tab('variants')", "Variants", show=False),
    Command("call.diff", "3", "show_tab('diff')", "Diff", show=False),
    Command("call.heatmap", "4", "show_tab('heatmap')", "Heat map", show=False),
    Command("call.findings", "5", "show_tab('findings')", "Findings", show=False),
    Command("call.add_mutation", "a", "add_mutation", "Add mutation"),
    Command("call.remove_mutation", "d,delete", "remove_mutation", "Remove"),
    Command("call.rerun", "r", "rerun", "Rerun"),
    Command("call.next_variant", "right_square_bracket", "cycle_variant(1)", "Next variant", show=False),
    Command("call.previous_variant", "left_square_bracket", "cycle_variant(-1)", "Prev variant", show=False),
    Command("call.bisect", "b", "bisect", "Bisect"),
    Command("call.back", "escape", "back", "Back"),
    # the diff view
    Command("diff.left", "left,h", "move_window(0,-1)", "Window left", show=False),
    Command("diff.right", "right,l", "move_window(0,1)", "Window right", show=False),
    Command("diff.up", "up,k", "move_window(-1,0)", "Window up", show=False),
    Command("diff.down", "down,j", "move_window(1,0)", "Window down", show=False),
    Command("diff.page_up", "pageup", "move_window(-8,0)", "Window up a page", show=False),
    Command("diff.page_down", "pagedown", "move_window(8,0)", "Window down a page", show=False),
    Command("diff.first_bad", "f", "first_bad", "Jump to the first bad element", show=False),
    # the heat map
    Command("heatmap.left", "left,h", "move_cursor(0,-1)", "Cell left", show=False),
    Command("heatmap.right", "right,l", "move_cursor(0,1)", "Cell right", show=False),
    Command("heatmap.up", "up,k", "move_cursor(-1,0)", "Cell up", show=False),
    Command("heatmap.down", "down,j", "move_cursor(1,0)", "Cell down", show=False),
    Command("heatmap.open", "enter", "open_cell", "Show this cell in the diff view", show=False),
    # the bisect session
    Command("bisect.step", "space", "step", "Step"),
    Command("bisect.play", "p", "toggle_play", "Run/pause"),
    Command("bisect.evaluate", "e", "evaluate", "Evaluate", show=False),
    Command("bisect.good", "g", "decide('good')", "Good"),
    Command("bisect.bad", "b", "decide('bad')", "Bad"),
    Command("bisect.skip", "s", "decide('skip')", "Skip"),
    Command("bisect.export", "x", "export_repro", "Export repro"),
    Command("bisect.back", "escape", "back", "Back"),
    # dialogs
    Command("modal.cancel", "escape", "cancel", "Cancel"),
    # help
    Command("help.close", "escape,q,question_mark", "app.pop_screen", "Close"),
)

_BY_ID = {command.id: command for command in COMMANDS}
if len(_BY_ID) != len(COMMANDS):  # pragma: no cover - a programming error caught at import
    raise RuntimeError("duplicate command ids")


def command(command_id: str) -> Command:
    return _BY_ID[command_id]


def commands_for(*areas: Area) -> tuple[Command, ...]:
    return tuple(command for command in COMMANDS if command.area in areas)


def bindings_for(*areas: Area) -> list[BindingType]:
    """The Textual bindings of ``areas``, for a screen's or widget's ``BINDINGS``."""
    return [command.binding() for command in commands_for(*areas)]
