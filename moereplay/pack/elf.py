"""Just enough of ELF64 (little-endian) to find a shared library's sections and its ``DT_NEEDED`` names.

Kernel packs slim vLLM's CUDA libraries by editing bytes inside one section (``.nv_fatbin``), so they need the
section table, nothing more: no segments, symbols or relocations. Written from the System V gABI: the ELF header
holds ``e_shoff`` at byte 0x28 and ``e_shentsize, e_shnum, e_shstrndx`` at 0x3A; each 64-byte section header is
``name u32, type u32, flags u64, addr u64, offset u64, size u64, link u32, info u32, addralign u64, entsize u64``.

Every offset read is bounds-checked; a malformed file raises :class:`~moereplay.errors.PackError`.
Cost: one pass over the section table (tens of entries), no copy of the file.

:func:`blank_debug_sections` also writes: it empties the DWARF sections of a library some wheels ship unstripped
(xgrammar 0.2.3's bindings: 53 MB, 50 MB of it ``.debug_*``), in place and without moving a byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from moereplay.errors import PackError

ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # e_ident … e_shstrndx, 64 bytes
_SECTION = struct.Struct("<IIQQQQIIQQ")  # one Elf64_Shdr, 64 bytes
_DYN = struct.Struct("<qQ")  # one Elf64_Dyn: d_tag, d_val
SHT_NOBITS = 8
SHF_ALLOC = 0x2
DT_NULL = 0
DT_NEEDED = 1


@dataclass(frozen=True)
class Section:
    """One ELF section: its name and where its bytes lie in the file (``offset``, ``size`` in bytes).

    ``index`` is its position in the section table, ``flags`` its ``sh_flags`` (``SHF_ALLOC``: loaded at run time).
    """

    name: str
    type: int
    offset: int
    size: int
    link: int
    index: int = 0
    flags: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class ElfFile:
    """The section table of one ELF64 little-endian file; ``section_table`` is its file offset (``e_shoff``)."""

    sections: tuple[Section, ...]
    section_table: int = 0

    def section(self, name: str) -> Section | None:
        """The first section called ``name``, or None."""
        for section in self.sections:
            if section.name == name:
                return section
        return None


def _c_string(data: bytes | bytearray | memoryview, start: int, limit: int, what: str) -> str:
    if not 0 <= start < limit:
        raise PackError(f"ELF {what} offset {start} lies outside its string table")
    end = bytes(data[start:limit]).find(b"\0")
    if end < 0:
        raise PackError(f"ELF {what} at offset {start} is not NUL-terminated")
    return bytes(data[start : start + end]).decode("utf-8", errors="replace")


def parse_elf(data: bytes | bytearray | memoryview) -> ElfFile:
    """Read the section table of an ELF64 little-endian file held in memory."""
    size = len(data)
    if size < _HEADER.size or bytes(data[:4]) != ELF_MAGIC:
        raise PackError("not an ELF file (bad magic)")
    ident = bytes(data[:16])
    if ident[4] != _ELFCLASS64 or ident[5] != _ELFDATA2LSB:
        raise PackError("only little-endian ELF64 files are supported")
    fields = _HEADER.unpack_from(data, 0)
    shoff, shentsize, shnum, shstrndx = fields[6], fields[11], fields[12], fields[13]
    if shnum == 0:
        return ElfFile(sections=())
    if shentsize != _SECTION.size:
        raise PackError(f"ELF section header size is {shentsize}, expected {_SECTION.size}")
    if shoff + shnum * shentsize > size:
        raise PackError("ELF section table runs past the end of the file")
    if shstrndx >= shnum:
        raise PackError(f"ELF section-name table index {shstrndx} is out of range ({shnum} sections)")
    raw = [_SECTION.unpack_from(data, shoff + index * shentsize) for index in range(shnum)]
    for _name_offset, kind, _flags, _addr, offset, length, *_ in raw:
        if kind != SHT_NOBITS and offset + length > size:
            raise PackError(
                f"ELF section at offset {offset:#x} (size {length}) runs past the end of the file"
            )
    names = raw[shstrndx]
    names_start, names_end = names[4], names[4] + names[5]
    sections = tuple(
        Section(
            name=_c_string(data, names_start + entry[0], names_end, "section name"),
            type=entry[1],
            offset=entry[4],
            size=entry[5],
            link=entry[6],
            index=index,
            flags=entry[2],
        )
        for index, entry in enumerate(raw)
    )
    return ElfFile(sections=sections, section_table=shoff)


def blank_debug_sections(data: bytearray) -> int:
    """Empty every DWARF section (``.debug_*``, not loaded at run time) of an ELF file in place; return the bytes
    blanked.

    Each such section's bytes become zeros and its type ``SHT_NOBITS``, so a debugger or a backtrace library finds
    no debug information rather than corrupt DWARF; code, data, symbols and every offset stay as they were (the
    dynamic loader never reads a section without ``SHF_ALLOC``). What ``strip --strip-debug`` achieves, minus the
    file getting shorter: the zeros compress to nothing.
    """
    elf = parse_elf(data)
    blanked = 0
    for section in elf.sections:
        if not section.name.startswith(".debug_") or section.flags & SHF_ALLOC or section.type == SHT_NOBITS:
            continue
        data[section.offset : section.end] = bytes(section.size)
        struct.pack_into("<I", data, elf.section_table + section.index * _SECTION.size + 4, SHT_NOBITS)
        blanked += section.size
    return blanked


def needed_libraries(data: bytes | bytearray | memoryview, elf: ElfFile | None = None) -> tuple[str, ...]:
    """The ``DT_NEEDED`` sonames of a shared library, in file order (e.g. ``libcudart.so.13``)."""
    elf = elf if elf is not None else parse_elf(data)
    dynamic = elf.section(".dynamic")
    if dynamic is None:
        return ()
    if dynamic.link >= len(elf.sections):
        raise PackError("ELF .dynamic section links to a missing string table")
    strings = elf.sections[dynamic.link]
    needed: list[str] = []
    for offset in range(dynamic.offset, dynamic.end - _DYN.size + 1, _DYN.size):
        tag, value = _DYN.unpack_from(data, offset)
        if tag == DT_NULL:
            break
        if tag == DT_NEEDED:
            needed.append(_c_string(data, strings.offset + value, strings.end, "DT_NEEDED name"))
    return tuple(needed)
