"""Helpers for the checkpoint-generator tests: load a ``tools/models`` script, read safetensors files back.

The reader is written from the safetensors specification, independently of ``tools/models/safetensors_file.py``:
8-byte little-endian header length, JSON header, raw little-endian tensor bytes at ``data_offsets``.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

TOOLS = Path(__file__).resolve().parents[3] / "tools" / "models"

TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}


def load_tool(name: str, folder: Path = TOOLS) -> ModuleType:
    """Import ``<folder>/<name>.py``, ``tools/models`` by default (tools/ is not a package; the script puts its
    folder on sys.path)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    header_length: int
    entries: dict[str, Entry]
    metadata: dict[str, str]

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        with self.path.open("rb") as stream:
            stream.seek(8 + self.header_length + entry.begin)
            raw = bytearray(stream.read(entry.end - entry.begin))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape).clone()


def read_safetensors(path: Path) -> SafetensorsFile:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    entries = {
        name: Entry(item["dtype"], tuple(item["shape"]), item["data_offsets"][0], item["data_offsets"][1])
        for name, item in header.items()
    }
    return SafetensorsFile(path, length, entries, metadata)


def read_checkpoint(directory: Path) -> dict[str, SafetensorsFile]:
    """Every ``*.safetensors`` file of a model directory by file name."""
    return {path.name: read_safetensors(path) for path in sorted(directory.glob("*.safetensors"))}


def tensors_by_name(files: dict[str, SafetensorsFile]) -> dict[str, tuple[SafetensorsFile, Entry]]:
    found: dict[str, tuple[SafetensorsFile, Entry]] = {}
    for file in files.values():
        for name, entry in file.entries.items():
            assert name not in found, f"{name} is in two files"
            found[name] = (file, entry)
    return found
