"""The environment header every capture file starts with.

Collected once per writer, cheaply and without side effects: package versions come from
``importlib.metadata`` (vLLM and triton are *not* imported); GPU facts are read only when this process has
already initialised CUDA (a capture writer is created on the first captured call, when it has), so creating a
writer never creates a CUDA context; the driver version comes from ``/proc/driver/nvidia/version``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import sys
from typing import Any

import torch

from moereplay.format.framing import BLOB_HASH, FORMAT_MAJOR, FORMAT_MINOR, MAGIC

ENV_PREFIXES = ("MOEREPLAY_", "VLLM_")
"""Environment variables recorded in the header."""
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")
"""Variables and ``--options`` whose names contain one of these have their values replaced by REDACTED:
capture files get attached to bug reports (e.g. ``VLLM_API_KEY``, ``--api-key``, ``--hf-token``)."""
REDACTED = "<redacted>"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as handle:
            first = handle.readline()
    except OSError:
        return None
    for word in first.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return first.strip() or None


def _gpu() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    if not torch.cuda.is_initialized():
        return {"initialized": False, "count": torch.cuda.device_count()}
    index = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    return {
        "initialized": True,
        "count": torch.cuda.device_count(),
        "device": index,
        "name": properties.name,
        "compute_capability": f"{properties.major}.{properties.minor}",
        "sm_count": properties.multi_processor_count,
        "memory_bytes": properties.total_memory,
    }


def late_gpu(header_gpu: Any) -> dict[str, Any] | None:
    """The GPU, read now, when the header's was recorded before CUDA was initialised and CUDA is initialised now
    (the footer then holds it); ``None`` otherwise. Never initialises CUDA itself."""
    if not isinstance(header_gpu, dict) or header_gpu.get("initialized") is not False:
        return None
    try:
        gpu = _gpu()
    except Exception:  # a driver error at close must not cost the footer
        return None
    return gpu if gpu is not None and gpu.get("initialized") else None


def _secret(name: str) -> bool:
    upper = name.upper().replace("-", "_")
    return any(word in upper for word in SECRET_WORDS)


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the values of secret-looking options replaced (``--api-key X``, ``--hf-token=X``)."""
    result: list[str] = []
    hide_next = False
    for argument in argv:
        if hide_next:
            result.append(REDACTED)
            hide_next = False
        elif argument.startswith("--") and _secret(argument.split("=", 1)[0]):
            if "=" in argument:
                result.append(argument.split("=", 1)[0] + "=" + REDACTED)
            else:
                result.append(argument)
                hide_next = True
        else:
            result.append(argument)
    return result


def collect_environment() -> dict[str, Any]:
    """The automatic part of a capture header (values are msgpack-native: str, int, dicts, lists)."""
    return {
        "magic": MAGIC,
        "format_version": [FORMAT_MAJOR, FORMAT_MINOR],
        "blob_hash": BLOB_HASH,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            # run from a source tree (PYTHONPATH, no dist-info) the package still knows its own version
            "moereplay": _version("moereplay") or _own_version(),
            "torch": str(torch.__version__),
            "triton": _version("triton"),
            "vllm": _version("vllm"),
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "driver": _driver_version(),
        },
        "gpu": _gpu(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "pid": os.getpid(),
        "argv": redact_argv(sys.argv),
        "rank": {name.lower(): os.environ[name] for name in RANK_VARIABLES if name in os.environ},
        "env": {
            name: REDACTED if _secret(name) else value
            for name, value in sorted(os.environ.items())
            if name.startswith(ENV_PREFIXES)
        },
    }


def _own_version() -> str:
    from moereplay import __version__

    return __version__
