"""``moereplay kernels …``: build, describe and check kernel packs.

- ``kernels pack --vllm 0.25.1 [--profile kernels|serve] [--wheel W] [--arch sm_90|all] [--extra-wheels DIR] -o DIR``
  (``kernels``: the MoE kernels, conventionally ``-o .kernelpack``; ``serve``: what ``vllm serve`` needs beyond
  it, conventionally ``-o .servepack``)
- ``kernels info DIR [--json]``
- ``kernels check DIR`` (GPU: load the pack and run :mod:`moereplay.pack.smoke`; one line)
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from moereplay.cli import app

kernels_app = typer.Typer(
    name="kernels",
    help="Build and inspect kernel packs (vLLM's compiled MoE kernels from an official wheel).",
    no_args_is_help=True,
)
app.add_typer(kernels_app, name="kernels")


class Profile(str, Enum):
    """``--profile`` choices (moereplay.pack.profiles)."""

    kernels = "kernels"
    serve = "serve"


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr)


@kernels_app.command("pack")
def pack_command(
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to write the pack into.")],
    vllm: Annotated[str, typer.Option("--vllm", help="vLLM version, e.g. 0.25.1.")],
    wheel: Annotated[
        Path | None, typer.Option("--wheel", help="Use this vLLM wheel instead of downloading one with pip.")
    ] = None,
    arch: Annotated[
        str, typer.Option("--arch", help="Keep GPU code for this architecture only (sm_90), or 'all'.")
    ] = "sm_90",
    extra_wheels: Annotated[
        Path | None,
        typer.Option(
            "--extra-wheels",
            help="Directory of extra wheels to unpack (missing ones are downloaded into it).",
        ),
    ] = None,
    download_dir: Annotated[
        Path | None,
        typer.Option("--download-dir", help="Where a downloaded vLLM wheel is kept (default: cache)."),
    ] = None,
    xz_preset: Annotated[int, typer.Option("--xz-preset", min=0, max=9, help="xz compression level.")] = 9,
    profile: Annotated[
        Profile,
        typer.Option(
            "--profile",
            help="kernels: vLLM's tree and MoE kernels (.kernelpack); serve: FlashAttention 3 and the wheels "
            "`vllm serve` needs beside a kernels pack (.servepack).",
        ),
    ] = Profile.kernels,
) -> None:
    """Build a kernel pack (or its serving companion) from the official vLLM wheel."""
    from moereplay.pack.build import BuildOptions, build_pack

    options = BuildOptions(
        profile=profile.value,
        vllm_version=vllm,
        output=output,
        wheel=wheel,
        arch=None if arch.lower() in ("all", "none") else arch,
        extra_wheels=extra_wheels,
        download_dir=download_dir,
        xz_preset=xz_preset,
    )
    manifest = build_pack(options, progress=_progress)
    _print_summary(output)
    total = sum(digest.size for digest in manifest.files)
    print(f"wrote {output} ({total / 1e6:.1f} MB)")


@kernels_app.command("info")
def info_command(
    directory: Annotated[Path, typer.Argument(help="A kernel pack directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Print a pack's manifest."""
    from moereplay.pack.manifest import read_manifest

    if as_json:
        print(read_manifest(directory).to_json(), end="")
        return
    _print_summary(directory)


def _print_summary(directory: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from moereplay.pack.manifest import read_manifest

    manifest = read_manifest(directory)
    console = Console(highlight=False)
    console.print(
        f"{manifest.label}: torch=={manifest.torch_pin}, "
        f"CUDA {manifest.cuda_major}, arch {manifest.arch or 'all'}, "
        f"{manifest.python_files} Python files ({manifest.tree_files} in tree), "
        f"{manifest.entries_zeroed} fatbin entries zeroed"
    )
    arch = manifest.arch or "any arch"
    for library in manifest.libraries:
        table = Table(
            title=f"{library.member} ({library.size / 1e6:.1f} MB, {library.containers} containers, "
            f"{library.containers_without_code} with no code for {arch}, "
            f"{library.containers_ptx_only} reaching it only through PTX JIT)",
            title_justify="left",
        )
        for column in ("kind", "arch", "found", "zeroed", "MB found", "MB zeroed", "why zeroed"):
            table.add_column(
                column, justify="left" if column in ("kind", "why zeroed") else "right", no_wrap=True
            )
        for tally in library.entries:
            table.add_row(
                tally.kind, f"sm_{tally.arch}", str(tally.found), str(tally.zeroed),
                f"{tally.found_bytes / 1e6:.2f}", f"{tally.zeroed_bytes / 1e6:.2f}", _reason_text(tally.reason, arch),
            )  # fmt: skip
        console.print(table)
    wheels = ", ".join(f"{wheel.name} {wheel.version}" for wheel in manifest.extra_wheels)
    console.print(f"extra wheels ({len(manifest.extra_wheels)}): {wheels}")
    for digest in manifest.files:
        console.print(f"{digest.name}: {digest.size} bytes, sha256 {digest.sha256}")


def _reason_text(reason: str | None, arch: str) -> str:
    if reason == "other-arch":
        return f"not for {arch}"
    if reason == "beside-cubin":
        return f"{arch} cubin beside"
    return ""


@kernels_app.command("check")
def check_command(
    directory: Annotated[Path, typer.Argument(help="A kernel pack directory.")],
) -> None:
    """Load a pack on this machine's GPU and run a small correctness check (one line)."""
    from moereplay.errors import PackError
    from moereplay.pack.load import load_pack
    from moereplay.pack.smoke import smoke_test

    pack = load_pack(directory)
    result = smoke_test(pack)
    print(result.line())
    if not result.ok:
        raise PackError(f"kernel pack {directory} failed its smoke check")
