"""The capture as the browser sees it: an index of calls whose rows are decoded only when someone looks at them.

Opening a :class:`CallCatalog` reads the file's header and index (no call record is decoded); ``len`` and
``indices`` come from the index. :meth:`CallCatalog.summary` decodes one call record (≈0.1 ms, no tensor bytes)
on first use and keeps the small :class:`CallSummary`; the browser asks only for the rows on screen, and a
background scan (for filters) walks the rest. One reader is shared behind a lock: the reader seeks and reads a single
file handle, so the UI thread and a worker thread must not interleave inside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moereplay.format import CallRecord, CaptureReader, Recovery, TensorMeta
from moereplay.format.text import printable

SHAPE_TENSORS = 3
"""Tensors named in a row's key-shapes cell."""

RECORD_CACHE = 64
"""Full call records kept (the call view reads its record again on every visit)."""


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


SHORT_DTYPES = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "bool": "b",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
    "float8_e8m0fnu": "e8m0",
    "float4_e2m1fn_x2": "f4x2",
}
"""Short dtype names for the narrow key-shapes column (others are shown in full)."""


def _shape(meta: TensorMeta) -> str:
    dtype = SHORT_DTYPES.get(meta.dtype, meta.dtype)
    return f"{dtype}[{','.join(str(size) for size in meta.shape)}]"


@dataclass(frozen=True, slots=True)
class CallSummary:
    """One browser row: what identifies a call and what it was called with, without its tensors."""

    index: int
    op: str
    site: str
    layer: int | None
    step: int | None
    rank: int | None
    status: str
    shapes: str
    tensors: int

    @classmethod
    def of(cls, record: CallRecord, rank: int | None) -> CallSummary:
        tensors = record.arg_tensors
        named = [(path, meta) for path, meta in tensors.items() if meta.numel > 0][:SHAPE_TENSORS]
        shapes = printable(" ".join(f"{path}={_shape(meta)}" for path, meta in named))
        return cls(  # file text made printable once: the table draws it as plain segments
            index=record.index,
            op=printable(record.op),
            site=printable(record.site),
            layer=_int_or_none(record.layer),
            step=_int_or_none(record.context.get("step")),
            rank=_int_or_none(record.context.get("rank", rank)),
            status=record.status,
            shapes=shapes,
            tensors=len(tensors),
        )

    def text(self) -> str:
        """Everything a free-text search matches against, lower case."""
        return f"{self.index} {self.op} {self.site} {self.status} {self.shapes}".lower()


class CallCatalog:
    """Lazy, thread-safe access to one capture's calls for the TUI."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = CaptureReader(self.path)
        self._lock = threading.Lock()
        self._summaries: dict[int, CallSummary] = {}
        self._records: OrderedDict[int, CallRecord] = OrderedDict()
        self.indices: tuple[int, ...] = tuple(self._reader.indices)
        self._positions = {index: position for position, index in enumerate(self.indices)}
        self.rank = _int_or_none(self._reader.header.get("rank"))

    # ------------------------------------------------------------------------------------------ file facts

    @property
    def header(self) -> dict[str, Any]:
        return self._reader.header

    @property
    def recovery(self) -> Recovery:
        return self._reader.recovery

    @property
    def file_bytes(self) -> int:
        return self._reader.file_bytes

    def __len__(self) -> int:
        return len(self.indices)

    def position(self, index: int) -> int | None:
        """Where call ``index`` sits in file order (``None`` if the file has no such call)."""
        return self._positions.get(index)

    # ------------------------------------------------------------------------------------------ rows

    @property
    def decoded(self) -> int:
        """How many rows have been decoded so far."""
        return len(self._summaries)

    def summary(self, index: int) -> CallSummary:
        """The row of call ``index``, decoding its record on first use."""
        found = self._summaries.get(index)
        if found is not None:
            return found
        with self._lock:
            found = self._summaries.get(index)
            if found is None:
                found = CallSummary.of(self._reader.call(index), self.rank)
                self._summaries[index] = found
        return found

    def summaries(self, indices: Iterable[int]) -> list[CallSummary]:
        return [self.summary(index) for index in indices]

    def cached_summary(self, index: int) -> CallSummary | None:
        """The row of call ``index`` if it was decoded already (never reads the file)."""
        return self._summaries.get(index)

    def record(self, index: int) -> CallRecord:
        """The full call record (argument trees with tensor metadata, no tensor bytes), cached."""
        with self._lock:
            found = self._records.get(index)
            if found is None:
                found = self._reader.call(index)
                self._records[index] = found
                while len(self._records) > RECORD_CACHE:
                    self._records.popitem(last=False)
            else:
                self._records.move_to_end(index)
            if index not in self._summaries:
                self._summaries[index] = CallSummary.of(found, self.rank)
        return found

    def close(self) -> None:
        with self._lock:
            self._reader.close()
