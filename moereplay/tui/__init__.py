"""The Textual front end: ``moereplay tui FILE`` and the interactive side of ``moereplay bisect``.

The app renders what the headless core computes — the capture reader (``format``), the replay engine (``replay``),
the bisect engine (``bisect``) — and holds no kernel or file-format logic of its own. Layout:

- ``app.py`` the app and ``app.tcss`` its styles; ``bindings.py`` every key binding as data (ids, descriptions);
- ``screens/``: ``browser`` (the calls), ``call`` (one call: arguments, variants, diff, heat map, findings),
  ``bisect`` (a session), ``help``, ``dialogs``;
- ``widgets/<area>/``: the widgets of each screen;
- view models the widgets draw: ``catalog`` (lazy call rows), ``filters``, ``arguments`` (the argument tree and
  contract check), ``replays`` (requests to the engine, reports and tensors back), ``error_grid`` (element errors
  and the heat map's grid), ``bisect_sessions``, ``repro``.

Importing this package is cheap; Textual and the rest load when a function below runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moereplay.bisect.session import Session


def run_tui(path: str | Path, *, backend: str = "auto") -> None:
    """Browse ``path`` (blocking until the user quits). A bad file raises ``CaptureFileError`` before the screen
    changes."""
    from moereplay.tui.app import MoereplayApp

    MoereplayApp.for_capture(path, backend=backend).run()


def run_bisect_session(
    session: Session[Any, Any], description: str, *, capture: Path | None = None, call: int | None = None
) -> None:
    """Drive an open bisect session interactively (what ``moereplay bisect`` does on a terminal)."""
    from moereplay.tui.app import MoereplayApp
    from moereplay.tui.bisect_sessions import BisectLaunch

    launch = BisectLaunch(session, description, capture, call, len(session.steps))
    MoereplayApp(bisect=launch).run()


__all__ = ["run_bisect_session", "run_tui"]
