"""The "export repro" action of the TUI: hands a call to ``moereplay.repro`` when this moereplay has it.

The exporter is looked up, not imported at module level: until ``moereplay.repro`` exists (issue 7) the action
answers :class:`ReproUnavailable` and the screen says so in a notification.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXPORTER_NAMES = ("export_repro", "export")
"""Callables of ``moereplay.repro`` tried in order: ``(capture, call, out_dir) -> Path``."""


@dataclass(frozen=True)
class ReproUnavailable:
    """Why no repro can be exported (one line for a notification)."""

    reason: str


def find_exporter() -> Callable[..., Any] | ReproUnavailable:
    if importlib.util.find_spec("moereplay.repro") is None:
        return ReproUnavailable("repro export is not available yet: this moereplay has no moereplay.repro")
    module = importlib.import_module("moereplay.repro")
    for name in EXPORTER_NAMES:
        exporter = getattr(module, name, None)
        if callable(exporter):
            return exporter
    return ReproUnavailable("repro export is not available yet: moereplay.repro has no export function")


def default_repro_dir(capture: Path, call: int) -> Path:
    """Where the TUI asks for the repro: beside the capture, ``<capture>.repro-call<N>/``."""
    return capture.with_name(f"{capture.name}.repro-call{call}")


def export_repro(capture: Path, call: int) -> Path | ReproUnavailable:
    """Export the repro of call ``call`` beside the capture (blocking); its directory, or why it cannot."""
    exporter = find_exporter()
    if isinstance(exporter, ReproUnavailable):
        return exporter
    out = default_repro_dir(capture, call)
    result = exporter(capture, call, out)
    return Path(result) if isinstance(result, (str, Path)) else out
