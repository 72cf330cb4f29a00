"""The kernel pack manifest (``manifest.json``): what a pack holds and what it needs to run.

Layout of a pack directory::

    DIR/manifest.json   this file
    DIR/tree.tar.xz     vllm/**/*.py (+ json configs, py.typed), vllm-X.dist-info/, the two CUDA libraries
    DIR/deps.tar.xz     the extra wheels, unpacked as ``pip install --no-deps --target`` would

The manifest is plain JSON with a format version; reading one checks every field's type so a damaged or foreign
file fails with one clear :class:`~moereplay.errors.PackError` line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from moereplay.errors import PackError
from moereplay.pack.fatbin import EntryTally

MANIFEST_NAME = "manifest.json"
TREE_ARCHIVE = "tree.tar.xz"
DEPS_ARCHIVE = "deps.tar.xz"
FORMAT = "moereplay-kernel-pack"
FORMAT_VERSION = 1

WheelPurpose = Literal["vllm-import", "moereplay-runtime", "extra"]


@dataclass(frozen=True)
class FileDigest:
    """A file by name, size in bytes and sha256 (hex)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class LibraryRecord:
    """One CUDA library in the tree, as stored (after slimming, if any)."""

    member: str
    size: int
    sha256: str
    cuda_major: int | None
    slimmed: bool
    containers: int
    containers_without_code: int
    entries: tuple[EntryTally, ...]

    @property
    def entries_zeroed(self) -> int:
        return sum(tally.zeroed for tally in self.entries)

    @property
    def bytes_zeroed(self) -> int:
        return sum(tally.zeroed_bytes for tally in self.entries)


@dataclass(frozen=True)
class ExtraWheel:
    """A wheel unpacked into ``deps.tar.xz``; ``dropped`` lists patterns of its files left out, and why."""

    file: str
    name: str
    version: str
    python: str
    abi: str
    platform: str
    sha256: str
    purpose: WheelPurpose
    dropped: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackManifest:
    """Everything a pack records about itself. ``arch`` is e.g. ``"sm_90"``, or None for unslimmed libraries."""

    vllm_version: str
    vllm_wheel: FileDigest
    torch_pin: str
    cuda_major: int | None
    arch: str | None
    libraries: tuple[LibraryRecord, ...]
    python_files: int
    tree_files: int
    extra_wheels: tuple[ExtraWheel, ...]
    files: tuple[FileDigest, ...]
    created_by: str
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise PackError(f"not a kernel pack manifest (format {self.format!r})")
        if self.format_version != FORMAT_VERSION:
            raise PackError(f"kernel pack format version {self.format_version} is not supported (expected 1)")

    @property
    def entries_zeroed(self) -> int:
        return sum(library.entries_zeroed for library in self.libraries)

    def file(self, name: str) -> FileDigest | None:
        for digest in self.files:
            if digest.name == name:
                return digest
        return None

    def to_json(self) -> str:
        """Stable, indented JSON (keys in declaration order)."""
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PackManifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise PackError(f"manifest is not valid JSON: {error}") from error
        return _manifest(_Reader(raw, "manifest"))


def write_manifest(directory: Path, manifest: PackManifest) -> Path:
    path = directory / MANIFEST_NAME
    path.write_text(manifest.to_json(), encoding="utf-8")
    return path


def read_manifest(directory: Path) -> PackManifest:
    """Read ``DIR/manifest.json``; PackError if the directory is not a pack."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise PackError(f"{directory} is not a kernel pack (no {MANIFEST_NAME})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PackError(f"cannot read {path}: {error}") from error
    return PackManifest.from_json(text)


class _Reader:
    """Typed access to one JSON object, naming the field path in every error."""

    def __init__(self, raw: Any, where: str) -> None:
        if not isinstance(raw, dict):
            raise PackError(f"manifest: {where} must be an object")
        self.raw = raw
        self.where = where

    def _get(self, key: str) -> Any:
        if key not in self.raw:
            raise PackError(f"manifest: {self.where}.{key} is missing")
        return self.raw[key]

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise PackError(f"manifest: {self.where}.{key} must be a string")
        return value

    def opt_text(self, key: str) -> str | None:
        return None if self._get(key) is None else self.text(key)

    def count(self, key: str) -> int:
        value = self._get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PackError(f"manifest: {self.where}.{key} must be a non-negative integer")
        return value

    def opt_count(self, key: str) -> int | None:
        return None if self._get(key) is None else self.count(key)

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise PackError(f"manifest: {self.where}.{key} must be true or false")
        return value

    def obj(self, key: str) -> _Reader:
        return _Reader(self._get(key), f"{self.where}.{key}")

    def objs(self, key: str) -> list[_Reader]:
        value = self._get(key)
        if not isinstance(value, list):
            raise PackError(f"manifest: {self.where}.{key} must be a list")
        return [_Reader(item, f"{self.where}.{key}[{index}]") for index, item in enumerate(value)]

    def texts(self, key: str) -> tuple[str, ...]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise PackError(f"manifest: {self.where}.{key} must be a list of strings")
        return tuple(value)


def _digest(reader: _Reader) -> FileDigest:
    return FileDigest(name=reader.text("name"), size=reader.count("size"), sha256=reader.text("sha256"))


def _tally(reader: _Reader) -> EntryTally:
    return EntryTally(
        kind=reader.text("kind"),
        arch=reader.count("arch"),
        found=reader.count("found"),
        zeroed=reader.count("zeroed"),
        found_bytes=reader.count("found_bytes"),
        zeroed_bytes=reader.count("zeroed_bytes"),
    )


def _library(reader: _Reader) -> LibraryRecord:
    return LibraryRecord(
        member=reader.text("member"),
        size=reader.count("size"),
        sha256=reader.text("sha256"),
        cuda_major=reader.opt_count("cuda_major"),
        slimmed=reader.flag("slimmed"),
        containers=reader.count("containers"),
        containers_without_code=reader.count("containers_without_code"),
        entries=tuple(_tally(item) for item in reader.objs("entries")),
    )


def _wheel(reader: _Reader) -> ExtraWheel:
    purpose = reader.text("purpose")
    if purpose not in ("vllm-import", "moereplay-runtime", "extra"):
        raise PackError(f"manifest: {reader.where}.purpose {purpose!r} is unknown")
    return ExtraWheel(
        file=reader.text("file"),
        name=reader.text("name"),
        version=reader.text("version"),
        python=reader.text("python"),
        abi=reader.text("abi"),
        platform=reader.text("platform"),
        sha256=reader.text("sha256"),
        purpose=purpose,  # type: ignore[arg-type]
        dropped=reader.texts("dropped"),
    )


def _manifest(reader: _Reader) -> PackManifest:
    format_name = reader.text("format")
    if format_name != FORMAT:
        raise PackError(f"not a kernel pack manifest (format {format_name!r})")
    version = reader.count("format_version")
    if version != FORMAT_VERSION:
        raise PackError(f"kernel pack format version {version} is not supported (expected {FORMAT_VERSION})")
    return PackManifest(
        vllm_version=reader.text("vllm_version"),
        vllm_wheel=_digest(reader.obj("vllm_wheel")),
        torch_pin=reader.text("torch_pin"),
        cuda_major=reader.opt_count("cuda_major"),
        arch=reader.opt_text("arch"),
        libraries=tuple(_library(item) for item in reader.objs("libraries")),
        python_files=reader.count("python_files"),
        tree_files=reader.count("tree_files"),
        extra_wheels=tuple(_wheel(item) for item in reader.objs("extra_wheels")),
        files=tuple(_digest(item) for item in reader.objs("files")),
        created_by=reader.text("created_by"),
        format=format_name,
        format_version=version,
    )
