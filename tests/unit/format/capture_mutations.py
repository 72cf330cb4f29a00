"""Structure-aware mutation of capture files, for the hostile-file and fuzz tests.

:func:`parse` splits a well-formed capture into records whose metadata documents are decoded *raw* (extension
values stay :class:`msgpack.ExtType`, so nothing is interpreted), tests change them, and :func:`build` writes a
file again — re-compressing each document and re-pointing every offset (storage entries, index chains, footer,
tail) at where its record now lies. A mutation therefore damages exactly what it means to and keeps the rest of
the file consistent, which is what gets a fuzzer past the framing checks into the reader's deeper layers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zstandard

from moereplay.format.framing import (
    ENVELOPE_SIZE,
    BlobEncoder,
    FrameSource,
    ReadLimits,
    RecordKind,
    pack_envelope,
)
from moereplay.format.values import Ext


@dataclass
class Record:
    """One record: its kind and envelope value, and either a raw document (metadata) or its frame bytes (blobs).

    ``origin``: the record's offset in the parsed file (offsets inside documents are resolved through it).
    ``trailer``: bytes appended after the zstd frame inside the record (a mutation). ``raw_frame``: frame bytes
    written as they are instead of compressing ``document``.
    """

    kind: RecordKind
    value: int
    origin: int | None
    document: Any = None
    frame: bytes = b""
    trailer: bytes = b""
    raw_frame: bytes | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse(path: Path) -> list[Record]:
    source = FrameSource(path, ReadLimits())
    records: list[Record] = []
    try:
        position = 0
        while position < source.size:
            envelope = source.envelope_at(position)
            frame = (
                source._read(envelope.frame_offset, envelope.frame_length) if envelope.frame_length else b""
            )
            record = Record(envelope.kind, envelope.value, position)
            if envelope.kind is RecordKind.BLOB:
                record.frame = frame
            elif envelope.kind is not RecordKind.TAIL:
                content = zstandard.ZstdDecompressor().decompress(frame)
                record.document = msgpack.unpackb(content, raw=False, strict_map_key=False)
            records.append(record)
            position = envelope.end
    finally:
        source.close()
    return records


def build(records: list[Record]) -> bytes:
    """The file of ``records``, with every recorded offset moved to where its record now starts."""
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    frames = []
    for record in records:
        if record.kind is RecordKind.TAIL:
            frames.append(b"")
        elif record.kind is RecordKind.BLOB or record.raw_frame is not None:
            frames.append(
                (record.raw_frame if record.raw_frame is not None else record.frame) + record.trailer
            )
        else:
            frames.append(None)  # compressed below, once offsets are known (documents hold offsets)
    # offsets depend on frame lengths, which depend on the offsets written into documents: msgpack ints grow with
    # their value, so iterate until the layout is stable (twice in practice)
    moved: dict[int, int] = {}
    for _ in range(4):
        encoded = list(frames)
        for position, record in enumerate(records):
            if encoded[position] is None:
                document = _relocate(record, moved)
                encoded[position] = (
                    compressor.compress(msgpack.packb(document, use_bin_type=True)) + record.trailer
                )
        layout: dict[int, int] = {}
        offset = 0
        for record, frame in zip(records, encoded, strict=True):
            if record.origin is not None:
                layout.setdefault(record.origin, offset)
            offset += ENVELOPE_SIZE + len(frame)
        if layout == moved:
            break
        moved = layout
    out = bytearray()
    for record, frame in zip(records, encoded, strict=True):
        value = record.value
        if record.kind is RecordKind.TAIL:
            value = moved.get(value, value)
        out += pack_envelope(record.kind, len(frame), value) + frame
    return bytes(out)


def _relocate(record: Record, moved: dict[int, int]) -> Any:
    def at(offset: Any) -> Any:
        return moved.get(offset, offset) if type(offset) is int else offset

    document = record.document
    if not isinstance(document, dict):
        return document
    document = dict(document)
    if record.kind in (RecordKind.CALL, RecordKind.COMPLETION) and isinstance(document.get("storages"), dict):
        document["storages"] = {
            key: {**entry, "at": at(entry.get("at"))} if isinstance(entry, dict) else entry
            for key, entry in document["storages"].items()
        }
    if record.kind is RecordKind.INDEX:
        for key in ("calls", "done"):
            if isinstance(document.get(key), list):
                document[key] = [
                    [pair[0], at(pair[1])] if isinstance(pair, list) and len(pair) == 2 else pair
                    for pair in document[key]
                ]
        document["prev"] = at(document.get("prev"))
    if record.kind is RecordKind.FOOTER:
        document["index"] = at(document.get("index"))
    return document


# ------------------------------------------------------------------------------------------- value trees


def unpack_ext(value: msgpack.ExtType) -> Any:
    return msgpack.unpackb(value.data, raw=False, strict_map_key=False)


def pack_ext(code: Ext, payload: Any) -> msgpack.ExtType:
    return msgpack.ExtType(int(code), msgpack.packb(payload, use_bin_type=True))


def walk(tree: Any, visit: Callable[[Any], Any]) -> Any:
    """Rebuild ``tree`` bottom-up through codec and tuple extension values, calling ``visit`` on every value."""
    if isinstance(tree, dict):
        tree = {key: walk(value, visit) for key, value in tree.items()}
    elif isinstance(tree, list):
        tree = [walk(value, visit) for value in tree]
    elif isinstance(tree, msgpack.ExtType) and tree.code in (Ext.CODEC, Ext.TUPLE):
        tree = pack_ext(Ext(tree.code), walk(unpack_ext(tree), visit))
    return visit(tree)


def tensors(tree: Any) -> Iterator[dict[str, Any]]:
    """Every tensor payload in a raw tree (codec values entered)."""
    found: list[dict[str, Any]] = []

    def visit(value: Any) -> Any:
        if isinstance(value, msgpack.ExtType) and value.code == Ext.TENSOR:
            found.append(unpack_ext(value))
        return value

    walk(tree, visit)
    return iter(found)


def map_tensors(tree: Any, change: Callable[[dict[str, Any]], Any]) -> Any:
    """``tree`` with every tensor payload replaced by ``change(payload)`` (a payload map, or any raw value)."""

    def visit(value: Any) -> Any:
        if isinstance(value, msgpack.ExtType) and value.code == Ext.TENSOR:
            result = change(unpack_ext(value))
            return pack_ext(Ext.TENSOR, result) if isinstance(result, dict) else result
        return value

    return walk(tree, visit)


def zero_blob(length: int, level: int = 1) -> tuple[bytes, bytes]:
    """(digest, frame) of a blob of ``length`` zero bytes, compressed without holding them (1 MiB at a time)."""
    chunk = bytes(1 << 20)
    digest = hashlib.sha256()
    for start in range(0, length, len(chunk)):
        digest.update(chunk[: min(len(chunk), length - start)])
    # a zero-filled buffer would cost ``length`` bytes; an anonymous read-only mapping is all the kernel's zero
    # page, so the encoder streams ``length`` zero bytes while almost nothing is resident
    import mmap

    mapping = mmap.mmap(-1, max(length, 1), prot=mmap.PROT_READ)
    view = memoryview(mapping)[:length]
    blob = BlobEncoder(level).encode(digest.digest(), view)
    view.release()
    mapping.close()
    return digest.digest(), b"".join(blob.pieces)
