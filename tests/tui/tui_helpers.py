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


async def settle(pilot: Pilot[Any], rounds: int = 6) -> None:
    """Wait until no worker runs (a worker finishing may start another: wait a few rounds)."""
    for _ in range(rounds):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
        if not any(worker.is_running for worker in pilot.app.workers):
            return


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
