"""``moereplay synth``, ``repro``, ``trim`` and ``layout``: make captures without a model, export one call as a
standalone repro, cut a capture down to chosen calls, and audit the gate/up layout of a fused MoE layer.

Thin fronts over :func:`moereplay.synth.synthesize`, :func:`moereplay.repro.export_repro`,
:func:`moereplay.trim.trim_capture` and :func:`moereplay.layout.probe_layout`. Results go to stdout (``--json``
where a machine may read them); errors are ``MoereplayError`` s, one line and exit 2 via ``moereplay.cli.main``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from moereplay.cli import app
from moereplay.wording import plural

if TYPE_CHECKING:
    from moereplay.layout import LayoutReport


def _command_line() -> str:
    """The command as typed (for provenance), program name normalised to ``moereplay``."""
    return shlex.join(["moereplay", *sys.argv[1:]])


def _bytes(count: int) -> str:
    return f"{count / 1e6:,.2f} MB" if count >= 100_000 else f"{count:,} B"


@app.command("synth")
def synth_command(
    preset: Annotated[str, typer.Argument(help="A preset name (see --list).", show_default=False)] = "",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Capture file to write.")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a preset setting: name=value (repeatable).")
    ] = None,
    bias: Annotated[
        bool | None, typer.Option("--bias/--no-bias", help="Expert biases (default: the preset's).")
    ] = None,
    store: Annotated[
        str, typer.Option("--store", help="bytes | recipe: drawn tensors as bytes, or as seeded recipes.")
    ] = "recipe",
    backend: Annotated[
        str, typer.Option("--backend", help="reference | vllm | pack:DIR: who computes the recorded outputs.")
    ] = "reference",
    device: Annotated[
        str | None, typer.Option("--device", help="Device (default: cuda for kernels).")
    ] = None,
    list_presets: Annotated[
        bool, typer.Option("--list", help="List the presets and their settings.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists.")] = False,
) -> None:
    """Build a capture without a model: a preset's call(s) with seeded inputs, outputs from a kernel or the
    reference."""
    from moereplay.errors import SettingsError
    from moereplay.synth import all_presets, synthesize

    if list_presets:
        for item in all_presets():
            print(f"{item.name}  ({item.op}; biases {'on' if item.default_bias else 'off'})")
            print(f"    {item.summary}")
            for setting in item.settings:
                choices = f" [{'|'.join(setting.choices)}]" if setting.choices else ""
                print(f"    --set {setting.name}={setting.default}{choices}  {setting.help}")
        return
    if not preset:
        raise SettingsError("synth needs a PRESET (moereplay synth --list shows them)")
    if output is None:
        raise SettingsError("synth needs -o FILE")
    if output.exists() and not force:
        raise SettingsError(f"{output} exists; choose another -o or pass --force to replace it")
    result = synthesize(
        preset,
        output,
        overrides=set_ or [],
        bias=bias,
        store=store,
        backend=backend,
        device=device,
        command=_command_line(),
    )
    saved = (
        f"; {result.recipes} tensors as recipes standing for {_bytes(result.recipe_bytes)}"
        if result.recipes
        else ""
    )
    print(
        f"{result.path}: {plural(len(result.calls), 'call')} ({', '.join(result.calls)}), "
        f"{_bytes(result.file_bytes)}{saved}"
    )
    print(f"  preset {result.preset}: {', '.join(f'{k}={v}' for k, v in result.settings.items())}")
    print(f"  biases {'on' if result.bias else 'off'}; outputs from {result.output_source}")


@app.command("trim")
def trim_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    calls: Annotated[str, typer.Option("--calls", help="Calls to keep: 0,3,10-12.", show_default=False)],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Capture file to write.", show_default=False)
    ],
    parents: Annotated[
        bool,
        typer.Option(
            "--parents/--no-parents", help="Also keep every ancestor (parent record) of a kept call."
        ),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Keep chosen calls of a capture and only the blobs they use (`moereplay info` shows the dedup)."""
    from moereplay.errors import SettingsError
    from moereplay.trim import trim_capture

    if not file.exists():
        raise SettingsError(f"{file}: no such file")
    if output.exists() and not force:
        raise SettingsError(f"{output} exists; choose another -o or pass --force to replace it")
    result = trim_capture(file, calls, output, parents=parents)
    print(
        f"{result.path}: kept {len(result.kept)} of {plural(result.source_calls, 'call')} "
        f"({', '.join(map(str, result.kept))}), {_bytes(result.file_bytes)} (was {_bytes(result.source_bytes)})"
    )


@app.command("repro")
def repro_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    call: Annotated[
        int, typer.Option("--call", help="The call to export (see `moereplay ls`).", show_default=False)
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to write.", show_default=False)],
    flip: Annotated[
        list[str] | None, typer.Option("--flip", help="Variant to include: negate a flag.")
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Variant to include: ARG=V.")] = None,
    cast: Annotated[list[str] | None, typer.Option("--cast", help="Variant to include: ARG=DTYPE.")] = None,
    sweep: Annotated[
        list[str] | None, typer.Option("--sweep", help="Variants to include: ARG=v1,v2.")
    ] = None,
    fill: Annotated[
        list[str] | None, typer.Option("--fill", help="Guard fill variant: 0xff, 0xfe, 0x00, nan.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty directory.")] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", hidden=True, help="Deprecated spelling of --force.")
    ] = False,
) -> None:
    """Export one call as a standalone repro: script (provenance, variants), trimmed capture, bundled moereplay."""
    from moereplay.errors import SettingsError
    from moereplay.repro import export_repro

    if not file.exists():
        raise SettingsError(f"{file}: no such file")
    if overwrite:
        print("moereplay: --overwrite is deprecated; use --force", file=sys.stderr)
    mutations = (
        [f"flip {text}" for text in flip or ()]
        + [f"set {text}" for text in set_ or ()]
        + [f"cast {text}" for text in cast or ()]
        + [f"sweep {text}" for text in sweep or ()]
    )
    bundle = export_repro(
        file,
        call,
        output,
        mutations=mutations,
        fills=fill or [],
        command=_command_line(),
        overwrite=force or overwrite,
    )
    print(f"{bundle.directory}: repro of call {bundle.call} ({bundle.op})")
    print(
        f"  {bundle.script.name}, {bundle.capture.name} ({_bytes(bundle.capture_bytes)}), support/ "
        f"({bundle.modules} moereplay modules, {_bytes(bundle.bundle_bytes)}), README.md, MANIFEST.sha256"
    )
    print(f"  run: python {bundle.script} [--pack DIR | --backend reference]")


@app.command("layout")
def layout_command(
    file: Annotated[Path, typer.Argument(help="A capture file (.zst).", show_default=False)],
    call: Annotated[
        int,
        typer.Option("--call", help="Any call of the layer: its parent, gemm1 or gemm2.", show_default=False),
    ],
    activation: Annotated[
        str | None, typer.Option("--activation", help="Override the layer's activation (swigluoai, silu, …).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help="Device for the references.")] = "cpu",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """Which gate/up layout a fused MoE layer's activation consumes, and whether its weights are in it.
    Exit 1 on a mismatch or when no single layout explains the capture."""
    from moereplay.errors import SettingsError
    from moereplay.layout import probe_layout

    if not file.exists():
        raise SettingsError(f"{file}: no such file")
    report = probe_layout(file, call, device=device, activation=activation)
    if json_output:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        _render_layout(report)
    raise typer.Exit(1 if report.failed else 0)


def _render_layout(report: LayoutReport) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from moereplay.layout.probe import LAYOUT_NAMES

    calls = report.calls
    parent = f"parent #{calls.parent}, " if calls.parent is not None else ""
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    table = Table(
        title=escape(
            f"{report.path} · {calls.family} layer: {parent}gemm1 #{calls.gemm1}, gemm2 #{calls.gemm2} · "
            f"activation {report.activation}"
        ),
        title_justify="left",
    )
    for column in (
        "activation",
        "reads w13 as",
        "activation step max / rms rel",
        "layer max / rms rel",
        "match",
    ):
        table.add_column(
            column, justify="left" if column in ("activation", "reads w13 as", "match") else "right"
        )

    def pair(first: float | None, second: float | None) -> str:
        return "-" if first is None or second is None else f"{first:.2e} / {second:.2e}"

    for hypothesis in report.hypotheses:
        table.add_row(
            hypothesis.activation,
            escape(LAYOUT_NAMES[hypothesis.layout]),
            pair(hypothesis.step_max_rel, hypothesis.step_rms_rel),
            pair(hypothesis.layer_max_rel, hypothesis.layer_rms_rel),
            "[green]yes[/green]" if hypothesis.matches else "no",
        )
    console.print(table)
    style = "green" if not report.failed else "bold red"
    console.print(f"[{style}]{report.verdict.value}[/{style}]")
    for message in report.messages:
        console.print(f"  {message}", markup=False)
