"""``moereplay info`` and ``moereplay ls``: look inside a capture file.

Both read call records only (never tensor bytes). Results go to stdout (``--json``: one JSON document);
notes about a damaged file go to stderr; errors (``MoereplayError``) reach ``moereplay.cli.main``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from moereplay.capture import phase_timers
from moereplay.cli import app
from moereplay.wording import plural

if TYPE_CHECKING:
    from moereplay.format.records import DamagedCall
    from moereplay.format.summary import CallRow, CaptureInfo

_FILE = typer.Argument(..., help="A capture file (.zst).", show_default=False)
_JSON = typer.Option(False, "--json", help="Print one JSON document instead of text.")
DAMAGED_SHOWN = 5
"""Damaged calls ``info`` names one by one."""


def _print_json(document: Any, *, indent: int | None = 2) -> None:
    sys.stdout.write(json.dumps(document, indent=indent, allow_nan=False) + "\n")


@app.command("info")
def info_command(file: Path = _FILE, json_output: bool = _JSON) -> None:
    """Header, counts per op and status, sizes, dedup ratio and completeness of a capture file."""
    from moereplay.format.summary import capture_info

    info = capture_info(file)
    if json_output:
        _print_json(info.to_json())
    else:
        _render_info(info)


@app.command("ls")
def ls_command(
    file: Path = _FILE,
    op: str | None = typer.Option(None, "--op", help="Only ops matching this glob (e.g. 'moe_*')."),
    layer: str | None = typer.Option(
        None, "--layer", help="Only calls of MoE layer L (its index, or a glob over vLLM's layer name)."
    ),
    status: str | None = typer.Option(
        None, "--status", help="Only calls with this status: inputs_saved, completed or failed."
    ),
    step: int | None = typer.Option(None, "--step", help="Only calls of forward step N."),
    rank: int | None = typer.Option(
        None, "--rank", help="Only calls of world rank R (see `moereplay ranks ls` for several ranks' files)."
    ),
    json_output: bool = _JSON,
) -> None:
    """One line per call: index, op, call site, forward step, layer, parent call, status, key tensors."""
    from moereplay.errors import SettingsError
    from moereplay.format.records import CALL_STATUSES
    from moereplay.format.summary import list_calls

    if status is not None and status not in CALL_STATUSES:
        raise SettingsError(f"--status must be one of {', '.join(CALL_STATUSES)}, not {status!r}")
    from moereplay.format.records import DamagedCall
    from moereplay.format.text import printable

    recovery, rows = list_calls(file, op=op, layer=layer, status=status, step=step)
    if rank is not None:
        from moereplay.replay.ranks import rows_of_rank

        rows = rows_of_rank(file, rows, rank)
    if not recovery.complete:
        print(f"moereplay: note: {file}: {printable(recovery.message)}", file=sys.stderr)
    if json_output:
        _print_json(
            [
                {"index": row.index, "damaged": row.problem}
                if isinstance(row, DamagedCall)
                else row.to_json()
                for row in rows
            ],
            indent=None,
        )
    else:
        _render_rows(rows)


def _render_rows(rows: list[CallRow | DamagedCall]) -> None:
    """A plain text table; every cell taken from the file goes through ``printable`` (no terminal control)."""
    from moereplay.format.records import DamagedCall
    from moereplay.format.text import printable

    columns = ["#", "op", "site", "step", "layer", "parent", "status", "tensors"]
    table = [
        [str(row.index), "?", "-", "-", "-", "-", "damaged", printable(row.problem)]
        if isinstance(row, DamagedCall)
        else [
            str(row.index),
            printable(row.op),
            printable(row.site) or "-",
            printable(_step_text(row)),
            printable(_layer_text(row)),
            _text(row.parent),
            row.status,
            printable(row.key_tensors()),
        ]
        for row in rows
    ]
    widths = [max([len(columns[k]), *(len(line[k]) for line in table)]) for k in range(len(columns) - 1)]
    out = sys.stdout
    for line in [columns, *table]:
        cells = [line[0].rjust(widths[0])] + [line[k].ljust(widths[k]) for k in range(1, len(widths))]
        out.write("  ".join([*cells, line[-1]]).rstrip() + "\n")


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _step_text(row: CallRow) -> str:
    """The forward step; for a layer call kept from a CUDA-graph replay (no host step) ``g`` and the replays of
    the graph's first MoE layer so far (its ``graph_step``)."""
    step = row.context.get("step")
    if step is None and isinstance(row.context.get("graph_step"), int):
        return f"g{row.context['graph_step']}"
    return _text(step)


def _layer_text(row: CallRow) -> str:
    """vLLM's layer name when recorded (``model.layers.3.mlp.experts``), else the layer index."""
    name = row.context.get("layer_name")
    return name if isinstance(name, str) and name else _text(row.layer)


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB" if count >= 100_000 else f"{count:,} B"


def _render_info(info: CaptureInfo) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from moereplay.format.text import printable

    header, stats, recovery = info.header, info.stats, info.recovery
    versions: dict[str, Any] = header["versions"] if isinstance(header.get("versions"), dict) else {}
    gpu: dict[str, Any] | None = header["gpu"] if isinstance(header.get("gpu"), dict) else None
    lines: list[tuple[str, str]] = [
        ("file", f"{info.path} ({_megabytes(stats.file_bytes)})"),
        (
            "format",
            f"{'.'.join(str(part) for part in header.get('format_version', []))}, created {header.get('created', '?')}",
        ),
        ("versions", " · ".join(_version_text(name, value) for name, value in versions.items())),
    ]
    if gpu and gpu.get("name"):
        when = " — read when the file was closed (CUDA was not initialised at its start)"
        when = when if gpu.get("read_at_close") else ""
        lines.append(
            ("gpu", f"{gpu['name']} (cc {gpu.get('compute_capability')}, {gpu.get('sm_count')} SMs){when}")
        )
    elif gpu:
        lines.append(("gpu", f"{gpu.get('count')} device(s), CUDA not initialised when recorded"))
    else:
        lines.append(("gpu", "none"))
    rank = header.get("rank") or {}
    lines.append(
        (
            "host",
            f"{header.get('host', '?')} pid {header.get('pid', '?')}" + (f" rank {rank}" if rank else ""),
        )
    )
    argv = header.get("argv")
    if isinstance(argv, list) and argv:
        lines.append(("command", " ".join(str(part) for part in argv)))
    lines.append(("status", recovery.message))
    by_status = ", ".join(f"{count} {name}" for name, count in stats.by_status.items()) or "none"
    if stats.damaged:
        by_status += f"; {len(stats.damaged)} damaged"
    lines.append(("calls", f"{stats.calls} ({by_status})"))
    for index, problem in list(stats.damaged.items())[:DAMAGED_SHOWN]:
        lines.append(
            ("damaged", f"call {index}: {problem}")
        )  # problem: the reader's message, without the call
    if len(stats.damaged) > DAMAGED_SHOWN:
        lines.append(
            ("damaged", f"… and {len(stats.damaged) - DAMAGED_SHOWN} more (moereplay ls lists them)")
        )
    lines.append(
        (
            "tensors",
            f"{stats.blobs} unique blobs, {_megabytes(stats.unique_blob_bytes)} stored for "
            f"{_megabytes(stats.referenced_blob_bytes)} referenced (dedup ×{stats.dedup_ratio:.1f}); "
            f"{_megabytes(stats.tensor_bytes)} of tensor elements"
            + (
                f" stored, {_megabytes(stats.expanded_bytes)} expanded (recipes regenerate the rest)"
                if stats.expanded_bytes > stats.tensor_bytes
                else ""
            ),
        )
    )
    if stats.largest_call is not None:
        which = "call" if stats.calls == 1 else "largest call"
        lines.append(
            (
                "replay",
                f"{which} (#{stats.largest_call}) holds {_megabytes(stats.largest_call_bytes)} of arguments and "
                "outputs in memory; a replay needs at least that, plus fresh buffers per variant, the reference's "
                "working set and, the first time a recipe is expanded, its generator's draw",
            )
        )
    if stats.counters:
        lines.append(("counters", ", ".join(f"{name}={value}" for name, value in stats.counters.items())))
        cost = recorder_cost(stats.counters)
        if cost:
            lines.append(("cost", cost))
        timers = recorder_timers(stats.counters)
        if timers:
            lines.append(("timers", timers))
    console = Console(highlight=False, soft_wrap=True, emoji=False)
    for (
        name,
        value,
    ) in lines:  # file text is printed as Text: never parsed as markup, control characters escaped
        console.print(Text.assemble((f"{name:<9}", "bold"), " ", printable(value)))
    if stats.by_op:
        statuses = list(stats.by_status)
        table = Table(title=None, show_edge=False, pad_edge=False)
        table.add_column("op")
        for status in statuses:
            table.add_column(status, justify="right")
        table.add_column("total", justify="right")
        for op, counts in stats.by_op.items():
            table.add_row(
                Text(printable(op)),
                *(str(counts.get(status, 0)) for status in statuses),
                str(sum(counts.values())),
            )
        console.print(table)


def _version_text(name: str, value: Any) -> str:
    """One ``versions`` entry. An empty value means the library was absent when recording (``triton —`` on a CPU
    machine) — except moereplay's own, which early writers left empty when run from a source tree."""
    if value:
        return f"{name} {value}"
    return f"{name} (not recorded)" if name == "moereplay" else f"{name} —"


def recorder_cost(counters: Mapping[str, int]) -> str | None:
    """The flight recorder's own time, from a file's footer counters: serving-thread µs per recorded layer call
    (layer scope; its rings' one-time set-up, which ran inside the first calls, apart) and writer-thread µs per
    check poll — what leaving it armed cost that process (None when the footer has neither)."""
    parts = []
    seen = counters.get("recorder_seen", 0)  # the time counts every outermost call, filtered out or recorded
    if counters.get("recorder_host_ns") and seen:
        # the rings' one-time set-up (buffers, each ring-kernel variant's compile) ran inside the first calls
        setup = min(counters.get("flight_setup_ns", 0), counters["recorder_host_ns"])
        parts.append(
            f"recorder {(counters['recorder_host_ns'] - setup) / seen / 1e3:.1f} µs of serving-thread time per "
            f"layer call ({plural(seen, 'call')})"
            + (f" plus {setup / 1e6:.1f} ms once (eager ring buffers, ring-kernel compiles)" if setup else "")
        )
    polls = counters.get("flight_polls", 0)
    if polls:
        longest = counters.get("flight_poll_max_ns", 0)
        parts.append(
            f"writer {counters.get('flight_poll_ns', 0) / polls / 1e3:.1f} µs per flight poll ({polls} polls, "
            f"{counters.get('flight_poll_ns', 0) / 1e9:.2f} s"
            + (f"; the longest {longest / 1e6:.2f} ms" if longest else "")
            + ")"
        )
    return "; ".join(parts) or None


def recorder_timers(counters: Mapping[str, int]) -> str | None:
    """``MOEREPLAY_TIMERS``' pieces from a footer: µs per call of each (wall; CPU beside it where read), or None."""
    pieces = phase_timers.from_counters(counters)
    if not pieces:
        return None
    parts = []
    for piece, (ns, calls, cpu) in pieces.items():
        if not calls:
            continue
        text = f"{piece} {ns / calls / 1e3:.1f}"
        if cpu is not None:
            text += f" (CPU {cpu / calls / 1e3:.1f})"
        parts.append(f"{text} ×{calls}")
    return "µs per call: " + ", ".join(parts) if parts else None
