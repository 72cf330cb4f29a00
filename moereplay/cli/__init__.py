"""Command-line interface: thin typer commands over typed core functions.

Each command module registers its commands on ``app``. Heavy imports (torch, textual) happen inside
commands, never at import time. Every ``MoereplayError`` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
import typer.core

from moereplay.errors import MoereplayError


def _flags_without_a_type() -> None:
    """Help lists a flag as ``--json`` alone, not ``--json <bool>``: typer ≥ 0.20 prints every option's Python type in
    the help's type column, a flag's too — and a flag takes no value. Patched once, on the option class typer builds."""
    option = typer.core.TyperOption
    if not hasattr(option, "display_type_rich") or getattr(option.display_type_rich, "_moereplay", False):
        return
    shown = option.display_type_rich

    def display_type_rich(self: typer.core.TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and not self.count else shown(self, ctx)

    display_type_rich._moereplay = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_a_type()

app = typer.Typer(
    name="moereplay",
    help="Capture-and-replay debugger for the MoE GPU kernels inside vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Capture-and-replay debugger for the MoE GPU kernels inside vLLM."""


@app.command("version")
def version_command() -> None:
    """Print moereplay's version."""
    from moereplay import __version__

    print(__version__)


# Command modules register themselves on ``app`` when imported.
def note_damage(file: Any) -> None:
    """Say on stderr, in one line, that capture ``file`` is damaged or cut — before any other message of a command
    and before any tensor is rebuilt (tens of seconds for a large call). An unreadable file is left to the
    command's own error."""
    from moereplay.format import CaptureReader
    from moereplay.format.text import printable

    try:
        with CaptureReader(file) as reader:
            if not reader.recovery.complete:
                print(f"moereplay: note: {file}: {printable(reader.recovery.message)}", file=sys.stderr)
    except MoereplayError:
        return


from moereplay.cli import bisect_cmd as _bisect_cmd  # noqa: E402,F401
from moereplay.cli import expand_cmd as _expand_cmd  # noqa: E402,F401
from moereplay.cli import inspect_cmds as _inspect_cmds  # noqa: E402,F401
from moereplay.cli import pack_cmds as _pack_cmds  # noqa: E402,F401
from moereplay.cli import ranks_cmd as _ranks_cmd  # noqa: E402,F401
from moereplay.cli import run_cmd as _run_cmd  # noqa: E402,F401
from moereplay.cli import share_cmds as _share_cmds  # noqa: E402,F401
from moereplay.cli import tui_cmd as _tui_cmd  # noqa: E402,F401


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``moereplay`` console script."""
    try:
        app(args=argv, prog_name="moereplay")
    except MoereplayError as error:
        from moereplay.format.text import printable  # messages quote file text: one line, no terminal control

        print(f"moereplay: {printable(error)}", file=sys.stderr)
        sys.exit(2)
