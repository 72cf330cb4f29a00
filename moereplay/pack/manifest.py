"""The kernel pack manifest (``manifest.json``): what a pack holds and what it needs to run.

Layout of a pack directory, for either profile (:mod:`moereplay.pack.profiles`)::

    DIR/manifest.json   this file
    DIR/tree.tar.xz     files taken from the vLLM wheel, at their paths in it. ``kernels``: vllm/**/*.py (+ json
                        configs, py.typed), vllm-X.dist-info/, the two CUDA libraries. ``serve``: the
                        FlashAttention-3 library only
    DIR/deps.tar.xz     the extra wheels, unpacked as ``pip install --no-deps --target`` would

A ``serve`` pack completes the ``kernels`` pack built from the same vLLM wheel (same sha256) for ``vllm serve``.
The manifest is plain JSON with a format version; reading one checks every field's type so a damaged or foreign
file fails with one clear :class:`~moereplay.errors.PackError` line. Version 1 manifests (kernels packs built
before profiles and drop reasons existed) are still read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, cast

from moereplay.errors import PackError
from moereplay.pack.fatbin import DROP_REASONS, DropReason, EntryTally

MANIFEST_NAME = "manifest.json"
TREE_ARCHIVE = "tree.tar.xz"
DEPS_ARCHIVE = "deps.tar.xz"
FORMAT = "moereplay-kernel-pack"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)

WheelPurpose = Literal["vllm-import", "moereplay-runtime", "vllm-serve", "extra"]
WHEEL_PURPOSES: tuple[WheelPurpose, ...] = ("vllm-import", "moereplay-runtime", "vllm-serve", "extra")

ProfileName = Literal["kernels", "serve"]
PROFILE_NAMES: tuple[ProfileName, ...] = ("kernels", "serve")


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
    containers_ptx_only: int = 0
    """Containers that reach the pack's arch only through PTX (JIT-compiled by the driver at first launch)."""

    @property
    def entries_zeroed(self) -> int:
        return sum(tally.zeroed for tally in self.entries)

    @property
    def bytes_zeroed(self) -> int:
        return sum(tally.zeroed_bytes for tally in self.entries)


@dataclass(frozen=True)
class ExtraWheel:
    """A wheel unpacked into ``deps.tar.xz``; ``dropped`` lists patterns of its files left out (why: in
    ``download.DROPPED_FILES``), ``debug_bytes_blanked`` the DWARF bytes emptied in its ELF libraries."""

    file: str
    name: str
    version: str
    python: str
    abi: str
    platform: str
    sha256: str
    purpose: WheelPurpose
    dropped: tuple[str, ...] = ()
    debug_bytes_blanked: int = 0


@dataclass(frozen=True)
class PackManifest:
    """Everything a pack records about itself. ``arch`` is e.g. ``"sm_90"``, or None for unslimmed libraries.

    ``vllm_version``, ``vllm_wheel`` and ``torch_pin`` say which vLLM build (and so which torch) the pack belongs
    to, whatever its ``profile``; a serve pack pairs only with the kernels pack of the same wheel.
    """

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
    profile: ProfileName = "kernels"
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise PackError(f"not a kernel pack manifest (format {self.format!r})")
        if self.format_version not in _READABLE_VERSIONS:
            raise PackError(
                f"kernel pack format version {self.format_version} is not supported (expected {FORMAT_VERSION})"
            )
        if self.profile not in PROFILE_NAMES:
            raise PackError(
                f"pack profile {self.profile!r} is unknown (expected one of {', '.join(PROFILE_NAMES)})"
            )

    @property
    def label(self) -> str:
        """``vLLM 0.25.1 kernel pack`` / ``vLLM 0.25.1 serve pack``: how messages name it."""
        return f"vLLM {self.vllm_version} {'kernel' if self.profile == 'kernels' else self.profile} pack"

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


def _tally(reader: _Reader, version: int) -> EntryTally:
    zeroed = reader.count("zeroed")
    if version == 1:  # version 1 zeroed only entries that cannot run on the pack's arch
        reason: str | None = "other-arch" if zeroed else None
    else:
        reason = reader.opt_text("reason")
    if reason is not None and reason not in DROP_REASONS:
        raise PackError(f"manifest: {reader.where}.reason {reason!r} is unknown")
    try:
        return EntryTally(
            kind=reader.text("kind"),
            arch=reader.count("arch"),
            found=reader.count("found"),
            zeroed=zeroed,
            found_bytes=reader.count("found_bytes"),
            zeroed_bytes=reader.count("zeroed_bytes"),
            reason=cast(DropReason | None, reason),
        )
    except PackError as error:
        raise PackError(f"manifest: {reader.where}: {error}") from error


def _library(reader: _Reader, version: int) -> LibraryRecord:
    return LibraryRecord(
        member=reader.text("member"),
        size=reader.count("size"),
        sha256=reader.text("sha256"),
        cuda_major=reader.opt_count("cuda_major"),
        slimmed=reader.flag("slimmed"),
        containers=reader.count("containers"),
        containers_without_code=reader.count("containers_without_code"),
        entries=tuple(_tally(item, version) for item in reader.objs("entries")),
        containers_ptx_only=reader.count("containers_ptx_only") if version >= 2 else 0,
    )


def _wheel(reader: _Reader, version: int) -> ExtraWheel:
    purpose = reader.text("purpose")
    if purpose not in WHEEL_PURPOSES:
        raise PackError(f"manifest: {reader.where}.purpose {purpose!r} is unknown")
    return ExtraWheel(
        file=reader.text("file"),
        name=reader.text("name"),
        version=reader.text("version"),
        python=reader.text("python"),
        abi=reader.text("abi"),
        platform=reader.text("platform"),
        sha256=reader.text("sha256"),
        purpose=purpose,
        dropped=reader.texts("dropped"),
        debug_bytes_blanked=reader.count("debug_bytes_blanked") if version >= 2 else 0,
    )


def _manifest(reader: _Reader) -> PackManifest:
    format_name = reader.text("format")
    if format_name != FORMAT:
        raise PackError(f"not a kernel pack manifest (format {format_name!r})")
    version = reader.count("format_version")
    if version not in _READABLE_VERSIONS:
        raise PackError(f"kernel pack format version {version} is not supported (expected {FORMAT_VERSION})")
    profile = reader.text("profile") if version >= 2 else "kernels"
    if profile not in PROFILE_NAMES:
        raise PackError(f"manifest: manifest.profile {profile!r} is unknown")
    return PackManifest(
        vllm_version=reader.text("vllm_version"),
        vllm_wheel=_digest(reader.obj("vllm_wheel")),
        torch_pin=reader.text("torch_pin"),
        cuda_major=reader.opt_count("cuda_major"),
        arch=reader.opt_text("arch"),
        libraries=tuple(_library(item, version) for item in reader.objs("libraries")),
        python_files=reader.count("python_files"),
        tree_files=reader.count("tree_files"),
        extra_wheels=tuple(_wheel(item, version) for item in reader.objs("extra_wheels")),
        files=tuple(_digest(item) for item in reader.objs("files")),
        created_by=reader.text("created_by"),
        profile=cast(ProfileName, profile),
        format=format_name,
        format_version=version,
    )
