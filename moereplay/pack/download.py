"""Fetching wheels for the GPU machine with pip (a subprocess; pip is never imported).

The GPU machine runs CPython 3.12 on manylinux x86-64 and reaches no index, so wheels are fetched here for that
target: ``pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform …``.
pip matches ``manylinux_2_N`` tags exactly, hence the list of tags. Cost: one pip process per call (seconds, plus
the download: the vLLM 0.25.1 wheel is 250 MB).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from moereplay.errors import PackError

#: Platform tags the GPU machine's pip accepts for a manylinux x86-64 glibc ≥ 2.28 system, newest first.
MANYLINUX_PLATFORMS: tuple[str, ...] = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)


@dataclass(frozen=True)
class Target:
    """The interpreter and platform wheels are fetched for."""

    python_version: str = "3.12"
    implementation: str = "cp"
    platforms: tuple[str, ...] = MANYLINUX_PLATFORMS


#: The pure-Python and small binary wheels ``import vllm._custom_ops`` and the fused-MoE modules need on a machine
#: with torch but no vLLM (measured with vLLM 0.25.1 on the H200 machine: shared/kernels/README.md).
VLLM_IMPORT_REQUIREMENTS: tuple[str, ...] = (
    "annotated-types==0.8.0",
    "cbor2==6.3.0",
    "distro==1.9.0",
    "jiter==0.19.0",
    "openai==3.57.0",
    "openai-harmony==0.0.8",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "pyzmq==27.3.0",
    "typing-inspection==0.4.5",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "sniffio==1.3.1",
    # vLLM's general-plugin loader imports its LoRA resolver plugins, which import msgspec; without it every
    # plugin load (the capture plugin's too) logs two import tracebacks (seen on the H200, 2026-12-02)
    "msgspec==0.23.0",
)

#: moereplay's own runtime needs that the GPU machine lacks (its image has msgpack, typer, rich, click, numpy).
MOEREPLAY_RUNTIME_REQUIREMENTS: tuple[str, ...] = ("zstandard==0.25.0",)

#: Files of extra wheels a pack leaves out, by normalised project name: zstandard's cffi backend (12 MB) needs the
#: ``cffi`` package, which the GPU machine lacks; zstandard imports its C backend first.
DROPPED_FILES: dict[str, tuple[str, ...]] = {"zstandard": ("zstandard/_cffi.*.so",)}


def pip_download(requirements: tuple[str, ...], destination: Path, target: Target = Target()) -> list[Path]:
    """Download exactly ``requirements`` (no dependencies) as wheels for ``target`` into ``destination``.

    Returns the wheel files present in ``destination`` afterwards that match the requirements' names.
    """
    destination.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--python-version", target.python_version, "--implementation", target.implementation,
        *(argument for platform in target.platforms for argument in ("--platform", platform)),
        "-d", str(destination), *requirements,
    ]  # fmt: skip
    try:
        finished = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        raise PackError(f"cannot run pip: {error}") from error
    if finished.returncode != 0:
        lines = [line for line in finished.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit code {finished.returncode}"
        raise PackError(f"pip download {' '.join(requirements)} failed: {reason}")
    return sorted(destination.glob("*.whl"))
