"""Reading wheels: vLLM's (what a pack takes from it, its torch pin) and the extra wheels a pack unpacks.

A wheel is a zip file (PEP 427) whose ``NAME-VERSION.dist-info/METADATA`` holds ``Requires-Dist`` lines.
Installing a wheel with ``--no-deps --no-compile --target`` amounts to unzipping it, with the contents of
``NAME-VERSION.data/purelib`` and ``…/platlib`` moved to the top; packs do exactly that at build time, so the GPU
machine needs neither pip nor an index. Scripts, headers and data under ``.data/`` are left out (no import needs
them). Only the zip's central directory is read until a member is asked for.
"""

from __future__ import annotations

import fnmatch
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from moereplay.errors import PackError
from moereplay.pack.archive import ArchiveMember, check_member_path

_WHEEL_NAME = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>.+)\.whl$"
)
_TORCH_PIN = re.compile(r"^torch\s*==\s*(?P<version>[0-9][^\s;,]*)\s*(;.*)?$")
_EXECUTABLE = 0o111 << 16


@dataclass(frozen=True)
class WheelName:
    """The parts of a wheel's file name (PEP 427): ``name-version(-build)?-python-abi-platform.whl``."""

    name: str
    version: str
    python: str
    abi: str
    platform: str

    @property
    def normalized(self) -> str:
        """The PEP 503 normalised project name (``openai_harmony`` → ``openai-harmony``)."""
        return re.sub(r"[-_.]+", "-", self.name).lower()

    @property
    def is_pure(self) -> bool:
        return self.abi == "none" and self.platform == "any"


def parse_wheel_name(filename: str) -> WheelName:
    """Split a wheel file name; raise PackError if it is not one."""
    match = _WHEEL_NAME.match(PurePosixPath(filename).name)
    if match is None:
        raise PackError(f"not a wheel file name: {filename!r}")
    return WheelName(
        name=match["name"],
        version=match["version"],
        python=match["python"],
        abi=match["abi"],
        platform=match["platform"],
    )


def open_wheel(path: Path) -> zipfile.ZipFile:
    """Open a wheel for reading, turning zip errors into PackError."""
    try:
        return zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as error:
        raise PackError(f"cannot open wheel {path}: {error}") from error


def dist_info_dir(wheel: zipfile.ZipFile) -> str:
    """The wheel's single top-level ``*.dist-info`` directory name."""
    found = {
        name.split("/", 1)[0] for name in wheel.namelist() if name.split("/", 1)[0].endswith(".dist-info")
    }
    if len(found) != 1:
        raise PackError(f"wheel has {len(found)} .dist-info directories, expected 1")
    return found.pop()


def read_metadata(wheel: zipfile.ZipFile) -> dict[str, list[str]]:
    """The wheel's METADATA headers, each name mapped to all of its values (``Requires-Dist`` repeats)."""
    member = f"{dist_info_dir(wheel)}/METADATA"
    try:
        text = wheel.read(member).decode("utf-8")
    except KeyError as error:
        raise PackError(f"wheel has no {member}") from error
    message = HeaderParser().parsestr(text, headersonly=True)
    headers: dict[str, list[str]] = {}
    for key, value in message.items():
        headers.setdefault(key, []).append(str(value).strip())
    return headers


def torch_pin(metadata: dict[str, list[str]]) -> str:
    """The exact torch version a wheel requires (``Requires-Dist: torch==2.11.0`` → ``2.11.0``)."""
    for requirement in metadata.get("Requires-Dist", []):
        match = _TORCH_PIN.match(requirement)
        if match and "extra" not in (match.group(2) or ""):
            return match["version"]
    raise PackError("the wheel's METADATA pins no torch version (no 'Requires-Dist: torch==…')")


def wheel_members(wheel: zipfile.ZipFile, drop: tuple[str, ...] = ()) -> Iterator[ArchiveMember]:
    """The files a ``pip install --target`` of this wheel would create, as archive members.

    ``drop`` holds fnmatch patterns of paths to leave out (e.g. a backend the GPU machine cannot load).
    """
    for info in wheel.infolist():
        if info.is_dir():
            continue
        path = info.filename
        top, _, rest = path.partition("/")
        if top.endswith(".data"):
            kind, _, inner = rest.partition("/")
            if kind not in ("purelib", "platlib") or not inner:
                continue
            path = inner
        path = check_member_path(path)
        if any(fnmatch.fnmatch(path, pattern) for pattern in drop):
            continue
        yield ArchiveMember(
            path=path, data=wheel.read(info), executable=bool(info.external_attr & _EXECUTABLE)
        )
