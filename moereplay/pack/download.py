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


#: The serve pack's target: also glibc ≥ 2.31 wheels, because llguidance 1.7.x (the range vLLM 0.25.1 pins) has
#: no older x86-64 build. The GPU machine's glibc must be ≥ 2.31 for ``vllm serve``.
SERVE_TARGET = Target(
    platforms=(
        "manylinux_2_31_x86_64",
        "manylinux_2_30_x86_64",
        "manylinux_2_29_x86_64",
        *MANYLINUX_PLATFORMS,
    )
)


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

#: What ``vllm serve`` (vLLM 0.25.1, text generation: /v1/completions, /v1/chat/completions) imports beyond the
#: kernels pack's wheels and the GPU machine's own packages (fastapi's and uvicorn's other needs — anyio, h11,
#: click, httpx, jinja2, uvloop, pyyaml — and prometheus-client, transformers, … are there). Found by importing the
#: API server, engine core, worker, model runner and the gpt-oss / Qwen3-MoE / Mixtral model modules with the CUDA
#: platform detected, building the FastAPI app, and starting ``vllm serve`` up to the worker's device init (Python
#: 3.12, torch 2.11.0, no GPU: 2026-12-03). Every pin satisfies the 0.25.1 dist-info's ``Requires-Dist``.
VLLM_SERVE_REQUIREMENTS: tuple[str, ...] = (
    # the OpenAI-compatible HTTP server: api_server imports fastapi and starlette, the launcher serves with uvicorn
    # (its h11 protocol and uvloop loop: uvicorn[standard]'s httptools/websockets/python-dotenv are never needed)
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "uvicorn==0.55.0",
    # build_app always adds the /metrics router (prometheus-fastapi-instrumentator) and the SageMaker routers
    # (model-hosting-container-standards, which imports jmespath); vllm.entrypoints.serve.utils.ssl imports
    # watchfiles at module level (certificate reloading) and the API server imports that module
    "prometheus-fastapi-instrumentator==8.1.0",
    "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0",
    "watchfiles==1.3.0",
    # imported at module level by vllm.engine.arg_utils, vllm.v1.engine.core and the model runner (pybase64:
    # vllm.utils.serial_utils; cachetools: vllm.utils.cache)
    "pybase64==1.5.1",
    "cachetools==8.0.2",
    # the tool parsers the chat and completion serving modules import (vllm.tool_parsers)
    "partial-json-parser==0.2.1.1.post7",
    # vllm.v1.structured_output (imported by the engine core) defines dataclasses annotated with llguidance and
    # xgrammar types, which loads both at import time even when no request asks for structured output.
    # xgrammar 0.2.3 is the newest whose tvm-ffi need meets vLLM's apache-tvm-ffi==0.1.9 pin; its 53 MB bindings
    # library is 50 MB of DWARF, blanked at build time (elf.blank_debug_sections); llguidance 1.7.x is
    # manylinux_2_31 only (see SERVE_TARGET)
    "llguidance==1.7.6",
    "xgrammar==0.2.3",
    "apache-tvm-ffi==0.1.9",
    # GPTQ / AWQ int4 MoE checkpoints (vLLM's Marlin MoE path) and compressed-tensors checkpoints:
    # quantization/auto_gptq.py and auto_awq.py import fused_moe.oracle.int_wna16, which imports compressed_tensors
    # at module level; compressed-tensors imports loguru
    "compressed-tensors==0.17.0",
    "loguru==0.7.3",
)
# Left out on purpose (imported only off the text-serving path, checked in vLLM 0.25.1's source): blake3
# (multimodal item hashing; prefix caching hashes with sha256/cbor or xxhash), setproctitle (optional: process
# titles), depyf (compile debug dumps), outlines-core / diskcache / lm-format-enforcer (only when a request picks
# those structured-output backends), mistral-common / ijson (Mistral tokenizer and tool parser), mcp (Responses
# API tools), opentelemetry-* (--otlp-traces-endpoint), python-multipart (speech-to-text upload routes),
# anthropic, python-json-logger, and the GPU extras (flashinfer, tilelang, quack, cutlass-dsl, fastsafetensors,
# torchcodec, nvtx, …), which vLLM probes for before use.

#: Files of extra wheels a pack leaves out, by normalised project name, and why: zstandard's cffi backend (12 MB)
#: needs the ``cffi`` package, which the GPU machine lacks (zstandard imports its C backend first); xgrammar's
#: static library and tvm-ffi's bundled third-party sources serve only to build C++ extensions against them.
DROPPED_FILES: dict[str, tuple[str, ...]] = {
    "zstandard": ("zstandard/_cffi.*.so",),
    "xgrammar": ("xgrammar/lib/*.a",),
    "apache-tvm-ffi": ("tvm_ffi/3rdparty/*",),
}


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
