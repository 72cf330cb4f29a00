"""``moereplay ranks ls`` and ``moereplay ranks check``: several ranks' capture files of one TP / EP run.

``ranks ls`` lines up the same logical call across the files (same forward step, layer, op and occurrence) with one
column per rank holding that rank's call index; ``ranks check`` recombines each layer call's per-rank outputs (their
sum: vLLM all-reduces after the layer) and judges them against the single-GPU fp64 reference, after checking that
the replicated inputs agree and (EP) that every expert lives on exactly one rank. See :mod:`moereplay.replay.ranks`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from moereplay.cli import app

ranks_app = typer.Typer(
    help="Several ranks' capture files of one tensor- / expert-parallel run.", no_args_is_help=True
)
app.add_typer(ranks_app, name="ranks")

_FILES = typer.Argument(..., help="One capture file per rank (.zst).", show_default=False)


@ranks_app.command("ls")
def ranks_ls_command(
    files: Annotated[list[Path], _FILES],
    op: Annotated[str | None, typer.Option("--op", help="Only ops matching this glob.")] = None,
    layer: Annotated[str | None, typer.Option("--layer", help="Only calls of MoE layer L.")] = None,
    step: Annotated[int | None, typer.Option("--step", help="Only calls of forward step N.")] = None,
    rank: Annotated[int | None, typer.Option("--rank", help="Only calls rank R recorded.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """The same call on every rank side by side: step, layer, op, and each rank's call index."""
    from moereplay.replay.ranks import merge_calls

    rows = merge_calls(files, op=op, layer=layer, step=step, rank=rank)
    if json_output:
        sys.stdout.write(json.dumps([row.to_json() for row in rows]) + "\n")
        return
    ranks = sorted({call.rank for row in rows for call in row.calls})
    columns = ["step", "layer", "op", *(f"rank{r}" for r in ranks)]
    table = []
    for row in rows:
        index = {call.rank: call for call in row.calls}
        cells = [
            "-" if row.step is None else str(row.step),
            row.layer_name or ("-" if row.layer is None else str(row.layer)),
            row.op,
        ]
        for r in ranks:
            call = index.get(r)
            cells.append(
                "-"
                if call is None
                else f"#{call.index}" + ("" if call.status == "completed" else f" {call.status}")
            )
        table.append(cells)
    widths = [max([len(columns[k]), *(len(line[k]) for line in table)]) for k in range(len(columns))]
    for line in [columns, *table]:
        sys.stdout.write("  ".join(cell.ljust(widths[k]) for k, cell in enumerate(line)).rstrip() + "\n")


@ranks_app.command("check")
def ranks_check_command(
    files: Annotated[list[Path], _FILES],
    op: Annotated[str | None, typer.Option("--op", help="Only layer ops matching this glob.")] = None,
    layer: Annotated[str | None, typer.Option("--layer", help="Only calls of MoE layer L.")] = None,
    step: Annotated[int | None, typer.Option("--step", help="Only calls of forward step N.")] = None,
    mode: Annotated[
        str, typer.Option("--mode", help="auto (from the recorded context / expert map) | tp | ep.")
    ] = "auto",
    device: Annotated[
        str | None,
        typer.Option(
            "--device", help="Where the float64 references run: cpu, cuda, cuda:N (default: a GPU if any)."
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Recombine each layer call across ranks and judge it against the single-GPU reference. Exit 1 if any fails."""
    from moereplay.replay.ranks import check_ranks

    results = check_ranks(files, op=op, layer=layer, step=step, mode=mode, device=device)
    failed = not all(result.ok for result in results)
    if json_output:
        sys.stdout.write(json.dumps({"failed": failed, "calls": [r.to_json() for r in results]}) + "\n")
    else:
        for result in results:
            row = result.merged
            name = row.layer_name or row.layer
            combined = result.combined
            verdict = "ok" if result.ok else "FAILED"
            sys.stdout.write(
                f"step {row.step} layer {name} {row.op} [{result.mode.value} × {len(row.calls)}] {verdict}: "
                f"combined {combined.describe()}\n"
            )
            for rank, partial in result.partials.items():
                status = "ok" if partial.ok else partial.describe()
                sys.stdout.write(
                    f"  rank {rank} (call #{dict((c.rank, c.index) for c in row.calls)[rank]}): {status}\n"
                )
            for problem in result.problems:
                sys.stdout.write(f"  problem: {problem}\n")
    raise typer.Exit(1 if failed else 0)
