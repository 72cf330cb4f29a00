"""ELF section table, DT_NEEDED, fatbin walking and slimming on synthetic but real ELF64 files."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packfakes import FakeEntry, build_library, fatbin_container, library_with_debug_info, sample_fatbin

from moereplay.errors import PackError
from moereplay.pack.elf import SHT_NOBITS, blank_debug_sections, needed_libraries, parse_elf
from moereplay.pack.fatbin import EntryKind, EntryTally, parse_arch, slim_fatbin, walk_fatbin
from moereplay.pack.libraries import cuda_major, fatbin_inventory, slim_library


def test_section_table_and_needed_libraries() -> None:
    fatbin = sample_fatbin()
    library = build_library(fatbin)
    elf = parse_elf(library)
    names = [section.name for section in elf.sections]
    assert names == ["", ".text", ".nv_fatbin", ".dynstr", ".dynamic", ".shstrtab"]
    section = elf.section(".nv_fatbin")
    assert section is not None
    assert library[section.offset : section.end] == fatbin
    assert elf.section(".missing") is None
    assert needed_libraries(library) == ("libtorch.so", "libcudart.so.13")
    assert cuda_major(library) == 13
    assert cuda_major(build_library(fatbin, needed=("libc.so.6",))) is None


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf not installed")
def test_synthetic_elf_is_readable_by_readelf() -> None:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".so") as handle:
        handle.write(build_library(sample_fatbin()))
        handle.flush()
        listing = subprocess.run(["readelf", "-SW", handle.name], capture_output=True, text=True, check=True)
    assert ".nv_fatbin" in listing.stdout


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda data: b"\x7fELG" + data[4:], "bad magic"),
        (lambda data: data[:4] + b"\x01" + data[5:], "ELF64"),
        (lambda data: data[:200], "section table runs past"),
        (lambda data: b"", "bad magic"),
    ],
)
def test_malformed_elf_is_refused(mutate, message) -> None:
    with pytest.raises(PackError, match=message):
        parse_elf(mutate(build_library(sample_fatbin())))


def test_walk_reads_kinds_archs_and_offsets() -> None:
    data = sample_fatbin()
    entries = walk_fatbin(data)
    assert [(entry.kind_name, entry.arch) for entry in entries] == [
        ("cubin", 75), ("cubin", 80), ("cubin", 90), ("cubin", 100), ("ptx", 80), ("ptx", 90),
        ("cubin", 86), ("cubin", 120), ("ptx", 100),
        ("cubin", 80), ("ptx", 80),
    ]  # fmt: skip
    first = entries[0]
    assert first.container_offset == 0 and first.offset == 16 and first.header_size == 64
    assert data[first.payload_offset : first.payload_offset + first.data_size] == b"A" * 40
    assert first.payload_size == 40 and entries[1].payload_size == 40 and entries[1].data_size == 33
    assert entries[3].header_size == 112
    assert len({entry.container_offset for entry in entries}) == 3


def test_runs_on_follows_cuda_compatibility() -> None:
    entries = {(entry.kind_name, entry.arch): entry for entry in walk_fatbin(sample_fatbin())}
    assert entries["cubin", 90].runs_on(90)
    assert not entries["cubin", 80].runs_on(90)  # sm_80 SASS never runs on Hopper
    assert entries["cubin", 80].runs_on(86) and entries["cubin", 80].runs_on(89)
    assert not entries["cubin", 86].runs_on(80)
    assert entries["ptx", 80].runs_on(90) and not entries["ptx", 100].runs_on(90)


#: What slimming sample_fatbin() for sm_90 zeroes, by (container, kind, arch), and why.
SAMPLE_DROPS = {
    (0, "cubin", 75): "other-arch", (0, "cubin", 80): "other-arch", (0, "cubin", 100): "other-arch",
    (0, "ptx", 80): "beside-cubin", (0, "ptx", 90): "beside-cubin",
    (1, "cubin", 86): "other-arch", (1, "cubin", 120): "other-arch", (1, "ptx", 100): "other-arch",
    (2, "cubin", 80): "other-arch",
}  # fmt: skip


def test_slim_keeps_what_the_driver_loads_and_all_headers() -> None:
    original = sample_fatbin()
    data = bytearray(original)
    result = slim_fatbin(data, 90)
    assert len(data) == len(original)
    containers = sorted({entry.container_offset for entry in walk_fatbin(original)})
    for before, after in zip(walk_fatbin(original), walk_fatbin(bytes(data)), strict=True):
        assert before == after  # headers untouched: same fields at the same offsets
        header = slice(before.offset, before.payload_offset)
        assert data[header] == original[header]
        payload = slice(before.payload_offset, before.payload_offset + before.payload_size)
        key = (containers.index(before.container_offset), before.kind_name, before.arch)
        if key in SAMPLE_DROPS:
            assert not any(data[payload]), key
        else:
            assert data[payload] == original[payload], key
    # kept: the sm_90 cubin, and the sm_80 PTX of the container with no sm_90 cubin (JIT-compiled on Hopper)
    assert result.entries_zeroed == len(SAMPLE_DROPS) == 9
    assert result.containers == 3 and result.containers_without_code == 1 and result.containers_ptx_only == 1
    tally = {(item.kind, item.arch): item for item in result.tallies}
    assert tally["cubin", 80] == EntryTally("cubin", 80, found=2, zeroed=2, found_bytes=64, zeroed_bytes=64,
                                            reason="other-arch")  # fmt: skip
    assert tally["ptx", 80] == EntryTally("ptx", 80, found=2, zeroed=1, found_bytes=32, zeroed_bytes=16,
                                          reason="beside-cubin")  # fmt: skip
    assert tally["ptx", 90].reason == "beside-cubin" and tally["ptx", 100].reason == "other-arch"
    assert tally["cubin", 90].zeroed == 0 and tally["cubin", 90].reason is None
    assert result.bytes_zeroed_for("beside-cubin") == 16 + 8
    assert result.bytes_zeroed_for("other-arch") == 40 + 40 + 56 + 16 + 16 + 8 + 24
    assert result.bytes_zeroed == result.bytes_zeroed_for("beside-cubin") + result.bytes_zeroed_for(
        "other-arch"
    )


def test_tally_reason_goes_with_zeroed_entries() -> None:
    with pytest.raises(PackError, match="need a reason"):
        EntryTally("ptx", 80, found=1, zeroed=1, found_bytes=8, zeroed_bytes=8)
    with pytest.raises(PackError, match="need a reason"):
        EntryTally("ptx", 80, found=1, zeroed=0, found_bytes=8, zeroed_bytes=0, reason="beside-cubin")
    with pytest.raises(PackError, match="more zeroed than found"):
        EntryTally("ptx", 80, found=1, zeroed=2, found_bytes=8, zeroed_bytes=8, reason="other-arch")


def test_slimming_for_an_older_arch_keeps_ptx_where_no_cubin_fits() -> None:
    data = bytearray(sample_fatbin())
    result = slim_fatbin(data, 80)
    tally = {(item.kind, item.arch): item for item in result.tallies}
    # on sm_80 the sm_80 cubins run, so the sm_80 PTX beside them is dead; sm_86 cubins cannot run on sm_80
    assert tally["ptx", 80].zeroed == 2 and tally["ptx", 80].reason == "beside-cubin"
    assert tally["cubin", 86].reason == "other-arch" and tally["cubin", 80].zeroed == 0
    assert result.containers_without_code == 1 and result.containers_ptx_only == 0


def test_blank_debug_sections_empties_dwarf_only() -> None:
    original = library_with_debug_info()
    data = bytearray(original)
    before = {section.name: section for section in parse_elf(original).sections}
    blanked = blank_debug_sections(data)
    after = {section.name: section for section in parse_elf(bytes(data)).sections}
    assert blanked == before[".debug_info"].size + before[".debug_str"].size == 200 + 30
    assert len(data) == len(original)
    for name in (".debug_info", ".debug_str"):
        section = before[name]
        assert after[name].type == SHT_NOBITS and after[name].offset == section.offset
        assert not any(data[section.offset : section.end])
    text = before[".text"]
    assert data[text.offset : text.end] == original[text.offset : text.end] and after[".text"] == text
    changed = [index for index, (old, new) in enumerate(zip(original, data, strict=True)) if old != new]
    debug = [range(before[name].offset, before[name].end) for name in (".debug_info", ".debug_str")]
    table = parse_elf(original).section_table
    type_fields = {table + before[name].index * 64 + 4 for name in (".debug_info", ".debug_str")}
    assert all(any(index in span for span in debug) or index in type_fields for index in changed)
    assert blank_debug_sections(data) == 0  # already blank: nothing left to do
    assert blank_debug_sections(bytearray(build_library(sample_fatbin()))) == 0


def test_slim_library_changes_only_fatbin_payloads() -> None:
    library = build_library(sample_fatbin())
    slim, report = slim_library("vllm/_moe_C.so", library, 90)
    assert len(slim) == len(library) and slim != library
    assert report.cuda_major == 13 and report.slim is not None and report.slim.entries_zeroed == 9
    section = parse_elf(library).section(".nv_fatbin")
    assert section is not None
    assert (
        slim[: section.offset] == library[: section.offset] and slim[section.end :] == library[section.end :]
    )
    assert fatbin_inventory(slim) == fatbin_inventory(library)
    whole, report = slim_library("vllm/_moe_C.so", library, None)
    assert whole == library and report.slim is None


def test_slim_library_without_fatbin_is_refused() -> None:
    from packfakes import SHT_PROGBITS, build_elf

    with pytest.raises(PackError, match=re.escape("no .nv_fatbin")):
        slim_library("x.so", build_elf([(".text", SHT_PROGBITS, b"\0" * 8, 0)]), 90)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (struct.pack("<IHHQ", 0x12345678, 1, 16, 0), "bad container magic"),
        (struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 500), "runs past the end"),
        (fatbin_container([FakeEntry(2, 90, b"x" * 8)])[:-8] + bytes(8), None),
    ],
)
def test_malformed_fatbin(data: bytes, message: str | None) -> None:
    if message is None:
        assert len(walk_fatbin(data)) == 1
        return
    with pytest.raises(PackError, match=message):
        walk_fatbin(data)


def test_entry_overrunning_its_container_is_refused() -> None:
    container = bytearray(fatbin_container([FakeEntry(2, 90, b"x" * 8)]))
    struct.pack_into("<Q", container, 16 + 8, 4096)  # payload size beyond the container
    with pytest.raises(PackError, match="overruns its container"):
        walk_fatbin(bytes(container))


def test_zero_padding_between_containers_is_skipped() -> None:
    one = fatbin_container([FakeEntry(1, 80, b"p" * 8)])
    assert len(walk_fatbin(one + bytes(16) + one)) == 2


@pytest.mark.parametrize(
    ("text", "arch"), [("sm_90", 90), ("sm_90a", 90), ("90", 90), ("9.0", 90), ("SM_120", 120)]
)
def test_parse_arch(text: str, arch: int) -> None:
    assert parse_arch(text) == arch


@pytest.mark.parametrize("text", ["", "hopper", "sm_9x", "sm_5"])
def test_parse_arch_rejects(text: str) -> None:
    with pytest.raises(PackError, match="architecture"):
        parse_arch(text)


entry_strategy = st.builds(
    FakeEntry,
    kind=st.sampled_from([EntryKind.PTX, EntryKind.CUBIN, 16]),
    arch=st.sampled_from([75, 80, 86, 89, 90, 100, 120]),
    payload=st.binary(min_size=1, max_size=40).map(lambda raw: raw.replace(b"\0", b"\1")),
    header_size=st.sampled_from([64, 80, 112]),
)


@settings(max_examples=60, deadline=None)
@given(containers=st.lists(st.lists(entry_strategy, min_size=1, max_size=6), min_size=1, max_size=4),
       keep=st.sampled_from([80, 86, 90, 120]))  # fmt: skip
def test_slimming_property(containers: list[list[FakeEntry]], keep: int) -> None:
    original = b"".join(fatbin_container(entries) for entries in containers)
    data = bytearray(original)
    result = slim_fatbin(data, keep)
    assert len(data) == len(original)
    flat = [(index, entry) for index, entries in enumerate(containers) for entry in entries]
    assert sum(tally.found for tally in result.tallies) == len(flat)
    has_cubin = [any(e.kind == EntryKind.CUBIN and _runs(e, keep) for e in entries) for entries in containers]
    for (index, fake), entry in zip(flat, walk_fatbin(bytes(data)), strict=True):
        payload = bytes(data[entry.payload_offset : entry.payload_offset + entry.data_size])
        needed = entry.kind not in (1, 2) or (
            entry.runs_on(keep) and not (entry.kind == EntryKind.PTX and has_cubin[index])
        )
        assert payload == (fake.payload if needed else bytes(len(fake.payload)))
    assert result.containers_without_code + result.containers_ptx_only <= len(containers)


def _runs(entry: FakeEntry, keep: int) -> bool:
    return entry.arch // 10 == keep // 10 and entry.arch <= keep
