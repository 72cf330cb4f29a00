"""The call browser: lazy rows, filters, replays in workers, verdicts, navigation."""

from __future__ import annotations

from pathlib import Path

from tui_helpers import make_app, run_async, settle

from moereplay.tui.screens.browser import BrowserScreen
from moereplay.tui.screens.call import CallScreen
from moereplay.tui.widgets.browser.call_table import CallTable


@run_async
async def test_rows_come_from_the_index_and_only_visible_ones_are_decoded(synthetic_capture: Path) -> None:
    app = make_app(synthetic_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, BrowserScreen)
        table = app.screen.query_one(CallTable)
        assert len(table.rows) == 300
        assert app.catalog is not None
        assert 0 < app.catalog.decoded <= 30  # one screenful, not the file
        await pilot.press("end")
        await pilot.pause()
        assert table.current == 299
        assert app.catalog.decoded <= 60


@run_async
async def test_filter_by_fields_and_words(synthetic_capture: Path) -> None:
    app = make_app(synthetic_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, BrowserScreen)
        table = screen.query_one(CallTable)
        await pilot.press("slash", *"layer:3 op:matmul*", "enter")
        await settle(pilot)
        expected = [i for i in range(300) if i % 24 == 3 and i % 3 == 1]
        assert list(table.rows) == expected
        assert table.has_focus
        await pilot.press("slash", "ctrl+u", *"synthetic:4 step:2-5", "enter")
        await settle(pilot)
        assert list(table.rows) == [i for i in range(300) if i % 5 == 4 and 2 <= i // 24 <= 5]
        await pilot.press("slash", "ctrl+u", *"status:inputs", "enter")
        await settle(pilot)
        assert list(table.rows) == [i for i in range(300) if i % 10 == 9]
        await pilot.press("slash", "ctrl+u", *"layer:x", "enter")
        await settle(pilot)
        assert "layer: 'x' is not a number" in screen.status
        await pilot.press("slash", "escape")
        await settle(pilot)
        assert len(table.rows) == 300


@run_async
async def test_replay_selected_call_shows_its_verdict(stream_capture: Path) -> None:
    app = make_app(stream_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, BrowserScreen)
        await pilot.press("down", "r")
        await settle(pilot)
        assert app.verdicts == {1: "ok"}
        await pilot.press("up", "r")  # the enclosing call: no ops module
        await settle(pilot)
        assert 0 not in app.verdicts
        assert "not replayable" in str(screen.query_one("#call-detail").render())


@run_async
async def test_replay_all_then_jump_between_failures(stream_capture: Path) -> None:
    app = make_app(stream_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.screen
        assert isinstance(screen, BrowserScreen)
        table = screen.query_one(CallTable)
        await pilot.press("R")
        await settle(pilot)
        assert app.verdicts == {1 + n: ("corrupt" if n >= 5 else "ok") for n in range(8)}
        assert "replays done" in screen.status
        await pilot.press("home", "n")
        assert table.current == 6
        await pilot.press("n", "n")
        assert table.current == 8
        await pilot.press("N")
        assert table.current == 7
        await pilot.press("slash", *"verdict:bad", "enter")
        await settle(pilot)
        assert list(table.rows) == [6, 7, 8]


@run_async
async def test_enter_opens_the_call_view(stream_capture: Path) -> None:
    app = make_app(stream_capture)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("down", "down", "enter")
        await pilot.pause()
        assert isinstance(app.screen, CallScreen)
        assert app.screen.index == 2
        await settle(pilot)
        await pilot.press("escape")
        assert isinstance(app.screen, BrowserScreen)
        assert app.verdicts[2] == "ok"  # the call view's replay is remembered
