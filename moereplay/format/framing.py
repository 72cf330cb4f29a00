"""The byte layer of a capture file: records, envelopes, zstd frames and the size checks made before allocating.

A capture file is a sequence of *records*. Each record is

- a 32-byte **envelope**: a zstd *skippable frame* (RFC 8878 §3.1.2, magic ``0x184D2A5E``, 24-byte payload)
  that the ``zstd`` CLI ignores and that says, without decompressing anything, what follows:
  ``b"MR"``, the record kind (u8), flags (u8, zero), the length in bytes of the zstd frame that follows (u64),
  a kind-specific value (u64: the call index for call/completion records, the blob length for blobs, …) and a
  CRC-32 of those 20 bytes (u32), all little-endian;
- then one ordinary **zstd frame** (content size and content checksum always written) whose content is one
  msgpack document (a map). The tail record is an envelope alone.

So ``zstd -dc FILE`` prints the concatenated msgpack documents, and a reader walks the file by reading
envelopes only (32 bytes per record): listing never has to read, let alone decompress, a blob frame.

Safety: every length read from the file is checked before anything is allocated — an envelope's frame length
against the bytes the file still holds, a frame's declared content size against a configurable cap and against
the most that many compressed bytes can expand to (zstd's best case is about 32,768:1), and zstd itself
verifies the content size and checksum. Frames without content size or checksum, with a dictionary, or with an
envelope whose CRC fails are refused. Every problem becomes a :class:`~moereplay.errors.CaptureFileError`
(:class:`~moereplay.errors.TruncatedFileError` when the file simply ends early) naming the file and the offset.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgpack
import zstandard

from moereplay.errors import CaptureFileError, TruncatedFileError

FORMAT_MAJOR = 1
"""Readers refuse files of another major version."""
FORMAT_MINOR = 0
"""Minor versions only add optional fields; readers ignore keys they do not know."""
MAGIC = "moereplay-capture"
"""Value of the header document's ``magic`` key."""
BLOB_HASH = "sha256"
"""Content hash of blob frames (``hashlib`` name); hashes are stored as raw 32-byte digests."""

SKIPPABLE_MAGIC = 0x184D2A5E
ENVELOPE_SIZE = 32
_SKIPPABLE_HEADER = struct.Struct("<II")
_ENVELOPE_BODY = struct.Struct("<2sBBQQ")
_ENVELOPE_PAYLOAD = _ENVELOPE_BODY.size + 4
_TAG = b"MR"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_EXPANSION = 32_768
"""zstd's best case: an RLE block of 128 KiB costs 4 bytes. Claims beyond this ratio are impossible."""
_ZSTD_BLOCK = 128 * 1024
_FRAME_HEADER_MAX = 18
"""Largest zstd frame header (magic, descriptor, window, dictionary id, content size)."""
_FRAME_MIN = 13
"""Smallest zstd frame with the checksum this format requires: magic, descriptor, one block header, checksum."""
_BIN_MAX = 2**32 - 1
BLOB_CHUNK = 2**30
"""Chunk size of blobs larger than one msgpack bin can hold."""

DEFAULT_MAX_FRAME_BYTES = 64 * 2**20
"""Default cap on the decompressed size of one metadata frame (call, completion, index, header, footer)."""
DEFAULT_MAX_BLOB_BYTES = 16 * 2**30
"""Default cap on one blob (the bytes of one storage span)."""


class RecordKind(enum.IntEnum):
    """What a record holds; stored as one byte in its envelope."""

    HEADER = 1
    CALL = 2
    COMPLETION = 3
    BLOB = 4
    INDEX = 5
    FOOTER = 6
    TAIL = 7


@dataclass(frozen=True)
class Envelope:
    """A parsed envelope: the record at ``offset`` has ``kind`` and a zstd frame of ``frame_length`` bytes."""

    offset: int
    kind: RecordKind
    frame_length: int
    value: int

    @property
    def frame_offset(self) -> int:
        return self.offset + ENVELOPE_SIZE

    @property
    def end(self) -> int:
        """Offset of the next record."""
        return self.offset + ENVELOPE_SIZE + self.frame_length


def pack_envelope(kind: RecordKind, frame_length: int, value: int) -> bytes:
    body = _ENVELOPE_BODY.pack(_TAG, int(kind), 0, frame_length, value)
    return (
        _SKIPPABLE_HEADER.pack(SKIPPABLE_MAGIC, _ENVELOPE_PAYLOAD)
        + body
        + struct.pack("<I", zlib.crc32(body))
    )


@dataclass(frozen=True)
class ReadLimits:
    """Caps a reader enforces before allocating, in bytes of decompressed content."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= 0 or self.max_blob_bytes <= 0:
            raise ValueError("read limits must be positive")


@dataclass(frozen=True)
class EncodedBlob:
    """A blob record's zstd frame, compressed ahead of writing: ``pieces`` concatenated are the frame.

    The frame is a pure function of (digest, bytes, compression level): it can be made on any thread, before
    the record's offset in the file is known, and written later by :meth:`FrameSink.write_encoded`.
    """

    digest: bytes
    length: int
    pieces: tuple[bytes, ...]

    @property
    def frame_length(self) -> int:
        return sum(len(piece) for piece in self.pieces)


class BlobEncoder:
    """Compresses blob documents ``{"h": digest, "n": length, "d": bytes}`` into one zstd frame each.

    Thread-safe: every thread gets its own compressor (``zstandard`` compressors must not be shared by threads
    running at once), so a pool of threads can compress several blobs at once; zstd releases the GIL while it
    works. ``threads``: zstd worker threads inside each frame (0: none; -1: one per CPU). ``seconds``: cumulative
    seconds spent compressing, summed over the threads that did it (thread-seconds, not wall time).
    """

    def __init__(self, compression_level: int, threads: int = 0) -> None:
        self.level = compression_level
        self.threads = threads
        self._local = threading.local()
        self._lock = threading.Lock()
        self.seconds = 0.0

    def _compressor(self) -> zstandard.ZstdCompressor:
        engine = getattr(self._local, "compressor", None)
        if engine is None:
            engine = zstandard.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True, threads=self.threads
            )
            self._local.compressor = engine
        return engine

    def encode(self, digest: bytes, data: memoryview) -> EncodedBlob:
        """The frame of ``data``'s blob record. ``d`` is one msgpack bin, or for blobs over 4 GiB (msgpack's bin
        limit) an array of bins of :data:`BLOB_CHUNK` bytes. Streams from ``data``: no copy of the input."""
        length = data.nbytes
        packer = msgpack.Packer(use_bin_type=True)
        prefix = packer.pack_map_header(3) + packer.pack("h") + packer.pack(digest)
        prefix += packer.pack("n") + packer.pack(length) + packer.pack("d")
        chunk = length if length <= _BIN_MAX else BLOB_CHUNK
        if chunk != length:
            prefix += packer.pack_array_header(-(-length // chunk))
        chunks: list[tuple[bytes, memoryview]] = []
        for start in range(0, max(length, 1), max(chunk, 1)):
            piece = data[start : start + chunk]
            chunks.append((_bin_header(piece.nbytes), piece))
        total = len(prefix) + sum(len(header) + piece.nbytes for header, piece in chunks)
        started = time.perf_counter()
        stream = self._compressor().compressobj(size=total)
        pieces = [stream.compress(prefix)]
        for header, piece in chunks:
            pieces.append(stream.compress(header))
            pieces.append(stream.compress(piece))  # one call: zstd's worker threads see the whole input
        pieces.append(stream.flush())
        elapsed = time.perf_counter() - started
        with self._lock:
            self.seconds += elapsed
        return EncodedBlob(digest, length, tuple(piece for piece in pieces if piece))


class FrameSink:
    """Appends records to an open binary file and tracks the offset of the next one.

    Cost: one zstd compression per record (metadata frames are small; blob frames are streamed from the
    caller's buffer without an extra copy, or compressed beforehand on other threads through ``encoder``) and
    one ``write`` per piece. ``seconds``: cumulative ``write`` (this thread) and ``compress`` (thread-seconds of
    every thread that compressed blobs for this sink) seconds, for benchmarks.
    """

    def __init__(self, file: IO[bytes], compression_level: int, compression_threads: int = 0) -> None:
        self._file = file
        self._compressor = zstandard.ZstdCompressor(
            level=compression_level, write_checksum=True, write_content_size=True
        )
        self.encoder = BlobEncoder(compression_level, compression_threads)
        self.position = 0
        self._write_seconds = 0.0

    @property
    def seconds(self) -> dict[str, float]:
        """Where the time went (cumulative): ``compress`` (thread-seconds) and ``write``."""
        return {"compress": self.encoder.seconds, "write": self._write_seconds}

    def _write(self, data: bytes | memoryview) -> None:
        started = time.perf_counter()
        self._file.write(data)
        self._write_seconds += time.perf_counter() - started
        self.position += len(data)

    def write_document(self, kind: RecordKind, value: int, document: Any) -> int:
        """Write ``document`` (msgpack-native values only) as one record; return the record's offset."""
        frame = self._compressor.compress(msgpack.packb(document, use_bin_type=True))
        offset = self.position
        self._write(pack_envelope(kind, len(frame), value))
        self._write(frame)
        return offset

    def write_blob(self, digest: bytes, data: memoryview) -> int:
        """Write a blob record ``{"h": digest, "n": length, "d": bytes}``; return its offset (see
        :meth:`BlobEncoder.encode`)."""
        return self.write_encoded(self.encoder.encode(digest, data))

    def write_encoded(self, blob: EncodedBlob) -> int:
        """Write a blob record compressed beforehand; return its offset."""
        offset = self.position
        self._write(pack_envelope(RecordKind.BLOB, blob.frame_length, blob.length))
        for piece in blob.pieces:
            self._write(piece)
        return offset

    def write_tail(self, footer_offset: int) -> None:
        self._write(pack_envelope(RecordKind.TAIL, 0, footer_offset))


class FrameSource:
    """Random-access, validated reading of records from one capture file.

    Every method raises :class:`CaptureFileError` (or :class:`TruncatedFileError`) whose message starts with
    the file name. ``bytes_read`` and ``blob_frames_read`` count I/O, so callers and tests can check that
    listing never touches tensor bytes.
    """

    def __init__(self, path: str | Path, limits: ReadLimits) -> None:
        self.path = Path(path)
        self.limits = limits
        try:
            self._file: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as error:
            raise CaptureFileError(f"{self.path}: cannot open: {error.strerror or error}") from error
        try:
            self._file.seek(0, 2)
            self.size = self._file.tell()
        except OSError as error:
            self._file.close()
            raise CaptureFileError(f"{self.path}: cannot read: {error.strerror or error}") from error
        self._decompressor = zstandard.ZstdDecompressor()
        self.bytes_read = 0
        self.blob_frames_read = 0

    def close(self) -> None:
        self._file.close()

    def fail(self, message: str) -> CaptureFileError:
        """An error naming this file (for callers to ``raise``)."""
        return CaptureFileError(f"{self.path}: {message}")

    def _read(self, offset: int, length: int) -> bytes:
        try:
            self._file.seek(offset)
            data = self._file.read(length)
        except (OSError, ValueError, OverflowError) as error:
            raise self.fail(f"read of {length} bytes at offset {offset} failed: {error}") from error
        self.bytes_read += len(data)
        if len(data) != length:
            raise TruncatedFileError(f"{self.path}: file ends inside the record at offset {offset}")
        return data

    def read_range(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the file); for searching damaged regions."""
        return self._read(offset, max(0, min(length, self.size - offset)))

    def read_prefix(self, length: int) -> bytes:
        """The first ``length`` bytes of the file (fewer if it is shorter)."""
        return self._read(0, min(length, self.size))

    def envelope_at(self, offset: int) -> Envelope:
        """Parse and check the envelope at ``offset``, including that its frame fits in the file."""
        if offset < 0 or offset > self.size:
            raise self.fail(f"record offset {offset} lies outside the file ({self.size} bytes)")
        if self.size - offset < ENVELOPE_SIZE:
            raise TruncatedFileError(f"{self.path}: file ends inside the record envelope at offset {offset}")
        raw = self._read(offset, ENVELOPE_SIZE)
        magic, payload_size = _SKIPPABLE_HEADER.unpack_from(raw)
        body = raw[8 : 8 + _ENVELOPE_BODY.size]
        (crc,) = struct.unpack_from("<I", raw, 8 + _ENVELOPE_BODY.size)
        tag, kind_byte, flags, frame_length, value = _ENVELOPE_BODY.unpack(body)
        if magic != SKIPPABLE_MAGIC or payload_size != _ENVELOPE_PAYLOAD or tag != _TAG:
            raise self.fail(f"no record envelope at offset {offset} (bad magic)")
        if zlib.crc32(body) != crc:
            raise self.fail(f"record envelope at offset {offset} is corrupt (CRC mismatch)")
        try:
            kind = RecordKind(kind_byte)
        except ValueError as error:
            raise self.fail(f"unknown record kind {kind_byte} at offset {offset}") from error
        if flags != 0:
            raise self.fail(f"record at offset {offset} has unknown flags {flags:#x}")
        if kind is RecordKind.TAIL and frame_length != 0:
            raise self.fail(f"tail record at offset {offset} claims a frame")
        if kind is not RecordKind.TAIL and frame_length < _FRAME_MIN:
            raise self.fail(f"the {kind.name.lower()} record at offset {offset} has no room for a zstd frame")
        envelope = Envelope(offset, kind, frame_length, value)
        if envelope.end > self.size:
            raise TruncatedFileError(
                f"{self.path}: the {kind.name.lower()} record at offset {offset} claims "
                f"{frame_length} bytes but the file ends {self.size - envelope.frame_offset} bytes later",
                record_end=envelope.end,
                kind=kind.name.lower(),
            )
        return envelope

    def _content(self, envelope: Envelope) -> bytes:
        """Read, check and decompress the zstd frame of a metadata record (blobs go through read_blob)."""
        cap = self.limits.max_frame_bytes
        where = f"{envelope.kind.name.lower()} frame at offset {envelope.offset}"
        if envelope.frame_length > cap + cap // 64 + 4096:
            raise self.fail(f"{where} is {envelope.frame_length} bytes, over the cap of {cap}")
        frame = self._read(envelope.frame_offset, envelope.frame_length)
        if frame[:4] != _ZSTD_MAGIC:
            raise self.fail(f"{where} is not a zstd frame")
        try:
            parameters = zstandard.get_frame_parameters(frame)
        except zstandard.ZstdError as error:
            raise self.fail(f"{where} has a bad zstd header: {error}") from error
        size = parameters.content_size
        if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
            raise self.fail(f"{where} does not declare its content size")
        if not parameters.has_checksum or parameters.dict_id != 0:
            raise self.fail(f"{where} lacks a content checksum or needs a dictionary")
        if size > cap:
            raise self.fail(f"{where} claims {size} bytes, over the cap of {cap}")
        if size > _MAX_EXPANSION * len(frame) + _ZSTD_BLOCK:
            raise self.fail(f"{where} claims {size} bytes, more than {len(frame)} compressed bytes can hold")
        try:
            stream = self._decompressor.decompressobj()
            content = stream.decompress(frame)
        except (zstandard.ZstdError, MemoryError) as error:
            raise self.fail(f"{where} does not decompress: {error}") from error
        if not stream.eof:
            raise self.fail(f"{where} ends inside its zstd frame")
        if stream.unused_data:
            raise self.fail(f"{where} has {len(stream.unused_data)} bytes after its zstd frame")
        if len(content) != size:
            raise self.fail(f"{where} decompressed to {len(content)} bytes, not the declared {size}")
        return content

    def document_at(
        self, offset: int, kind: RecordKind, ext_hook: Any = None
    ) -> tuple[Envelope, dict[Any, Any]]:
        """The msgpack map of the record at ``offset``, which must be of ``kind``."""
        envelope = self.envelope_at(offset)
        if envelope.kind is not kind:
            raise self.fail(
                f"expected a {kind.name.lower()} record at offset {offset}, found {envelope.kind.name.lower()}"
            )
        content = self._content(envelope)
        try:
            if ext_hook is None:
                document = msgpack.unpackb(content, raw=False, strict_map_key=False)
            else:
                document = msgpack.unpackb(content, raw=False, strict_map_key=False, ext_hook=ext_hook)
        except CaptureFileError:
            raise
        except Exception as error:  # msgpack and ext hooks raise many types on hostile input
            raise self.fail(
                f"{kind.name.lower()} frame at offset {offset} is malformed: {_one_line(error)}"
            ) from error
        if not isinstance(document, dict):
            raise self.fail(f"{kind.name.lower()} frame at offset {offset} is not a map")
        return envelope, document

    def blob_envelope(self, offset: int, length: int) -> Envelope:
        """Check that a blob of ``length`` bytes can be at ``offset`` — before the caller allocates for it."""
        cap = self.limits.max_blob_bytes
        if length > cap:
            raise self.fail(f"a storage claims a blob of {length} bytes, over the cap of {cap}")
        envelope = self.envelope_at(offset)
        if envelope.kind is not RecordKind.BLOB:
            raise self.fail(f"expected a blob record at offset {offset}, found {envelope.kind.name.lower()}")
        if envelope.value != length:
            raise self.fail(
                f"blob at offset {offset} holds {envelope.value} bytes, the call expects {length}"
            )
        if length > _MAX_EXPANSION * envelope.frame_length + _ZSTD_BLOCK:
            raise self.fail(
                f"blob at offset {offset} claims more than its {envelope.frame_length} bytes can hold"
            )
        return envelope

    def read_blob(
        self, envelope: Envelope, digest: bytes, target: memoryview, *, verify: bool = True
    ) -> None:
        """Decompress the blob of ``envelope`` straight into ``target`` (``envelope.value`` writable bytes).

        Streams from the file: no compressed or decompressed copy of the blob is held. Checks the frame header
        and its declared size before reading, the document's digest and length, the zstd checksum, and (if
        ``verify``) the sha256 of the bytes.
        """
        where = f"blob frame at offset {envelope.offset}"
        length = envelope.value
        self.blob_frames_read += 1
        head = self._read(envelope.frame_offset, min(envelope.frame_length, _FRAME_HEADER_MAX))
        if head[:4] != _ZSTD_MAGIC:
            raise self.fail(f"{where} is not a zstd frame")
        try:
            parameters = zstandard.get_frame_parameters(head)
        except zstandard.ZstdError as error:
            raise self.fail(f"{where} has a bad zstd header: {error}") from error
        if not parameters.has_checksum or parameters.dict_id != 0:
            raise self.fail(f"{where} lacks a content checksum or needs a dictionary")
        self._check_frame_end(envelope, head, where)
        try:
            self._file.seek(envelope.frame_offset)
            frame: Any = _Bounded(self._file, envelope.frame_length)
            with self._decompressor.stream_reader(frame, read_size=1 << 20, closefd=False) as stream:
                _BlobStream(stream, where, self.fail).read_into(
                    digest, length, parameters.content_size, target
                )
        except zstandard.ZstdError as error:
            raise self.fail(f"{where} does not decompress: {error}") from error
        except OSError as error:
            raise self.fail(f"{where}: read failed: {error}") from error
        self.bytes_read += envelope.frame_length
        if verify and hashlib.new(BLOB_HASH, target).digest() != digest:
            raise self.fail(f"blob at offset {envelope.offset} fails its {BLOB_HASH} check (corrupt)")

    def _check_frame_end(self, envelope: Envelope, head: bytes, where: str) -> None:
        """Walk the zstd block headers of a frame (3 bytes per block of at most 128 KiB; nothing decompressed) and
        check the frame ends exactly where its record does: bytes after it would otherwise be ignored."""
        try:
            position = envelope.frame_offset + zstandard.frame_header_size(head)
        except zstandard.ZstdError as error:
            raise self.fail(f"{where} has a bad zstd header: {error}") from error
        end = envelope.end
        while True:
            if position + 3 > end:
                raise self.fail(f"{where} ends inside its zstd frame")
            header = int.from_bytes(self._read(position, 3), "little")
            last, block_type, size = header & 1, (header >> 1) & 3, header >> 3
            if block_type == 3 or size > _ZSTD_BLOCK:
                raise self.fail(f"{where} has a malformed zstd block at offset {position}")
            position += 3 + (1 if block_type == 1 else size)
            if last:
                break
        position += 4  # the content checksum
        if position > end:
            raise self.fail(f"{where} ends inside its zstd frame")
        if position < end:
            raise self.fail(f"{where} has {end - position} bytes after its zstd frame")


class _Bounded:
    """A file seen only up to ``length`` more bytes, so a stream decoder stops exactly at its frame's end
    (where it checks the zstd checksum) instead of running into the next record."""

    def __init__(self, file: IO[bytes], length: int) -> None:
        self._file = file
        self._left = length

    def read(self, size: int = -1) -> bytes:
        size = self._left if size < 0 else min(size, self._left)
        data = self._file.read(size)
        self._left -= len(data)
        return data


_BIN = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}
_UNSIGNED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
_ARRAY = {0xDC: ">H", 0xDD: ">I"}


class _BlobStream:
    """Parses the fixed layout of a blob document while decompressing it.

    Format v1 blob documents are exactly ``{"h": bin digest, "n": uint length, "d": bin | [bin, …]}`` in that
    key order (the writer emits nothing else), so the small head is parsed by hand and the payload lands
    directly in the caller's buffer.
    """

    def __init__(self, stream: Any, where: str, fail: Any) -> None:
        self.stream = stream
        self.where = where
        self.fail = fail
        self.consumed = 0

    def exact(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            piece = self.stream.read(count - len(data))
            if not piece:
                raise self.fail(f"{self.where} ends early")
            data += piece
        self.consumed += count
        return data

    def number(self, tag: int, sizes: dict[int, str], what: str) -> int:
        if tag not in sizes:
            raise self.fail(f"{self.where} is malformed (expected {what})")
        code = sizes[tag]
        return int(struct.unpack(code, self.exact(struct.calcsize(code)))[0])

    def key(self, expected: str) -> None:
        if self.exact(2) != b"\xa1" + expected.encode():
            raise self.fail(f"{self.where} is malformed (expected key {expected!r})")

    def read_into(self, digest: bytes, length: int, content_size: int, target: memoryview) -> None:
        if target.nbytes != length:
            raise ValueError("target buffer has the wrong size")
        if self.exact(1) != b"\x83":
            raise self.fail(f"{self.where} is malformed (not a 3-entry map)")
        self.key("h")
        if self.number(self.exact(1)[0], _BIN, "bytes") != len(digest) or self.exact(len(digest)) != digest:
            raise self.fail(f"{self.where} is not the blob the call refers to")
        self.key("n")
        tag = self.exact(1)[0]
        declared = tag if tag <= 0x7F else self.number(tag, _UNSIGNED, "an unsigned int")
        if declared != length:
            raise self.fail(f"{self.where} is not the blob the call refers to (length)")
        self.key("d")
        tag = self.exact(1)[0]
        if tag in _BIN:
            self.fill(target, self.number(tag, _BIN, "bytes"))
        else:
            count = tag - 0x90 if 0x90 <= tag <= 0x9F else self.number(tag, _ARRAY, "bytes or an array")
            filled = 0
            for _ in range(count):
                piece = self.number(self.exact(1)[0], _BIN, "bytes")
                if filled + piece > length:
                    raise self.fail(f"{self.where} is malformed (payload larger than declared)")
                self.fill(target[filled : filled + piece], piece)
                filled += piece
            if filled != length:
                raise self.fail(f"{self.where} is malformed (payload smaller than declared)")
        if self.stream.read(1):
            raise self.fail(f"{self.where} has bytes after its payload")
        if self.consumed != content_size:
            raise self.fail(f"{self.where} declares {content_size} bytes but holds {self.consumed}")

    def fill(self, window: memoryview, declared: int) -> None:
        if declared != window.nbytes:
            raise self.fail(f"{self.where} is malformed (payload size {declared}, expected {window.nbytes})")
        done = 0
        while done < window.nbytes:
            count = self.stream.readinto(window[done:])
            if not count:
                raise self.fail(f"{self.where} ends early")
            done += count
        self.consumed += window.nbytes


def _bin_header(length: int) -> bytes:
    """msgpack bin 8/16/32 header (msgpack-python has no public packer for it)."""
    if length < 2**8:
        return struct.pack(">BB", 0xC4, length)
    if length < 2**16:
        return struct.pack(">BH", 0xC5, length)
    return struct.pack(">BI", 0xC6, length)


def _one_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
