"""``export_repro()``: one captured call as a directory a vLLM maintainer can run without moereplay installed.

Layout of the directory::

    repro.py          the script (provenance docstring, the exported variants, one call into the runtime)
    call.moe.zst      the call, trimmed out of its capture (inputs as recorded — bytes or recipes — and its output)
    support/moereplay moereplay's own modules the replay needs, copied unmodified (see moereplay.repro.bundle)
    README.md         what it is, how to run it, what it prints, provenance
    MANIFEST.sha256   sha256 of every other file (``sha256sum -c``)

The provenance (moereplay version, the exact export command, and from the capture header: vLLM / torch / triton /
CUDA / driver versions, GPU, when and how it was captured) is written into the script, the README, and printed by
the script before its table. It names files by their names only: every absolute path in it (the export command's,
the recording command line's, a kernel pack's) is cut to its last component, and the source capture is identified by
its sha256 (``source_sha256``) — a repro attached to an issue shows nothing of the machines' directories. The
header of ``call.moe.zst`` is scrubbed alike (its recorded command line, environment and synth command: see
:func:`_portable_header`).
"""

from __future__ import annotations

import datetime
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from moereplay.errors import ReplayError, SettingsError
from moereplay.wording import plural

CAPTURE_NAME = "call.moe.zst"
SCRIPT_NAME = "repro.py"
HEADER_KEYS = ("versions", "gpu", "created", "argv", "purpose", "synth", "trim", "platform")
"""Capture-header entries copied into the provenance (not the host name, pid or environment)."""


@dataclass(frozen=True)
class ReproBundle:
    """What :func:`export_repro` wrote."""

    directory: Path
    script: Path
    capture: Path
    op: str
    call: int
    modules: int
    bundle_bytes: int
    capture_bytes: int


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_repro(
    capture: str | Path,
    call: int,
    directory: str | Path,
    *,
    mutations: Sequence[str] = (),
    fills: Sequence[str] = (),
    command: str | None = None,
    overwrite: bool = False,
) -> ReproBundle:
    """Write the repro of call ``call`` of ``capture`` into ``directory`` (see the module docstring).

    ``mutations``: texts as ``moereplay run`` takes them (``"flip mul_topk_weights"``, ``"cast topk_weights=float32"``);
    ``fills``: guard fills (``"0xff"``). Both are checked against the call's op now, so a typo fails here, not in the
    maintainer's hands. ``command``: the command line to record (default: a reconstruction).
    """
    import moereplay
    from moereplay.format import CaptureReader
    from moereplay.format.summary import jsonable
    from moereplay.ops import get_op
    from moereplay.replay.mutations import parse_variants
    from moereplay.repro.bundle import RUNTIME_ROOTS, copy_bundle
    from moereplay.repro.templates import readme_text, script_text
    from moereplay.trim import trim_capture

    capture, directory = Path(capture), Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise SettingsError(f"{directory}: exists and is not empty (choose another -o or pass --force)")
    with CaptureReader(capture) as reader:
        if call not in reader.indices:
            raise SettingsError(f"{capture}: no call {call} (the file holds {plural(len(reader), 'call')})")
        record = reader.call(call)
        header = reader.header
    op = get_op(record.op)  # a call of an op moereplay cannot replay fails here (UnknownOpError)
    parse_variants(op, list(mutations), list(fills))
    if record.status == "inputs_saved":
        raise ReplayError(
            f"{capture}: call {call} has no recorded output (it never completed): nothing to judge"
        )
    directory.mkdir(parents=True, exist_ok=True)
    trimmed = directory / CAPTURE_NAME
    trim_capture(capture, [call], trimmed, rewrite_header=_portable_header)
    files = copy_bundle((*RUNTIME_ROOTS, type(op).__module__), directory / "support")
    if command is None:
        options = " ".join(f"--{m.split(' ', 1)[0]} {m.split(' ', 1)[1]}" for m in mutations)
        options += "".join(f" --fill {fill}" for fill in fills)
        command = f"moereplay repro {capture.name} --call {call} -o {directory.name} {options}".strip()
    provenance: dict[str, Any] = jsonable(
        {
            "op": record.op,
            "call": call,
            "site": record.site,
            "layer": record.layer,
            "source": capture.name,
            "source_sha256": _sha256(capture),
            "moereplay": moereplay.__version__,
            "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "mutations": list(mutations),
            "fills": list(fills),
            "capture": {key: header[key] for key in HEADER_KEYS if key in header},
        }
    )
    provenance = _without_absolute_paths(provenance)
    script = directory / SCRIPT_NAME
    script.write_text(script_text(provenance, mutations, fills), encoding="utf-8")
    script.chmod(0o755)
    capture_bytes = trimmed.stat().st_size
    readme = directory / "README.md"
    readme.write_text(
        readme_text(provenance, mutations, fills, capture_bytes=capture_bytes, module_count=len(files)),
        encoding="utf-8",
    )
    lines = [f"{_sha256(directory / name)}  {name}" for name in (SCRIPT_NAME, CAPTURE_NAME, "README.md")]
    lines += [f"{item.sha256}  support/{item.path}" for item in files]
    (directory / "MANIFEST.sha256").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ReproBundle(
        directory=directory,
        script=script,
        capture=trimmed,
        op=record.op,
        call=call,
        modules=len(files),
        bundle_bytes=sum(item.size for item in files),
        capture_bytes=capture_bytes,
    )


def _portable_header(header: dict[str, Any]) -> dict[str, Any]:
    """The trimmed capture's header without the directories of the machines that recorded and exported it.

    Merged over the automatic header first (what the writer would fill in from this process — its command line
    among them — is scrubbed too). The recording program keeps its name (``/root/.pyenv/…/bin/moereplay`` →
    ``moereplay``; ``python -m moereplay``'s ``/work/x/moereplay/__main__.py`` → ``moereplay/__main__.py``), and
    every other absolute path is cut to its last component, as in the provenance (the user's files by their names,
    ``pack:/a/b/.kernelpack`` → ``pack:.kernelpack``)."""
    from moereplay.format.environment import collect_environment

    merged = {**collect_environment(), **header}
    argv = merged.get("argv")
    if isinstance(argv, list) and argv and isinstance(argv[0], str):
        merged["argv"] = [_program_name(argv[0]), *argv[1:]]
    portable: dict[str, Any] = _without_absolute_paths(merged)
    return portable


def _program_name(program: str) -> str:
    """An absolute ``argv[0]`` without its directory (a package run with ``python -m`` keeps its package's name);
    a relative one (``tools/make_captures.py``) names no machine's directory and stays."""
    if not program.startswith(("/", "~")):
        return program
    path = PurePosixPath(program)
    if path.name == "__main__.py" and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name or program


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])(?:~|/)(?:[^\s/'\"]*/)+(?=[^\s/'\"]*)")
"""An absolute (or home-relative) path up to its last ``/``: ``/work/x/captures/`` in ``/work/x/captures/a.zst``."""


def _without_absolute_paths(value: Any) -> Any:
    """``value`` with every absolute path in its strings cut to its last component (``pack:/a/b/.kernelpack`` →
    ``pack:.kernelpack``, ``/tmp/out/`` → ``out``)."""
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub("", re.sub(r"(?<=[^\s/])/+(?=\s|$|['\"])", "", value))
    if isinstance(value, dict):
        return {key: _without_absolute_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_absolute_paths(item) for item in value]
    return value
