"""``moereplay run``: replay captured calls as-is and with mutations, print one verdict table and the findings.

A thin front over :func:`moereplay.replay.replay`. Every call's table starts with its ``recorded`` row (the captured
output judged against the reference) and its ``baseline`` (the replay; ``needs-kernel`` offline), and says the call's
headline verdict: the worse of the two, and which. Evidence is followed by default: a contract violation that
predicts reads past a tensor's end runs the guard fills that test it (``--no-follow`` skips them), and a call whose
output changes with them is ``memory-dependent``. Exit status: 0 when every selected call's headline and every
judged variant is ``ok``, 1 when anything is not (``memory-dependent``, ``corrupt``, ``nonfinite``, ``crash`` or
``invalid``; a ``needs-kernel`` variant counts neither way), 2 for usage and file errors (one line on stderr, from
``moereplay.cli.main``). Results go to stdout: a rich table for people, one JSON document
with ``--json``; ``--json-out FILE`` writes that document to a file as well (a script can keep both).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from moereplay.cli import app, note_damage

if TYPE_CHECKING:
    from moereplay.replay.results import ReplayReport

_VERDICT_STYLE = {
    "ok": "green",
    "memory-dependent": "bold dark_orange",
    "corrupt": "bold red",
    "nonfinite": "bold magenta",
    "crash": "bold red reverse",
    "invalid": "yellow",
    "needs-kernel": "dim",
}


@app.command("run")
def run_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    call: Annotated[
        list[int] | None, typer.Option("--call", help="Replay call N (repeatable; see `moereplay ls`).")
    ] = None,
    op: Annotated[
        str | None, typer.Option("--op", help="Replay every call of ops matching this glob.")
    ] = None,
    layer: Annotated[str | None, typer.Option("--layer", help="Replay every call of layer L.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Replay every replayable call.")] = False,
    flip: Annotated[
        list[str] | None, typer.Option("--flip", help="Variant negating a flag; A+B flips both.")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Variant setting ARG=V (A=1+B=2 sets both).")
    ] = None,
    cast: Annotated[
        list[str] | None, typer.Option("--cast", help="Variant converting a tensor: ARG=DTYPE.")
    ] = None,
    fill: Annotated[
        list[str] | None,
        typer.Option("--fill", help="Variant with guard bands filled: 0xff, 0xfe, 0x00, nan."),
    ] = None,
    sweep: Annotated[
        list[str] | None, typer.Option("--sweep", help="One variant per value: ARG=v1,v2[+B=w1,w2] (zipped).")
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="vllm | pack:DIR | reference | python:MODULE | auto (auto: the kernel pack $MOEREPLAY_PACK when "
            "set, else the installed vLLM, else the reference; the reference without CUDA).",
        ),
    ] = "auto",
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Run every variant N times.")] = 1,
    sanitize: Annotated[
        bool, typer.Option("--sanitize", help="Also run the baseline under compute-sanitizer.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow-suggestions", help="Also run the mutations the findings suggest.")
    ] = False,
    no_follow: Annotated[
        bool,
        typer.Option(
            "--no-follow",
            help="Do not run, unasked, the guard fills (0xff, 0x00) that test a contract violation predicting "
            "reads past a tensor's end.",
        ),
    ] = False,
    device: Annotated[
        str | None, typer.Option("--device", help="Device for kernels and the reference.")
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds before a variant counts as a crash.")
    ] = 600.0,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document instead of tables.")
    ] = False,
    json_out: Annotated[
        Path | None,
        typer.Option("--json-out", help="Also write the JSON document to this file (tables still print)."),
    ] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Fan calls × variants out to Ray workers (a local cluster unless --ray-address). Needs the ray extra: pip install 'moereplay\\[ray]'.",
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address", help="The Ray cluster to join with --ray: 'auto', 'ray://host:10001', …"
        ),
    ] = None,
    ray_gpus: Annotated[
        float | None,
        typer.Option(
            "--ray-gpus",
            min=0.0,
            help="GPUs per Ray task (a fraction shares one); default 1 for CUDA backends, else 0.",
        ),
    ] = None,
) -> None:
    """Replay captured calls (baseline and variants); print verdicts and findings. Exit 1 if anything failed."""
    from moereplay.errors import SettingsError
    from moereplay.replay import mutation_names

    selectors = sum(value is not None for value in (op, layer)) + int(bool(call)) + int(every)
    if selectors > 1:
        raise SettingsError("choose one of --call, --op, --layer, --all")
    if not file.exists():
        raise SettingsError(f"{file}: no such file")
    if json_out is not None and not json_out.parent.is_dir():
        raise SettingsError(f"--json-out {json_out}: no such directory {json_out.parent}")
    mutations = (
        [f"flip {text}" for text in flip or ()]
        + [f"set {text}" for text in set_ or ()]
        + [f"cast {text}" for text in cast or ()]
        + [f"sweep {text}" for text in sweep or ()]
        + [f"fill {text}" for text in fill or ()]
    )
    if ray_address is not None and not ray:
        raise SettingsError("--ray-address needs --ray")
    note_damage(file)
    # a mistyped name fails here, before torch is imported
    mutation_names.check_file(file, mutations, call)

    from moereplay.replay.engine import check_mutations, replay
    from moereplay.replay.source import select_calls

    indices = select_calls(file, call=call, op=op, layer=layer, every=every)
    check_mutations(file, indices, mutations)  # against the ops' schemas, before any weight is rebuilt
    indices = _calls_to_judge(file, indices, backend)
    if ray:
        reports = _run_on_ray(
            file, indices, mutations, ray_address, ray_gpus,
            {"backend": backend, "repeat": repeat, "sanitize": sanitize, "device": device, "timeout_s": timeout,
             "follow_suggestions": follow, "follow_evidence": not no_follow},
        )  # fmt: skip
    else:
        reports = [
            replay(
                file,
                call=index,
                mutations=mutations,
                backend=backend,
                repeat=repeat,
                sanitize=sanitize,
                device=device,
                timeout_s=timeout,
                follow_suggestions=follow,
                follow_evidence=not no_follow,
            )
            for index in indices
        ]
    failed = any(report.failed for report in reports)
    document = {"failed": failed, "reports": [report.to_json() for report in reports]}
    text = json.dumps(document, indent=2, default=str) + "\n"
    if json_out is not None:
        try:
            json_out.write_text(text)
        except OSError as error:
            raise SettingsError(f"--json-out {json_out}: {error.strerror or error}") from error
    if json_output:
        sys.stdout.write(text)
    else:
        render_reports(reports)
    raise typer.Exit(1 if failed else 0)


def _run_on_ray(
    file: Path,
    indices: list[int],
    mutations: list[str],
    address: str | None,
    gpus: float | None,
    options: dict[str, Any],
) -> list[ReplayReport]:
    """The sweep on Ray (:mod:`moereplay.replay.ray_sweep`); one progress line per finished unit on stderr."""
    from moereplay.replay.backends import auto_backend, parse_backend
    from moereplay.replay.ray_sweep import SweepUnit, plan_units, sweep
    from moereplay.replay.results import VariantResult

    spec = auto_backend() if options["backend"] == "auto" else parse_backend(options["backend"])
    options = {**options, "backend": spec.text}  # resolved here: every worker runs the same backend
    units = plan_units(file, indices, mutations, options)

    def progress(unit: SweepUnit, row: VariantResult | None, done: int, total: int) -> None:
        verdict = "crash" if row is None else row.verdict.value
        print(f"moereplay: ray {done}/{total} call {unit.call} {unit.label}: {verdict}", file=sys.stderr)

    return sweep(
        units,
        address=address,
        gpus_per_task=(1.0 if spec.needs_cuda else 0.0) if gpus is None else gpus,
        progress=progress,
    )


def _calls_to_judge(file: Path, indices: list[int], backend: str) -> list[int]:
    """Before any tensor is rebuilt: without a kernel backend, leave out the calls whose output the file does not hold —
    offline the recorded output is the only thing judged — saying so at once (every selected call: a one-line
    error)."""
    from moereplay.errors import ReplayError
    from moereplay.format import CaptureReader
    from moereplay.replay.backends import parse_backend

    with CaptureReader(file) as reader:
        statuses = {index: reader.call(index).status for index in indices}
    spec = parse_backend(backend)
    if spec.runs_kernels:
        return indices
    without = [index for index in indices if statuses[index] != "completed"]
    if not without:
        return indices
    named = ", ".join(f"{index} ({statuses[index]})" for index in without[:8]) + (
        f" and {len(without) - 8} more" if len(without) > 8 else ""
    )
    what = f"call{'s' if len(without) > 1 else ''} {named}"
    why = (
        f"no recorded output and the {spec.text} backend runs no kernel: nothing to judge "
        f"(a kernel backend replays {'them' if len(without) > 1 else 'it'}: --backend vllm or pack:DIR)"
    )
    if len(without) == len(indices):
        raise ReplayError(f"{file}: {what}: {why}")
    print(f"moereplay: note: {file}: {what} left out: {why}", file=sys.stderr)
    return [index for index in indices if index not in set(without)]


def _number(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}e}"


def render_reports(reports: list[ReplayReport]) -> None:
    """The verdict table and findings of each report, for people (rich, to stdout)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from moereplay.format.text import printable

    # Everything a report quotes from the capture (op, site, argument names, messages) is printed as Text after
    # ``printable``: never parsed as markup, never a terminal control sequence.
    console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 160)
    for report in reports:
        title = f"call #{report.call} · {report.op}" + (f" · {report.site}" if report.site else "")
        table = Table(
            title=Text(printable(title)),
            caption=Text(printable(f"backend {report.backend} on {report.device}")),
            title_justify="left",
        )
        for column, justify in (
            ("variant", "left"),
            ("verdict", "left"),
            ("bad/rows", "right"),
            ("max rel", "right"),
            ("rms rel", "right"),
            ("max abs", "right"),
            ("NaN", "right"),
            ("Inf", "right"),
            ("bit-exact", "center"),
            ("guard", "center"),
            ("time", "right"),
        ):
            table.add_column(column, justify=justify, no_wrap=column != "variant")  # type: ignore[arg-type]
        for result in report.results:
            verdict = Text(result.verdict.value, style=_VERDICT_STYLE.get(result.verdict.value, ""))
            exact = "-" if result.bit_exact is None else ("yes" if result.bit_exact else "no")
            elapsed = "-" if result.elapsed_s is None else f"{result.elapsed_s * 1e3:.2f} ms"
            table.add_row(
                Text(printable(result.label)),
                verdict,
                f"{result.bad_rows}/{result.rows}" if result.rows else "-",
                _number(result.max_rel),
                _number(result.rms_rel),
                _number(result.max_abs),
                str(result.nan),
                str(result.inf),
                exact,
                Text(printable(result.guard.value)),
                elapsed,
            )
        console.print(table)
        headline = report.headline
        line = Text("  verdict ")
        line.append(headline.verdict.value, style=_VERDICT_STYLE.get(headline.verdict.value, ""))
        line.append(printable(f" ({headline.source})"))
        console.print(line)
        for result in report.results:
            if result.reason:
                console.print(
                    Text(
                        printable(f"  {result.label}: {result.verdict.value} — {result.reason}"),
                        style="yellow",
                    )
                )
        for note in report.notes:  # context (what ran unasked, what could not be done) before the findings
            console.print(Text(printable(f"  note: {note}"), style="dim"))
        if report.findings:
            console.print(Text("findings", style="bold"))
        for finding in report.findings:
            line = Text("  ")
            line.append(f"[{finding.kind.value}]", style="bold cyan")
            line.append(printable(f" ({finding.variant}) ") if finding.variant != "baseline" else " ")
            line.append(printable(finding.message))
            if finding.confidence < 1.0:
                line.append(f"  (confidence {finding.confidence:.2f})", style="dim")
            console.print(line)
            for suggestion in finding.suggestions:
                console.print(Text(printable(f"      try: --{suggestion}"), style="green"))
        console.print()
