"""Hand-crafted hostile files: wrong magic or version, size claims beyond caps or beyond the file, malformed
documents. Each must fail with a one-line CaptureFileError naming the file, before allocating the claim."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zstandard

from moereplay.errors import CaptureFileError, TruncatedFileError
from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.framing import FrameSink, RecordKind, pack_envelope
from moereplay.format.values import Ext

HEADER = {"magic": "moereplay-capture", "format_version": [1, 0]}
VERSION_1_0 = 1 << 32


def _craft(
    path: Path,
    records: list[tuple[RecordKind, int, Any]],
    *,
    header: dict[str, Any] | None = None,
    version: int = VERSION_1_0,
) -> Path:
    with open(path, "wb") as handle:
        sink = FrameSink(handle, 3)
        sink.write_document(RecordKind.HEADER, version, header or HEADER)
        for kind, value, document in records:
            if isinstance(document, bytes):
                handle.write(document)
                sink.position += len(document)
            else:
                sink.write_document(kind, value, document)
    return path


def _fails(path: Path, match: str, **limits: int) -> str:
    with pytest.raises(CaptureFileError) as caught, CaptureReader(path, **limits) as reader:
        for index in reader.indices:  # call() raises for a damaged call; calls() would list the others
            reader.call(index)
            reader.load_args(index)
    message = str(caught.value)
    assert message.startswith(str(path)) and "\n" not in message
    assert match in message, message
    return message


def _call(index: int, args: Any, storages: Any = None) -> dict[str, Any]:
    return {
        "i": index,
        "op": "op",
        "site": "",
        "parent": None,
        "t": 0.0,
        "ctx": {},
        "args": args,
        "static": [],
        "storages": storages or {},
    }


def _tensor(**fields: Any) -> msgpack.ExtType:
    payload = {"dt": "float32", "is": 4, "sh": [4], "st": [1], "of": 0, "dev": "cpu", "sid": 0, **fields}
    return msgpack.ExtType(int(Ext.TENSOR), msgpack.packb(payload))


def test_not_a_capture(tmp_path: Path) -> None:
    for name, data in {
        "text.zst": b"hello world, this is not a capture file at all",
        "plain.zst": zstandard.ZstdCompressor().compress(msgpack.packb(HEADER)),
        "short.zst": b"\x01",
    }.items():
        (tmp_path / name).write_bytes(data)
        _fails(tmp_path / name, "bad magic")
    (tmp_path / "empty.zst").write_bytes(b"")
    _fails(tmp_path / "empty.zst", "empty file")
    _fails(tmp_path / "missing.zst", "cannot open")


def test_wrong_magic_in_header_document(tmp_path: Path) -> None:
    _fails(_craft(tmp_path / "m.zst", [], header={"magic": "other", "format_version": [1, 0]}), "bad magic")


def test_other_major_version_is_refused_minor_accepted(tmp_path: Path) -> None:
    _fails(_craft(tmp_path / "v2.zst", [], version=2 << 32), "format 2.0 is not supported")
    header = {"magic": "moereplay-capture", "format_version": [2, 1]}
    _fails(_craft(tmp_path / "v2doc.zst", [], header=header), "format 2.1 is not supported")
    newer = {"magic": "moereplay-capture", "format_version": [1, 7], "future_field": {"x": 1}}
    path = _craft(
        tmp_path / "v17.zst",
        [(RecordKind.CALL, 0, _call(0, {"n": 1}))],
        header=newer,
        version=VERSION_1_0 | 7,
    )
    with CaptureReader(path) as reader:
        assert reader.header["future_field"] == {"x": 1} and reader.call(0).args == {"n": 1}


def test_envelope_claiming_more_than_the_file(tmp_path: Path) -> None:
    path = _craft(tmp_path / "big.zst", [(RecordKind.CALL, 0, _call(0, {}))])
    with open(path, "ab") as handle:
        handle.write(pack_envelope(RecordKind.BLOB, 1 << 60, 1 << 60) + b"\x28\xb5\x2f\xfd")
    with CaptureReader(path) as reader:
        assert len(reader) == 1 and reader.recovery.truncated_at is not None
        assert f"({(1 << 60) + 32 + reader.recovery.truncated_at - path.stat().st_size} bytes missing)" in (
            reader.recovery.message
        )


def _frame_with_content_size(content: bytes, claimed: int) -> bytes:
    """A zstd frame whose header claims ``claimed`` bytes of content (8-byte size field), with a checksum."""
    real = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(content)
    descriptor = real[4]
    header_size = zstandard.frame_header_size(real)
    new_descriptor = (3 << 6) | (
        descriptor & 0b00000100
    )  # FCS 8 bytes, not single-segment, keep checksum flag
    window = real[5:6] if not descriptor & 0x20 else b"\x58"  # 8 MiB window when the original had none
    return real[:4] + bytes([new_descriptor]) + window + struct.pack("<Q", claimed) + real[header_size:]


@pytest.mark.parametrize("claimed", [1 << 40, 1 << 21])
def test_frame_content_size_claims_are_checked_before_decompressing(tmp_path: Path, claimed: int) -> None:
    frame = _frame_with_content_size(msgpack.packb(_call(0, {})), claimed)
    path = _craft(
        tmp_path / "fcs.zst", [(RecordKind.CALL, 0, pack_envelope(RecordKind.CALL, len(frame), 0) + frame)]
    )
    tracemalloc.start()
    try:
        message = _fails(path, "claims", max_frame_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert "cap" in message
    if claimed == 1 << 40:  # even with a huge cap: more than the compressed bytes could expand to
        _fails(path, "compressed bytes can hold", max_frame_bytes=1 << 50)


def test_storage_claims_over_the_blob_cap(tmp_path: Path) -> None:
    storages = {0: {"h": b"\x00" * 32, "at": 100, "base": 0, "n": 1 << 40, "sz": 1 << 40, "dev": "cpu"}}
    path = _craft(tmp_path / "s.zst", [(RecordKind.CALL, 0, _call(0, {"x": _tensor()}, storages))])
    _fails(path, "over the cap", max_blob_bytes=1 << 30)


def test_tensor_outside_its_recorded_bytes(tmp_path: Path) -> None:
    path = tmp_path / "real.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call("op", {"x": torch.ones(4)})
    with CaptureReader(path) as reader:
        blob_offset = next(iter(reader._documents(0)[0]["storages"].values())).offset
    data = path.read_bytes()
    header_end = 32 + struct.unpack_from("<Q", data, 12)[0]
    blob_end = blob_offset + 32 + struct.unpack_from("<Q", data, blob_offset + 12)[0]
    storages = {0: {"h": reader_digest(path), "at": blob_offset, "base": 0, "n": 16, "sz": 16, "dev": "cpu"}}
    huge = _tensor(sh=[1 << 40], st=[1])
    shifted = _tensor(of=3)
    for name, args in {
        "huge": {"x": huge},
        "shifted": {"x": shifted},
        "nostorage": {"x": _tensor(sid=5)},
    }.items():
        crafted = tmp_path / f"{name}.zst"
        with open(crafted, "wb") as handle:
            handle.write(data[:blob_end])
            sink = FrameSink(handle, 3)
            sink.position = blob_end
            sink.write_document(RecordKind.CALL, 0, _call(0, args, storages))
        assert header_end <= blob_offset
        _fails(crafted, "storage")


def reader_digest(path: Path) -> bytes:
    with CaptureReader(path) as reader:
        return next(iter(reader._documents(0)[0]["storages"].values())).digest


@pytest.mark.parametrize(
    "document",
    [
        _call(0, {"x": msgpack.ExtType(99, b"\xc0")}),
        _call(0, {"x": _tensor(dt=7)}),
        _call(0, {"x": _tensor(sh=[-1])}),
        _call(0, {"x": _tensor(sh=[2, 2], st=[1])}),
        _call(0, {"x": _tensor(dt="int64", **{"is": 4})}),
        _call(0, {"x": msgpack.ExtType(int(Ext.DEVICE), msgpack.packb("not a device"))}),
        _call(1, {}),
        {**_call(0, {}), "op": 5},
        {**_call(0, {}), "storages": {0: {"h": b"short"}}},
        {**_call(0, {}), "args": [1, 2]},
        [1, 2, 3],
    ],
)
def test_malformed_call_documents(tmp_path: Path, document: Any) -> None:
    path = _craft(tmp_path / "bad.zst", [(RecordKind.CALL, 0, document)])
    _fails(path, "")


def test_deeply_nested_extension_values(tmp_path: Path) -> None:
    value: Any = 1
    for _ in range(5000):
        value = msgpack.ExtType(int(Ext.TUPLE), msgpack.packb([value]))
    path = _craft(tmp_path / "deep.zst", [(RecordKind.CALL, 0, _call(0, {"x": value}))])
    _fails(path, "is malformed")


def test_msgpack_length_claims_beyond_the_frame(tmp_path: Path) -> None:
    bogus = b"\xdb\xff\xff\xff\xf0abc"  # str32 claiming ~4 GiB
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(bogus)
    path = _craft(
        tmp_path / "len.zst", [(RecordKind.CALL, 0, pack_envelope(RecordKind.CALL, len(frame), 0) + frame)]
    )
    _fails(path, "is malformed")


def test_frames_without_checksum_are_refused(tmp_path: Path) -> None:
    frame = zstandard.ZstdCompressor(write_checksum=False).compress(msgpack.packb(_call(0, {})))
    path = _craft(
        tmp_path / "nock.zst", [(RecordKind.CALL, 0, pack_envelope(RecordKind.CALL, len(frame), 0) + frame)]
    )
    _fails(path, "checksum")


def test_index_pointing_forward_falls_back_to_a_scan(tmp_path: Path) -> None:
    records = [
        (RecordKind.CALL, 0, _call(0, {"n": 0})),
        (RecordKind.INDEX, 1, {"calls": [[0, 10_000]], "done": [], "prev": None}),
    ]
    path = _craft(tmp_path / "idx.zst", records)
    size = path.stat().st_size
    with open(path, "ab") as handle:
        sink = FrameSink(handle, 3)
        sink.position = size
        footer = sink.write_document(RecordKind.FOOTER, 1, {"index": size + 10**6, "calls": 1})
        sink.write_tail(footer)
    with CaptureReader(path) as reader:
        assert not reader.recovery.complete and "index unreadable" in reader.recovery.message
        assert [record.args for record in reader.calls()] == [{"n": 0}]


def test_truncated_header_is_a_truncated_file_error(tmp_path: Path) -> None:
    path = tmp_path / "h.zst"
    with CaptureWriter(path):
        pass
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(TruncatedFileError):
        CaptureReader(path)


def test_blob_hash_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "hash.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call("op", {"x": torch.ones(4)})
    with CaptureReader(path) as reader:
        document = reader._documents(0)[0]
        storage = next(iter(document["storages"].values()))
    data = path.read_bytes()
    storages = {0: {"h": b"\x01" * 32, "at": storage.offset, "base": 0, "n": 16, "dev": "cpu"}}
    crafted = tmp_path / "crafted.zst"
    blob_end = storage.offset + 32 + struct.unpack_from("<Q", data, storage.offset + 12)[0]
    with open(crafted, "wb") as handle:
        handle.write(data[:blob_end])
        sink = FrameSink(handle, 3)
        sink.position = blob_end
        sink.write_document(RecordKind.CALL, 0, _call(0, {"x": _tensor()}, storages))
    _fails(crafted, "not the blob the call refers to")
