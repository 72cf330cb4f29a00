"""``moereplay tui FILE``: browse a capture, replay calls with mutations, bisect — in the terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moereplay.cli import app


@app.command("tui")
def tui_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="Where replays run: auto, reference, vllm or pack:DIR (as `moereplay run`).",
        ),
    ] = "auto",
) -> None:
    """Browse a capture's calls; replay, diff and bisect them interactively (Textual; ? lists the keys)."""
    from moereplay.tui import run_tui

    if (
        backend.strip() != "auto"
    ):  # auto is always well formed; resolving it here would import torch (CUDA probe)
        from moereplay.replay.backends import parse_backend

        parse_backend(backend)  # a malformed --backend is one line and exit 2, before the screen changes
    run_tui(file, backend=backend)
