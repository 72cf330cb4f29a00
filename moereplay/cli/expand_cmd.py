"""``moereplay expand``: re-run recorded MoE layer calls with the real vLLM function under a capture, so their
kernel calls are recorded (a layer-scope flight record keeps the layer calls only).

A thin front over :func:`moereplay.replay.expand.expand_capture`. Exit status: 0 when every re-run ran (bit-exact
or not: a difference is a finding), 1 when a re-run raised, 2 for a bad file, call or option (one line on stderr,
from ``moereplay.cli.main``). One line per call on stdout; ``--json-out FILE`` writes the report as JSON too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moereplay.cli import app
from moereplay.wording import plural


@app.command("expand")
def expand_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Capture file to write.", show_default=False)
    ],
    call: Annotated[
        list[int] | None,
        typer.Option("--call", help="Layer call to expand (repeatable; default: every layer call)."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="vllm | pack:DIR | auto (the kernel pack $MOEREPLAY_PACK when set, else the installed vLLM).",
        ),
    ] = "auto",
    device: Annotated[str, typer.Option("--device", help="Device the layer calls run on.")] = "cuda",
    json_out: Annotated[
        Path | None, typer.Option("--json-out", help="Also write the report as JSON to this file.")
    ] = None,
) -> None:
    """Re-run recorded MoE layer calls (fused_marlin_moe, triton_kernel_fused_experts …) with the real vLLM
    function under a capture: OUT holds each re-run layer call and its kernel calls; each line says whether the
    re-run is bit-exact with the recorded output."""
    from moereplay.errors import SettingsError
    from moereplay.replay.expand import expand_capture

    if not file.exists():
        raise SettingsError(f"{file}: no such file")
    if json_out is not None and not json_out.parent.is_dir():
        raise SettingsError(f"--json-out {json_out}: no such directory {json_out.parent}")
    report = expand_capture(file, output, calls=call, backend=backend, device=device)
    for note in report.notes:
        print(f"note: {note}")
    for line in report.lines():
        print(line)
    size = report.file_bytes
    shown = f"{size / 1e6:,.2f} MB" if size >= 100_000 else f"{size:,} B"
    print(
        f"{report.output}: {plural(report.output_calls, 'call')}, {shown} (backend {report.backend} on {report.device})"
    )
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
        except OSError as error:
            raise SettingsError(f"--json-out {json_out}: {error.strerror or error}") from error
    raise typer.Exit(1 if report.raised else 0)
