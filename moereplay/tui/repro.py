"""The "export repro" action of the TUI: hands a call to :func:`moereplay.repro.export_repro`.

The export is blocking (it bundles moereplay's modules and trims the capture), so screens run it in a worker.
A failure the exporter names (a bad capture, a call it cannot export) comes back as :class:`ReproUnavailable`,
whose one-line reason the screen shows in a notification.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moereplay.bisect.log import capture_key, state_directory
from moereplay.errors import MoereplayError


@dataclass(frozen=True)
class ReproUnavailable:
    """Why no repro could be exported (one line for a notification)."""

    reason: str


def default_repro_dir(capture: Path, call: int, environ: Mapping[str, str] | None = None) -> Path:
    """Where the TUI writes the repro: in the state directory, as bisect logs, never beside the capture (a bundled
    or shared capture's folder is not the user's to write in) — ``$MOEREPLAY_STATE_DIR/repro/``, else
    ``./moereplay-captures/repro/``, then ``<capture name>-<8 hex>.repro-call<N>/`` (replaced on re-export)."""
    return repro_root(environ) / f"{capture_key(capture)}.repro-call{call}"


def repro_root(environ: Mapping[str, str] | None = None) -> Path:
    """The folder the TUI's repros go to: ``repro/`` in the state directory (read at call time)."""
    return state_directory(environ) / "repro"


def export_repro(capture: Path, call: int) -> Path | ReproUnavailable:
    """Export the repro of call ``call`` to :func:`default_repro_dir`; its directory, or why it could not be written."""
    from moereplay.repro import export_repro as export

    try:
        bundle = export(capture, call, default_repro_dir(capture, call), overwrite=True)
    except MoereplayError as error:
        return ReproUnavailable(f"repro export failed: {error}")
    return bundle.directory
