"""Starting a bisect session from the TUI: the same request, wiring, log and resume rules as ``moereplay bisect``.

:func:`open_session` is blocking (the wiring opens the capture; a screen calls it from a worker). A log beside the
capture for the same search is resumed unless ``fresh``; the session appends to it as steps are settled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moereplay.bisect.log import default_log_path
from moereplay.bisect.session import Session
from moereplay.bisect.wiring import BisectRequest, Wiring


@dataclass(frozen=True)
class BisectLaunch:
    """A session ready to drive, what it is about, and how many steps came from its log."""

    session: Session[Any, Any]
    description: str
    capture: Path | None = None
    call: int | None = None
    resumed_steps: int = 0


def default_wiring() -> Wiring:
    from moereplay.bisect.replay_wiring import ReplayWiring

    return ReplayWiring()


WiringFactory = Callable[[], Wiring]


def open_session(request: BisectRequest, wiring: Wiring, *, fresh: bool = False) -> BisectLaunch:
    """Prepare ``request`` with ``wiring`` and open (or resume) its session log (in the state directory)."""
    prepared = wiring.prepare(request)
    request = request.with_call(prepared.call)
    log_path = default_log_path(request.capture, request.strategy, request.log_tag)
    if log_path.exists() and not fresh:
        session: Session[Any, Any] = Session.resume(prepared.search, log_path, prepared.predicate)
        resumed = len(session.steps)
    else:
        session = Session(
            prepared.search,
            prepared.predicate,
            log_path=log_path,
            capture=str(request.capture),
            overwrite=fresh,
        )
        resumed = 0
    call = request.call if request.strategy != "calls" else None
    return BisectLaunch(session, prepared.description, request.capture, call, resumed)


def call_to_export(launch: BisectLaunch) -> int | None:
    """The capture call a finished session points at: the first bad call (``calls``), else the bisected call."""
    session = launch.session
    if session.search.kind == "calls":
        if not session.done:
            return None
        result = session.search.result
        first_bad = getattr(result, "first_bad", None)
        items = getattr(session.search, "items", ())
        if first_bad is None or not 0 <= first_bad < len(items):
            return None
        return getattr(items[first_bad], "index", None)
    return launch.call


def capture_of(launch: BisectLaunch) -> Path | None:
    """The capture a session is about: the launch's, else the one its log header names."""
    if launch.capture is not None:
        return launch.capture
    log_path = launch.session.log_path
    if log_path is None:
        return None
    from moereplay.bisect.log import read_log

    named = read_log(log_path).header.get("capture")
    return Path(named) if isinstance(named, str) else None
