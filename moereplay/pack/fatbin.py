"""CUDA fat binaries (the ``.nv_fatbin`` section of a CUDA library): walk their entries and blank the ones a GPU
architecture does not need, without moving a single byte.

Layout (little-endian), checked against both libraries of the vllm-0.25.1 wheel and public notes on the format:

- The section is a run of **containers**, back to back. A container header is 16 bytes:
  ``magic u32 = 0xBA55ED50, version u16 = 1, header_size u16 = 16, body_size u64`` and its ``body_size`` bytes of
  entries follow.
- Each **entry** starts with its own header of ``header_size`` bytes (64, 80 or 112 seen), followed by
  ``payload_size`` bytes (a multiple of 8) of payload. Fields used here, by byte offset in the entry header:
  ``0 kind u16`` (1 = PTX text, 2 = ELF cubin), ``4 header_size u32``, ``8 payload_size u64``,
  ``16 data_size u32`` (payload bytes in use; the rest is padding), ``24 minor u16``, ``26 major u16`` (the
  entry format version), ``28 arch u32`` (SM number: 75, 80, 90, 120 …), ``40 flags u64`` (bit 15 set: payload is
  compressed), ``56 uncompressed_size u64``.

A container is one CUDA module (one compilation unit's kernels). Loading it, the CUDA driver picks for the running
GPU a cubin built for it (same major architecture, minor not above the GPU's) and only when the container holds no
such cubin JIT-compiles PTX of an architecture not above the GPU's; every other entry is never read. Slimming for
one architecture therefore zeroes two kinds of payload and keeps every header, so offsets, sizes and the file
length stay identical while the zeros compress to nothing:

- ``other-arch``: cubins that cannot run on the architecture, and PTX newer than it;
- ``beside-cubin``: PTX that could be JIT-compiled for it, in a container that also holds a cubin that runs on it
  (the driver loads that cubin; the PTX would be read only with ``CUDA_FORCE_PTX_JIT=1``, which a slimmed pack
  does not support).

PTX in a container with no usable cubin (vLLM 0.25.1's Marlin MoE modules reach Hopper only this way) is kept.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

from moereplay.errors import PackError

FATBIN_MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")
_ENTRY_MIN_HEADER = 64
_ENTRY_FIXED = struct.Struct("<HHIQIIHHI")  # kind … arch: the first 32 bytes
_FLAGS = struct.Struct("<Q")
FLAG_COMPRESSED = 1 << 15


class EntryKind(IntEnum):
    """What an entry's payload holds."""

    PTX = 1
    CUBIN = 2


@dataclass(frozen=True)
class FatbinEntry:
    """One entry of a fatbin container; offsets are absolute in the buffer that was walked."""

    container_offset: int
    offset: int
    kind: int
    header_size: int
    payload_size: int
    data_size: int
    arch: int
    flags: int

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_size

    @property
    def kind_name(self) -> str:
        try:
            return EntryKind(self.kind).name.lower()
        except ValueError:
            return f"kind{self.kind}"

    def runs_on(self, arch: int) -> bool:
        """Whether the driver may use this entry on a GPU of SM ``arch`` (e.g. 90).

        A cubin runs on GPUs of its own major architecture and a minor not below its own (sm_80 code runs on
        sm_86, never on sm_90); PTX is compiled for any GPU not older than its architecture.
        """
        if self.kind == EntryKind.CUBIN:
            return self.arch // 10 == arch // 10 and self.arch <= arch
        if self.kind == EntryKind.PTX:
            return self.arch <= arch
        return False


def parse_arch(text: str) -> int:
    """``"sm_90"``, ``"sm_90a"``, ``"90"`` or ``"9.0"`` → 90."""
    cleaned = text.strip().lower().removeprefix("sm_").removeprefix("compute_").rstrip("af")
    if "." in cleaned:
        major, _, minor = cleaned.partition(".")
        cleaned = major + minor
    if not cleaned.isdigit() or not 30 <= int(cleaned) <= 1999:
        raise PackError(f"cannot read GPU architecture {text!r} (expected e.g. sm_90)")
    return int(cleaned)


def _entries(data: bytes | bytearray | memoryview, start: int, end: int) -> Iterator[FatbinEntry]:
    offset = start
    while offset < end:
        if offset + _CONTAINER.size > end:
            tail = bytes(data[offset:end])
            if tail.strip(b"\0"):
                raise PackError(f"fatbin: {end - offset} stray bytes at offset {offset:#x}")
            return
        magic, _version, header_size, body_size = _CONTAINER.unpack_from(data, offset)
        if magic != FATBIN_MAGIC:
            if magic == 0 and not bytes(data[offset : offset + 8]).strip(b"\0"):
                offset += 8  # zero padding between containers
                continue
            raise PackError(f"fatbin: bad container magic {magic:#010x} at offset {offset:#x}")
        if header_size < _CONTAINER.size:
            raise PackError(f"fatbin: container header size {header_size} at offset {offset:#x}")
        container = offset
        entry = offset + header_size
        container_end = entry + body_size
        if container_end > end:
            raise PackError(f"fatbin: container at offset {offset:#x} runs past the end of its section")
        while entry < container_end:
            if entry + _ENTRY_MIN_HEADER > container_end:
                raise PackError(f"fatbin: truncated entry header at offset {entry:#x}")
            kind, _version, entry_header, payload, data_size, _r, _minor, _major, arch = (
                _ENTRY_FIXED.unpack_from(data, entry)
            )
            (flags,) = _FLAGS.unpack_from(data, entry + 40)
            if entry_header < _ENTRY_MIN_HEADER or entry + entry_header + payload > container_end:
                raise PackError(f"fatbin: entry at offset {entry:#x} overruns its container")
            if data_size > payload:
                raise PackError(f"fatbin: entry at offset {entry:#x} claims {data_size} bytes in {payload}")
            yield FatbinEntry(container, entry, kind, entry_header, payload, data_size, arch, flags)
            entry += entry_header + payload
        offset = container_end


def walk_fatbin(
    data: bytes | bytearray | memoryview, start: int = 0, end: int | None = None
) -> list[FatbinEntry]:
    """Every entry of the containers in ``data[start:end]`` (a ``.nv_fatbin`` section's extent), in order."""
    stop = len(data) if end is None else end
    if not 0 <= start <= stop <= len(data):
        raise PackError(f"fatbin: range {start}..{stop} lies outside a buffer of {len(data)} bytes")
    return list(_entries(data, start, stop))


#: Why :func:`slim_fatbin` zeroed an entry (see the module docstring).
DropReason = Literal["other-arch", "beside-cubin"]
DROP_REASONS: tuple[DropReason, ...] = ("other-arch", "beside-cubin")


@dataclass(frozen=True)
class EntryTally:
    """How many entries of one kind and architecture a library held, and how many were zeroed, and why.

    ``reason`` is None when none was zeroed. The reason is a function of kind and architecture alone (a cubin or
    PTX is ``other-arch`` by its arch; only PTX that runs on the kept arch can be ``beside-cubin``), so one tally
    never mixes two reasons.
    """

    kind: str
    arch: int
    found: int
    zeroed: int
    found_bytes: int
    zeroed_bytes: int
    reason: DropReason | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.zeroed <= self.found and 0 <= self.zeroed_bytes <= self.found_bytes):
            raise PackError(f"fatbin tally {self.kind} sm_{self.arch}: more zeroed than found")
        if (self.reason is None) != (self.zeroed == 0):
            raise PackError(
                f"fatbin tally {self.kind} sm_{self.arch}: zeroed entries need a reason, and only they"
            )


@dataclass(frozen=True)
class SlimResult:
    """What :func:`slim_fatbin` did to one buffer."""

    keep_arch: int
    containers: int
    tallies: tuple[EntryTally, ...]
    containers_without_code: int
    """Containers with no entry usable on ``keep_arch`` (before and after slimming: slimming never changes it)."""
    containers_ptx_only: int = 0
    """Containers whose only code for ``keep_arch`` is PTX: the driver JIT-compiles them at their first launch."""

    @property
    def entries_zeroed(self) -> int:
        return sum(tally.zeroed for tally in self.tallies)

    @property
    def bytes_zeroed(self) -> int:
        return sum(tally.zeroed_bytes for tally in self.tallies)

    def bytes_zeroed_for(self, reason: DropReason) -> int:
        return sum(tally.zeroed_bytes for tally in self.tallies if tally.reason == reason)


def _drop_reason(entry: FatbinEntry, keep_arch: int, container_has_cubin: bool) -> DropReason | None:
    if entry.kind not in (EntryKind.PTX, EntryKind.CUBIN):
        return None  # unknown kinds are kept: we cannot tell whether the driver reads them
    if not entry.runs_on(keep_arch):
        return "other-arch"
    if entry.kind == EntryKind.PTX and container_has_cubin:
        return "beside-cubin"
    return None


def slim_fatbin(data: bytearray, keep_arch: int, start: int = 0, end: int | None = None) -> SlimResult:
    """Zero, in place, the payload of every entry in ``data[start:end]`` the driver never reads on SM ``keep_arch``.

    Kept: cubins that run on ``keep_arch`` (for sm_90 exactly the sm_90 cubins), PTX up to ``keep_arch`` in
    containers without such a cubin, every header, and entries of kinds this module does not know. Zeroed, with
    the reason recorded in the tallies: everything else (see the module docstring). The buffer's length never
    changes.
    """
    entries = walk_fatbin(data, start, end)
    by_container: dict[int, list[FatbinEntry]] = {}
    for entry in entries:
        by_container.setdefault(entry.container_offset, []).append(entry)
    found: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], DropReason] = {}
    without_code = ptx_only = 0
    for members in by_container.values():
        has_cubin = any(e.kind == EntryKind.CUBIN and e.runs_on(keep_arch) for e in members)
        if not any(e.runs_on(keep_arch) for e in members):
            without_code += 1
        elif not has_cubin:
            ptx_only += 1
        for entry in members:
            key = (entry.kind_name, entry.arch)
            counts = found.setdefault(key, [0, 0, 0, 0])
            counts[0] += 1
            counts[2] += entry.payload_size
            reason = _drop_reason(entry, keep_arch, has_cubin)
            if reason is None:
                continue
            reasons[key] = reason  # one reason per (kind, arch): see EntryTally
            data[entry.payload_offset : entry.payload_offset + entry.payload_size] = bytes(entry.payload_size)
            counts[1] += 1
            counts[3] += entry.payload_size
    tallies = tuple(
        EntryTally(
            kind=kind,
            arch=arch,
            found=c[0],
            zeroed=c[1],
            found_bytes=c[2],
            zeroed_bytes=c[3],
            reason=reasons.get((kind, arch)),
        )
        for (kind, arch), c in sorted(found.items())
    )
    return SlimResult(
        keep_arch=keep_arch,
        containers=len(by_container),
        tallies=tallies,
        containers_without_code=without_code,
        containers_ptx_only=ptx_only,
    )
