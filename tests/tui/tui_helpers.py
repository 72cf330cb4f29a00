"""Helpers for driving the app in tests."""

from __future__ import annotations

import asyncio
import functools
import io
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from rich.console import Console
from textual.pilot import Pilot
from textual.widget import Widget

from moereplay.tui.app import MoereplayApp


def run_async(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an ``async def`` test with ``asyncio.run`` (no async pytest plugin is needed); fixtures still work."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def make_app(path: Path, **options: Any) -> MoereplayApp:
    options.setdefault("backend", "reference")
    return MoereplayApp.for_capture(path, **options)


async def settle(pilot: Pilot[Any], rounds: int = 20) -> None:
    """Wait until no worker runs twice in a row (a screen mounting starts workers; a worker ending may start
    another)."""
    quiet = 0
    for _ in range(rounds):
        await pilot.pause()
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
        quiet = quiet + 1 if not any(worker.is_running for worker in pilot.app.workers) else 0
        if quiet >= 2:
            return


async def until_focused(pilot: Pilot[Any], widget_id: str, rounds: int = 100) -> None:
    """Wait until the widget ``widget_id`` has focus: keys typed while a pushed dialog is still mounting go to the
    screen below it."""
    for _ in range(rounds):
        focused = pilot.app.focused
        if focused is not None and focused.id == widget_id:
            return
        await pilot.pause()


async def until(pilot: Pilot[Any], ready: Callable[[], bool], rounds: int = 200) -> None:
    """Pause until ``ready()`` (a widget filled by a worker's result: the message that fills it comes after the
    worker has ended, so waiting for workers alone can take a snapshot a moment early)."""
    for _ in range(rounds):
        if ready():
            return
        await pilot.pause()


def layout_pending(table: Any) -> bool:
    """Whether a Textual ``DataTable`` still has rows or cell changes to measure (it does so when its message
    pump is idle; Textual 8's private flags)."""
    return bool(getattr(table, "_require_update_dimensions", False) or getattr(table, "_updated_cells", None))


def painted_text(app: Any) -> str:
    """The screen as last painted, as plain text: what ``export_screenshot`` renders (the compositor's last
    update of every screen shown), without the SVG."""
    width, height = app.size
    console = Console(
        width=width, height=height, file=io.StringIO(), record=True, legacy_windows=False, safe_box=False
    )
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def until_painted(pilot: Pilot[Any], widget: Widget, lines: int, rounds: int = 500) -> None:
    """Pause until the screen as painted holds the first ``lines`` lines the widget renders now (laid out: a
    ``DataTable`` measures new rows when idle): a widget's new content reaches the screen on a later refresh, and
    a screen a dialog then covers keeps the paint it had — a snapshot of the dialog caught the variant matrix below
    it still painted as before its rows came, on a loaded CI machine. Fails, with the paint, if it never comes."""
    painted = ""
    for _ in range(rounds):
        await pilot.pause(0.01)
        if layout_pending(widget):
            continue
        wanted = [widget.render_line(y).text.strip() for y in range(lines)]
        painted = painted_text(pilot.app)
        if all(line and line in painted for line in wanted):
            return
    raise AssertionError(f"{widget!r} was not painted as it renders now; the screen:\n{painted}")


class Notes:
    """Records the app's notifications (the real ``notify`` still runs)."""

    def __init__(self, app: MoereplayApp) -> None:
        self.messages: list[str] = []
        original = app.notify

        def notify(message: str, **options: Any) -> None:
            self.messages.append(message)
            original(message, **options)

        app.notify = notify  # type: ignore[method-assign]

    def __contains__(self, text: str) -> bool:
        return any(text in message for message in self.messages)
