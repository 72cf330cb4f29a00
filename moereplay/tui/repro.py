"""The "export repro" action of the TUI: hands a call to :func:`moereplay.repro.export_repro`.

The export is blocking (it bundles moereplay's modules and trims the capture), so screens run it in a worker.
A failure the exporter names (a bad capture, a call it cannot export) comes back as :class:`ReproUnavailable`,
whose one-line reason the screen shows in a notification.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moereplay.errors import MoereplayError


@dataclass(frozen=True)
class ReproUnavailable:
    """Why no repro could be exported (one line for a notification)."""

    reason: str


def default_repro_dir(capture: Path, call: int) -> Path:
    """Where the TUI writes the repro: beside the capture, ``<capture>.repro-call<N>/`` (replaced on re-export)."""
    return capture.with_name(f"{capture.name}.repro-call{call}")


def export_repro(capture: Path, call: int) -> Path | ReproUnavailable:
    """Export the repro of call ``call`` beside the capture; its directory, or why it could not be written."""
    from moereplay.repro import export_repro as export

    try:
        bundle = export(capture, call, default_repro_dir(capture, call), overwrite=True)
    except MoereplayError as error:
        return ReproUnavailable(f"repro export failed: {error}")
    return bundle.directory
