"""Bindings are data: unique ids, every action exists where it is bound, and the help screen lists them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_helpers import make_app, run_async, settle

from moereplay.tui.app import MoereplayApp
from moereplay.tui.bindings import COMMANDS, commands_for
from moereplay.tui.screens.bisect import BisectScreen
from moereplay.tui.screens.browser import BrowserScreen
from moereplay.tui.screens.call import CallScreen
from moereplay.tui.screens.dialogs import BisectDialog, MutationDialog
from moereplay.tui.screens.help import HelpScreen
from moereplay.tui.widgets.browser.call_table import CallTable
from moereplay.tui.widgets.call.diff_view import DiffView
from moereplay.tui.widgets.call.heat_map import HeatMap

OWNERS: dict[str, tuple[type, ...]] = {
    "global": (MoereplayApp,),
    "browser": (BrowserScreen,),
    "table": (CallTable,),
    "call": (CallScreen,),
    "diff": (DiffView,),
    "heatmap": (HeatMap,),
    "bisect": (BisectScreen,),
    "modal": (MutationDialog, BisectDialog),
    "help": (HelpScreen,),
}


def test_ids_are_unique_and_namespaced() -> None:
    ids = [command.id for command in COMMANDS]
    assert len(ids) == len(set(ids))
    assert all(command.id.split(".", 1)[0] in OWNERS for command in COMMANDS)
    assert all(command.description for command in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.id)
def test_every_action_exists_where_it_is_bound(command) -> None:  # type: ignore[no-untyped-def]
    action = command.action.split("(", 1)[0]
    owners = OWNERS[command.area]
    runners = (MoereplayApp,) if action.startswith("app.") else owners
    for runner in runners:
        name = f"action_{action.removeprefix('app.')}"
        assert callable(getattr(runner, name, None)), f"{runner.__name__} lacks {name}"
    for owner in owners:
        bound = {binding.id for binding in getattr(owner, "BINDINGS", ()) if hasattr(binding, "id")}
        assert command.id in bound, f"{command.id} is not in {owner.__name__}.BINDINGS"


def help_ids(app: MoereplayApp) -> list[str]:
    screen = app.screen
    assert isinstance(screen, HelpScreen)
    shown = [str(static.render()) for static in screen.query(".help-area")]
    assert len(shown) == len(screen.areas)
    return list(screen.listed_ids)


@run_async
async def test_help_lists_the_screen_bindings_first(marlin_capture: Path) -> None:
    app = make_app(marlin_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        listed = help_ids(app)
        expected = [c.id for c in (*commands_for("browser"), *commands_for("table"), *commands_for("global"))]
        assert listed == expected
        await pilot.press("question_mark")
        assert isinstance(app.screen, BrowserScreen)
        await pilot.press("enter")
        await settle(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        assert help_ids(app)[0] == "call.arguments"
        assert "heatmap.open" in help_ids(app)
        await pilot.press("escape")
        assert isinstance(app.screen, CallScreen)
