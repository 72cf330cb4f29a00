"""Byte-exact builders for the pack tests: tiny real ELF64 files with a ``.nv_fatbin`` section, fatbin containers,
wheels, and a complete fake vLLM wheel. Nothing here downloads anything."""

from __future__ import annotations

import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
SHT_PROGBITS, SHT_STRTAB, SHT_DYNAMIC = 1, 3, 6


@dataclass(frozen=True)
class FakeEntry:
    kind: int  # 1 PTX, 2 cubin
    arch: int
    payload: bytes
    header_size: int = 64

    def encode(self) -> bytes:
        padded = self.payload + bytes(-len(self.payload) % 8)
        header = bytearray(self.header_size)
        struct.pack_into("<HHIQIIHHI", header, 0, self.kind, 0x0101, self.header_size, len(padded),
                         len(self.payload), 0, 8, 1, self.arch)  # fmt: skip
        struct.pack_into("<Q", header, 40, 0x8011)
        struct.pack_into("<Q", header, 56, len(self.payload) * 3)
        return bytes(header) + padded


def fatbin_container(entries: list[FakeEntry]) -> bytes:
    body = b"".join(entry.encode() for entry in entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def build_elf(sections: list[tuple[str, int, bytes, int]]) -> bytes:
    """An ELF64 little-endian shared object holding ``sections`` (name, type, data, link) plus .shstrtab.

    Section data are laid out 8-byte aligned after the 64-byte header; the section table comes last.
    """
    names = b"\0"
    name_offsets = []
    for name, *_ in [*sections, (".shstrtab", SHT_STRTAB, b"", 0)]:
        name_offsets.append(len(names))
        names += name.encode() + b"\0"
    all_sections = [*sections, (".shstrtab", SHT_STRTAB, names, 0)]
    body = bytearray(64)
    placed = []
    for _name, _kind, data, _link in all_sections:
        body += bytes(-len(body) % 8)
        placed.append((len(body), len(data)))
        body += data
    body += bytes(-len(body) % 8)
    shoff = len(body)
    table = bytearray(64)  # the null section
    for index, (_name, kind, _data, link) in enumerate(all_sections):
        offset, size = placed[index]
        flags = 0 if all_sections[index][0].startswith(".debug") else 2  # SHF_ALLOC, as a linker sets it
        table += struct.pack("<IIQQQQIIQQ", name_offsets[index], kind, flags, 0, offset, size, link, 0, 8,
                             16 if kind == SHT_DYNAMIC else 0)  # fmt: skip
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64,
                         len(all_sections) + 1, len(all_sections))  # fmt: skip
    body[:64] = header
    return bytes(body + table)


def build_library(fatbin: bytes, needed: tuple[str, ...] = ("libtorch.so", "libcudart.so.13")) -> bytes:
    """A shared library with a ``.text`` filler, a ``.nv_fatbin`` section and a ``.dynamic`` naming ``needed``."""
    dynstr = b"\0"
    dynamic = b""
    for name in needed:
        dynamic += struct.pack("<qQ", 1, len(dynstr))
        dynstr += name.encode() + b"\0"
    dynamic += struct.pack("<qQ", 0, 0)
    # section indices: 1 .text, 2 .nv_fatbin, 3 .dynstr, 4 .dynamic (links to 3)
    return build_elf(
        [
            (".text", SHT_PROGBITS, b"\x90" * 24, 0),
            (".nv_fatbin", SHT_PROGBITS, fatbin, 0),
            (".dynstr", SHT_STRTAB, dynstr, 0),
            (".dynamic", SHT_DYNAMIC, dynamic, 3),
        ]
    )


def sample_fatbin() -> bytes:
    """Three containers shaped like vLLM 0.25.1's: many cubins + PTX beside an sm_90 cubin, one with no sm_90 code
    at all, and one that reaches sm_90 only through sm_80 PTX (like the Marlin MoE modules)."""
    first = [
        FakeEntry(2, 75, b"A" * 40),
        FakeEntry(2, 80, b"B" * 33),
        FakeEntry(2, 90, b"C" * 20),
        FakeEntry(2, 100, b"D" * 50, header_size=112),
        FakeEntry(1, 80, b"ptx80 text", header_size=80),
        FakeEntry(1, 90, b"ptx90", header_size=80),
    ]
    second = [
        FakeEntry(2, 86, b"E" * 16),
        FakeEntry(2, 120, b"F" * 9, header_size=112),
        FakeEntry(1, 100, b"G" * 8),
    ]
    third = [FakeEntry(2, 80, b"H" * 24), FakeEntry(1, 80, b"marlin ptx", header_size=80)]
    return fatbin_container(first) + fatbin_container(second) + fatbin_container(third)


def sm90_fatbin() -> bytes:
    """Containers of sm_90 cubins only, like vLLM 0.25.1's FlashAttention-3 library."""
    return fatbin_container([FakeEntry(2, 90, b"fa3 kernel " * 3)]) + fatbin_container(
        [FakeEntry(2, 90, b"I" * 16)]
    )


def library_with_debug_info(code: bytes = b"\x90" * 32, debug: bytes = b"DWARF" * 40) -> bytes:
    """A shared library with ``.text`` and two unloaded DWARF sections, like an unstripped wheel library."""
    return build_elf(
        [
            (".text", SHT_PROGBITS, code, 0),
            (".debug_info", SHT_PROGBITS, debug, 0),
            (".debug_str", SHT_PROGBITS, b"names\0" * 5, 0),
        ]
    )


def write_wheel(path: Path, files: dict[str, bytes], metadata: str = "Metadata-Version: 2.1\n") -> Path:
    """A wheel file at ``path`` with ``files`` and a dist-info derived from the file name."""
    name, version = path.name.split("-")[:2]
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr(f"{dist_info}/METADATA", f"{metadata}Name: {name}\nVersion: {version}\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return path


def fake_vllm_wheel(
    directory: Path, version: str = "0.25.1", torch: str = "2.11.0", salt: bytes = b""
) -> Path:
    """A vLLM wheel with the members packs take; ``salt`` changes its bytes (and so its sha256) only."""
    library = build_library(sample_fatbin())
    files = {
        "vllm/__init__.py": b"__version__ = '0.25.1'\n" + salt,
        "vllm/_custom_ops.py": b"import torch\n",
        "vllm/entrypoints/cli/main.py": b"import sys\n\n\ndef main():\n    print('fake vllm cli', *sys.argv[1:])\n\n\n"
        b"if __name__ == '__main__':\n    main()\n",
        "vllm/model_executor/layers/fused_moe/configs/E=8,N=128.json": b"{}",
        "vllm/py.typed": b"",
        "vllm/third_party/triton_kernels/__init__.py": b"",
        "vllm/third_party/triton_kernels/matmul_ogs.py": b"VALUE = 7\n",
        "vllm/entrypoints/templates/chat.jinja": b"not taken",
        "vllm/_moe_C_stable_libtorch.abi3.so": library,
        "vllm/_C_stable_libtorch.abi3.so": library,
        "vllm/_flashmla_C.abi3.so": b"not taken",
        "vllm/vllm_flash_attn/__init__.py": b"",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": build_library(sm90_fatbin()),
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"not taken",
    }
    metadata = (
        "Metadata-Version: 2.1\n"
        f"Requires-Dist: torch=={torch}\n"
        "Requires-Dist: torchvision==0.26.0\n"
        'Requires-Dist: zentorch==2.11.0.0; extra == "zen"\n'
    )
    return write_wheel(directory / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl", files, metadata)


#: (file name, one module file) for every extra wheel a pack requires, named as pip saves them.
EXTRA_WHEELS: tuple[tuple[str, str], ...] = (
    ("annotated_types-0.8.0-py3-none-any.whl", "annotated_types/__init__.py"),
    ("cbor2-6.3.0-cp312-cp312-manylinux_2_28_x86_64.whl", "cbor2/__init__.py"),
    ("distro-1.9.0-py3-none-any.whl", "distro/__init__.py"),
    ("jiter-0.19.0-cp312-cp312-manylinux_2_17_x86_64.whl", "jiter/__init__.py"),
    ("openai-3.57.0-py3-none-any.whl", "openai/__init__.py"),
    ("openai_harmony-0.0.8-cp38-abi3-manylinux_2_17_x86_64.whl", "openai_harmony/__init__.py"),
    ("pydantic-2.14.4-py3-none-any.whl", "pydantic/__init__.py"),
    ("pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl", "pydantic_core/__init__.py"),
    ("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", "zmq/__init__.py"),
    ("typing_inspection-0.4.5-py3-none-any.whl", "typing_inspection/__init__.py"),
    ("httpx2-2.16.2-py3-none-any.whl", "httpx2/__init__.py"),
    ("httpcore2-2.16.2-py3-none-any.whl", "httpcore2/__init__.py"),
    ("truststore-0.10.5-py3-none-any.whl", "truststore/__init__.py"),
    ("sniffio-1.3.1-py3-none-any.whl", "sniffio/__init__.py"),
    ("msgspec-0.23.0-cp312-cp312-manylinux_2_17_x86_64.whl", "msgspec/__init__.py"),
    ("zstandard-0.25.0-cp312-cp312-manylinux_2_17_x86_64.whl", "zstandard/__init__.py"),
)


def fake_serve_wheels(directory: Path) -> Path:
    """One small wheel per serve-pack requirement, named as pip saves them; xgrammar's holds an unstripped
    library and a static library (dropped), as the real 0.2.3 wheel does."""
    from moereplay.pack.download import VLLM_SERVE_REQUIREMENTS

    directory.mkdir(parents=True, exist_ok=True)
    for requirement in VLLM_SERVE_REQUIREMENTS:
        name, version = requirement.split("==")
        module = name.replace("-", "_")
        files = {f"{module}/__init__.py": f"NAME = {name!r}\n".encode()}
        if name == "xgrammar":
            files["xgrammar/libxgrammar_bindings.so"] = library_with_debug_info()
            files["xgrammar/lib/libxgrammar.a"] = b"!<arch>\n dropped"
        write_wheel(directory / f"{module}-{version}-py3-none-any.whl", files)
    return directory


def fake_extra_wheels(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for file_name, module in EXTRA_WHEELS:
        files = {module: b"# fake\n"}
        if file_name.startswith("zstandard"):
            files["zstandard/_cffi.cpython-312-x86_64-linux-gnu.so"] = b"dropped"
        if file_name.startswith("pyzmq"):
            files["pyzmq-27.3.0.data/purelib/zmq/extra.py"] = b"# from .data/purelib\n"
            files["pyzmq-27.3.0.data/scripts/zmq-tool"] = b"#!/bin/sh\n"
        write_wheel(directory / file_name, files)
    return directory


def python_on_path(bin_dir: Path) -> Path:
    """``bin_dir/python3``: this interpreter, as a wrapper script, not a symlink — a venv's interpreter reached
    through a link elsewhere loses its site-packages (``pyvenv.cfg`` is looked up beside the link), and a prelude
    that runs ``python3`` from ``PATH`` then cannot import torch or moereplay."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper
