"""Typed summaries of a capture file for ``moereplay info`` and ``moereplay ls`` (and anything else that
lists calls): what the commands print, computed without reading a single blob — or importing torch."""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moereplay.format.reader import CaptureReader
from moereplay.format.records import CallRecord, CaptureStats, DamagedCall, Recovery
from moereplay.format.schema import CodecValue, EnumValue, TensorMeta, Unsupported, iter_tensor_metas

KEY_TENSORS = 3
"""Tensors shown per call in the human listing (the JSON listing has them all)."""


@dataclass(frozen=True)
class CaptureInfo:
    """What ``moereplay info`` shows."""

    path: str
    header: dict[str, Any]
    recovery: Recovery
    stats: CaptureStats

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "header": jsonable(self.header),
            "recovery": jsonable(dataclasses.asdict(self.recovery)),
            "stats": jsonable(dataclasses.asdict(self.stats)),
        }


@dataclass(frozen=True)
class CallRow:
    """One line of ``moereplay ls``."""

    index: int
    op: str
    site: str
    layer: Any
    status: str
    parent: int | None
    context: dict[Any, Any]
    tensors: dict[str, TensorMeta]

    @classmethod
    def of(cls, record: CallRecord) -> CallRow:
        return cls(
            record.index,
            record.op,
            record.site,
            record.layer,
            record.status,
            record.parent,
            record.context,
            record.arg_tensors,
            tuple(describe_tensors(record.args)),
        )

    described: tuple[tuple[str, str], ...] = ()

    def key_tensors(self, count: int = KEY_TENSORS) -> str:
        """``a=bfloat16[64,2880] b=int32[32,1440,368] …+9``; generated tensors read ``b=int32[…] (recipe)``."""
        items = list(self.described) or [(path, meta.describe()) for path, meta in self.tensors.items()]
        text = " ".join(f"{path}={description}" for path, description in items[:count])
        return text + (f" …+{len(items) - count}" if len(items) > count else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "site": self.site,
            "layer": jsonable(self.layer),
            "status": self.status,
            "parent": self.parent,
            "context": jsonable(self.context),
            "tensors": {path: jsonable(meta) for path, meta in self.tensors.items()},
        }


def generated_tensor(value: CodecValue) -> str | None:
    """``int32[32,184,5888] (recipe)`` for a codec value that stands for a tensor generated at load time.

    Such values (moereplay's seeded recipes) record the tensor's ``dtype`` and ``shape`` and hold only a
    zero-element anchor tensor; listing the anchor would say nothing about the argument.
    """
    tree = value.value
    if not isinstance(tree, dict):
        return None
    dtype, shape = tree.get("dtype"), tree.get("shape")
    anchors = [meta for _, meta in iter_tensor_metas(tree)]
    if not (
        isinstance(dtype, str) and isinstance(shape, (list, tuple)) and all(m.numel == 0 for m in anchors)
    ):
        return None
    short = value.type_name.rsplit(".", 1)[-1].lower().replace("tensor", "") or "generated"
    return f"{dtype}[{','.join(str(size) for size in shape)}] ({short})"


def describe_tensors(tree: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every tensor of a recorded value tree as ``(path, "dtype[shape]")``, generated tensors included."""
    if isinstance(tree, TensorMeta):
        yield path, tree.describe()
    elif isinstance(tree, CodecValue):
        generated = generated_tensor(tree)
        if generated is not None:
            yield path, generated
        else:
            for inner, meta in iter_tensor_metas(tree, path):
                yield inner, meta.describe()
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from describe_tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, (list, tuple)):
        for position, value in enumerate(tree):
            yield from describe_tensors(value, f"{path}[{position}]")


def header_with_gpu_at_close(header: dict[str, Any], footer: Any) -> dict[str, Any]:
    """``header`` with the GPU the writer read when it closed the file, where the header has none: CUDA was not
    initialised when the header was written (a serving worker arms early), and the footer holds it
    (``read_at_close``). Otherwise ``header`` itself."""
    late = footer.get("gpu") if isinstance(footer, dict) else None
    gpu = header.get("gpu")
    if isinstance(gpu, dict) and not gpu.get("name") and isinstance(late, dict) and late.get("name"):
        return {**header, "gpu": {**late, "read_at_close": True}}
    return header


def capture_info(path: str | Path) -> CaptureInfo:
    with CaptureReader(path) as reader:
        header = header_with_gpu_at_close(reader.header, reader.footer)
        return CaptureInfo(str(path), header, reader.recovery, reader.stats())


def list_calls(
    path: str | Path,
    *,
    op: str | None = None,
    layer: Any = None,
    status: str | None = None,
    step: Any = None,
) -> tuple[Recovery, list[CallRow | DamagedCall]]:
    """The rows of the calls matching the filters (see :meth:`CaptureReader.select`), and how the file read.

    Calls whose records cannot be read come as :class:`DamagedCall` rows, in index order among the others, unless
    ``status`` is given (a damaged call has none); the other filters cannot look inside them and keep them."""
    with CaptureReader(path) as reader:
        wanted = {record.index for record in reader.select(op=op, layer=layer, status=status, step=step)}
        rows: list[CallRow | DamagedCall] = []
        for entry in reader.entries():
            if isinstance(entry, DamagedCall):
                if status is None:
                    rows.append(entry)
            elif entry.index in wanted:
                rows.append(CallRow.of(entry))
        return reader.recovery, rows


def jsonable(value: Any) -> Any:
    """A recorded value as plain JSON (nan/inf as strings, bytes as hex, tensors as dtype/shape/stride)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, TensorMeta):
        return {
            "dtype": value.dtype,
            "shape": list(value.shape),
            "stride": list(value.stride),
            "storage_offset": value.storage_offset,
            "device": value.device,
            "storage": value.storage,
        }
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(item) for item in _iterate(value)]
    if isinstance(value, Unsupported):
        return {"unsupported": value.type_name, "repr": value.repr_excerpt}
    if isinstance(value, CodecValue):
        return {"codec": value.type_name, "value": jsonable(value.value)}
    if isinstance(value, EnumValue):
        return {"enum": value.type_name, "name": value.name, "value": jsonable(value.value)}
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__module__}.{type(value).__qualname__}", "name": value.name}
    torch = sys.modules.get("torch")  # a dtype or device exists only once torch is imported
    if torch is not None and isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return repr(value)


def _iterate(value: Any) -> Iterator[Any]:
    if isinstance(value, (set, frozenset)):
        return iter(sorted(value, key=repr))
    return iter(value)
