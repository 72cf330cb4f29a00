"""Write safetensors checkpoints tensor by tensor, with torch and the standard library only.

The safetensors format (the specification in huggingface/safetensors, ``docs/source/index.mdx`` / README):

- 8 bytes: ``N``, the length of the header, an unsigned little-endian 64-bit integer;
- ``N`` bytes: a UTF-8 JSON object ``{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, …}``
  with an optional ``"__metadata__"`` entry of string → string; the official writer pads it with spaces to a
  multiple of 8 so the data starts aligned;
- the data: every tensor's raw little-endian bytes in row-major order, back to back, ``data_offsets`` counted from
  the first byte after the header. Readers check that the offsets tile the data exactly (no gap, no overlap).

Why not the ``safetensors`` package: the checkpoints are generated on the GPU machine, which has it, but the
generators must also run in the project's CPU environment (tests) where it is absent, and the format is 30 lines.
The header is computed from the plan before any tensor exists, then each tensor is made, written and dropped, so
peak memory is one tensor (the largest: a layer's ``gate_up_proj_blocks``, 265 MB at gpt-oss-20b size).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

#: torch dtype → safetensors dtype name (the names of the specification).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
}

#: The header is padded with spaces to a multiple of this many bytes (as the official writer does).
HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a file: its name, dtype and shape, and how to make it (called once, when it is written)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"{self.name}: no safetensors name for {self.dtype}")
        if any(size < 0 for size in self.shape):
            raise ValueError(f"{self.name}: negative size in shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def header_bytes(plans: Sequence[TensorPlan], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and the padded JSON header for ``plans`` written in order."""
    names = [plan.name for plan in plans]
    if len(set(names)) != len(names):
        raise ValueError("tensor names repeat within one file")
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for plan in plans:
        header[plan.name] = {
            "dtype": DTYPE_NAMES[plan.dtype],
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + plan.nbytes],
        }
        offset += plan.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def write_file(path: Path, plans: Sequence[TensorPlan], metadata: dict[str, str] | None = None) -> int:
    """Write ``plans`` to ``path`` (making each tensor only when its turn comes); the file's size in bytes."""
    written = 0
    with path.open("wb") as stream:
        head = header_bytes(plans, metadata)
        stream.write(head)
        written += len(head)
        for plan in plans:
            tensor = plan.make()
            if tensor.dtype != plan.dtype or tuple(tensor.shape) != plan.shape:
                raise ValueError(
                    f"{plan.name}: made {tensor.dtype} {tuple(tensor.shape)}, planned {plan.dtype} {plan.shape}"
                )
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            raw.numpy().tofile(stream)
            written += raw.numel()
            del tensor, raw
    return written


def write_index(directory: Path, files: Iterable[tuple[str, Sequence[TensorPlan]]]) -> Path:
    """``model.safetensors.index.json``: which file holds each tensor (loaders use it to pick the shards)."""
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, plans in files:
        for plan in plans:
            weight_map[plan.name] = file_name
            total += plan.nbytes
    path = directory / "model.safetensors.index.json"
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


def shard_name(index: int, count: int) -> str:
    """The Hugging Face shard file name: ``model-00001-of-00003.safetensors`` (1-based)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_checkpoint(directory: Path, shards: Sequence[Sequence[TensorPlan]]) -> int:
    """Write every shard and the index into ``directory``; the bytes written."""
    names = [shard_name(index, len(shards)) for index in range(len(shards))]
    total = sum(write_file(directory / name, plans) for name, plans in zip(names, shards, strict=True))
    write_index(directory, zip(names, shards, strict=True))
    return total
