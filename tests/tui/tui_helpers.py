"""Helpers for driving the app in tests."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from textual.pilot import Pilot

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


async def until_painted(pilot: Pilot[Any], texts: tuple[str, ...] = (), rounds: int = 100) -> None:
    """Pause until the screen as painted shows every one of ``texts`` and two paints a moment apart are the same:
    a widget's new content reaches the screen on a later refresh, and a screen a dialog then covers keeps the paint
    it had (a snapshot of the dialog caught the table below it half laid out on a loaded CI machine)."""
    before = None
    for _ in range(rounds):
        await pilot.pause(0.02)
        shot = pilot.app.export_screenshot()
        if shot == before and all(text in shot for text in texts):
            return
        before = shot


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
