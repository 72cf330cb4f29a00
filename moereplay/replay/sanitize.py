"""``--sanitize``: run the captured call once under compute-sanitizer memcheck and fold its report into findings.

The call runs in a fresh process (``python -m moereplay.replay.worker --oneshot``) with PyTorch's caching allocator
off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``) and without guard bands, so every argument is its own device allocation
of its own size and memcheck's "N bytes after the nearest allocation at ADDRESS" names an argument: the worker
prints each argument's address first. Cost: memcheck slows a kernel by one to two orders of magnitude.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from moereplay.replay.backends import BackendSpec
from moereplay.replay.findings import Finding, FindingKind
from moereplay.replay.source import LoadedCall

_ERROR = re.compile(
    r"^=+\s+(Invalid __\w+__ (?:read|write|atomic)[^\n]*|Program hit [^\n]*|[A-Z][^\n]*error[^\n]*)$"
)
_AT = re.compile(r"^=+\s+at (.+?)(?:\+0x[0-9a-f]+)?$")
_NEAREST = re.compile(
    r"(\d+) bytes (after|before) the nearest allocation at (0x[0-9a-f]+) of size (\d+) bytes"
)
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_ARG = re.compile(r"^MOEREPLAY-ARG (\S+) (0x[0-9a-f]+) (\d+)$")


@dataclass(frozen=True)
class SanitizerError:
    kind: str
    kernel: str
    argument: str | None
    offset: int | None  # bytes past the end ("after") or before the start ("before") of the allocation
    side: str | None


def parse_report(log: str, stdout: str) -> tuple[list[SanitizerError], int | None]:
    """Errors of a memcheck log, attributed to arguments by the worker's ``MOEREPLAY-ARG`` lines."""
    bases: dict[int, str] = {}
    for line in stdout.splitlines():
        match = _ARG.match(line.strip())
        if match:
            bases[int(match.group(2), 16)] = match.group(1)
    errors: list[SanitizerError] = []
    current: dict[str, object] | None = None

    def close() -> None:
        if current is not None:
            errors.append(
                SanitizerError(
                    str(current["kind"]),
                    str(current.get("kernel", "?")),
                    current.get("argument"),  # type: ignore[arg-type]
                    current.get("offset"),  # type: ignore[arg-type]
                    current.get("side"),  # type: ignore[arg-type]
                )
            )

    total = None
    for line in log.splitlines():
        summary = _SUMMARY.search(line)
        if summary:
            total = int(summary.group(1))
            continue
        error = _ERROR.match(line.strip())
        if error and "ERROR SUMMARY" not in line and "Target application returned an error" in line:
            close()  # the worker's exit status after memcheck's errors, not an error of its own
            current = None
            continue
        if error and "ERROR SUMMARY" not in line:
            close()
            current = {"kind": error.group(1).strip()}
            continue
        if current is None:
            continue
        at = _AT.match(line.strip())
        if at and "kernel" not in current:
            current["kernel"] = at.group(1)[:160]
        nearest = _NEAREST.search(line)
        if nearest:
            current["offset"] = int(nearest.group(1))
            current["side"] = nearest.group(2)
            current["argument"] = bases.get(int(nearest.group(3), 16))
    close()
    return errors, total


def sanitize_findings(
    call: LoadedCall, spec: BackendSpec, device: torch.device, *, timeout_s: float
) -> list[Finding]:
    """Run the baseline under memcheck; one finding per (kind, kernel, argument) group, or one saying it is clean."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return [
            Finding(
                FindingKind.SANITIZER,
                "compute-sanitizer not found on PATH; --sanitize skipped",
                confidence=0.0,
            )
        ]
    folder = Path(tempfile.mkdtemp(prefix="moereplay-sanitize-"))
    log_path = folder / "memcheck.log"
    environment = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    command = [
        tool,
        "--tool",
        "memcheck",
        "--print-limit",
        "200",
        "--log-file",
        str(log_path),
        sys.executable,
        "-m",
        "moereplay.replay.worker",
        "--oneshot",
        str(call.capture_path),
        str(call.index),
        spec.text,
        str(device),
    ]
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, env=environment, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        shutil.rmtree(folder, ignore_errors=True)
        return [Finding(FindingKind.SANITIZER, f"compute-sanitizer did not finish within {timeout_s:g} s")]
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    shutil.rmtree(folder, ignore_errors=True)
    errors, total = parse_report(log, completed.stdout)
    if total == 0 and not errors:
        ran = "MOEREPLAY-DONE" in completed.stdout
        message = "compute-sanitizer memcheck: 0 errors" + ("" if ran else " (but the call did not finish)")
        return [
            Finding(
                FindingKind.SANITIZER, message, evidence={"errors": 0, "returncode": completed.returncode}
            )
        ]
    groups: Counter[tuple[str, str, str | None, str | None]] = Counter()
    offsets: dict[tuple[str, str, str | None, str | None], list[int]] = {}
    for error in errors:
        key = (error.kind, error.kernel, error.argument, error.side)
        groups[key] += 1
        if error.offset is not None:
            offsets.setdefault(key, []).append(error.offset)
    findings = []
    for (kind, kernel, argument, side), count in groups.most_common():
        where = ""
        if argument is not None and offsets.get((kind, kernel, argument, side)):
            values = offsets[(kind, kernel, argument, side)]
            where = f" on {argument}, {min(values)}..{max(values)} bytes {side} its allocation"
        elif argument is None and side is not None:
            where = f", {side} an allocation that is no argument"
        findings.append(
            Finding(
                FindingKind.SANITIZER,
                f"memcheck: {count}× {kind}{where} in {kernel}",
                evidence={"kind": kind, "kernel": kernel, "argument": argument, "count": count, "side": side},
            )
        )
    if total is not None and total > len(errors):
        findings.append(
            Finding(FindingKind.SANITIZER, f"memcheck reported {total} errors in all ({len(errors)} shown)")
        )
    return findings
