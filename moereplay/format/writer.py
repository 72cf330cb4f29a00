"""``CaptureWriter``: append kernel calls to a capture file.

Per call the writer emits, in this order: the blobs of storages it has not stored yet, the call record
(status ``inputs_saved``), later the completion record (outputs, timings, status). Every ``index_every`` calls
it appends an index record; ``close`` appends a last index, the footer and the tail. A crash at any point leaves
a file readable up to its last whole record.

Tensors may live on any device: the writer itself copies the bytes it stores to the host, synchronously, inside
``begin_call`` / ``complete_call`` (for CUDA that waits for the current stream), so call these from the thread
that owns the tensors, after the work producing them was queued. The writer keeps the storages of a call's
arguments alive until its ``complete_call`` so that an output's storage is matched to an input's by address
without risk of address reuse.

Blobs are deduplicated by sha256 of their bytes within the file. For tensors the caller knows are *static*
(weights, scales: the same storage with the same bytes on every call), ``begin_call(..., static=names)`` also
skips the device copy and the hash after the first time: those storages are cached by identity (device, data
pointer, storage size, span, version counter where torch tracks one — inference tensors do not) and kept alive
by the cache. Marking a tensor static promises its bytes do not change while it lives; mark only weights.

Hashing and compression can run on a pool of ``workers`` threads (hashlib and zstd release the GIL): the
blobs of one call are hashed and compressed at once and written in order as they finish, and
:meth:`CaptureWriter.prefetch` starts that work for host bytes a *later* call will store (the capture writer
thread does so for the calls waiting in its queue), so hashing and compression overlap each other, the file
writes and earlier calls. The file is the same either way: a blob frame depends only on its bytes and the
compression level, and records are written in the order of the serial writer. A prefetched blob whose digest
the file already holds when its hash is done is not compressed.

A pool that refuses work never loses a record: ``concurrent.futures`` makes every pool refuse new work once the
interpreter's shutdown has begun (its ``threading._register_atexit`` hook runs before any ``atexit`` handler), and a
broken pool refuses too. From the first refusal on, this writer hashes and compresses on the calling thread, as
without a pool (``prefetch`` then starts nothing); the file is the same.

Thread-safe (one lock); not async. Not for concurrent writers on one path.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

from moereplay.errors import CaptureFileError, FileLimitError, UnsupportedValueError
from moereplay.format.dtypes import dtype_name
from moereplay.format.environment import collect_environment, late_gpu
from moereplay.format.framing import (
    BLOB_HASH,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    EncodedBlob,
    FrameSink,
    RecordKind,
)
from moereplay.format.records import COMPLETION_STATUSES
from moereplay.format.schema import TensorBytes, Unsupported
from moereplay.format.tensors import span_start, storage_span_to_host, unsupported_reason
from moereplay.format.values import to_wire

DEFAULT_MAX_WORKERS = 4
"""Cap of :func:`default_workers` (measured on the H200 machine, 16 CPUs, gpt-oss prefill: 4 workers with 2 zstd
threads per frame sustained 1079 MB/s; 8 workers without zstd threads 449 MB/s — more threads than cores contend)."""
POOL_MIN_BYTES = 256 * 1024
"""Blobs smaller than this are hashed and compressed on the calling thread even with a pool: handing them over
would cost more than the work (decode-sized activations are a few kB)."""

_UNFLUSHED_RECORDS = 4096
"""Records written and not yet known to be on disk after which the writer checks the file's size (``kept``)."""

MAX_PENDING_CALLS = 256
"""Begun, not yet completed calls whose argument storages the writer keeps alive (oldest forgotten first; a
forgotten call can still be completed, but its outputs are then not matched to its inputs' storages)."""


def default_workers() -> int:
    """Hash/compress worker threads when asked for "one per CPU, within reason": a quarter of the CPUs (each
    worker's zstd threads and the serving process need the rest), at least 1, at most :data:`DEFAULT_MAX_WORKERS`."""
    return max(1, min(DEFAULT_MAX_WORKERS, (os.cpu_count() or 4) // 4))


_Encoded = tuple[bytes, EncodedBlob | None]
"""A blob's digest and its compressed frame (``None``: the file already held that digest when it was hashed)."""


def _done(value: _Encoded) -> Future[_Encoded]:
    future: Future[_Encoded] = Future()
    future.set_result(value)
    return future


@dataclass
class _Prefetched:
    """Work started by :meth:`CaptureWriter.prefetch` for one host tensor (kept alive, so its identity holds)."""

    tensor: torch.Tensor
    future: Future[_Encoded]


@dataclass
class _StorageUse:
    """The part of one storage that one argument (or output) tree touches, and where its bytes come from:
    a live tensor on that storage (``tensor``), or bytes the caller copied (``given``)."""

    device: str
    start: int
    end: int
    static: bool
    tensor: torch.Tensor | None = None
    storage: Any = None
    address: int = 0
    storage_bytes: int = 0
    version: int = -1
    given: TensorBytes | None = None
    given_length: int = 0


@dataclass
class _CallStorages:
    """Storage ids of one call, shared by its arguments and outputs; keeps the argument storages alive."""

    ids: dict[tuple[Any, ...], int] = field(default_factory=dict)
    count: int = 0
    alive: list[Any] = field(default_factory=list)

    def new_id(self) -> int:
        self.count += 1
        return self.count - 1

    def id_for(self, key: tuple[Any, ...], keep: Any) -> int:
        storage_id = self.ids.get(key, -1)
        if storage_id < 0:
            storage_id = self.new_id()
            self.ids[key] = storage_id
            self.alive.append(keep)
        return storage_id


class _TreeTensors:
    """Collects the tensors of one value tree (arguments or outputs) while it is being encoded."""

    def __init__(self, storages: _CallStorages, static_lengths: Mapping[Any, int]) -> None:
        self.storages = storages
        self.static_lengths = static_lengths
        self.uses: dict[int, _StorageUse] = {}
        self.static = False

    def hook(self, tensor: torch.Tensor | TensorBytes) -> dict[str, Any] | Unsupported:
        if isinstance(tensor, TensorBytes):
            return self._record_given(tensor)
        reason = unsupported_reason(tensor)
        if reason is not None:
            return Unsupported("torch.Tensor", reason)
        try:
            payload = self._record(tensor)
        except Exception as error:  # fake / functional tensors and the like have no readable storage
            return Unsupported(
                f"{type(tensor).__module__}.{type(tensor).__qualname__}",
                f"storage not readable: {type(error).__name__}: {str(error)[:150]}",
            )
        return payload

    def _record(self, tensor: torch.Tensor) -> dict[str, Any]:
        itemsize = tensor.element_size()
        offset = int(tensor.storage_offset())
        shape, stride = list(tensor.shape), list(tensor.stride())
        device = str(tensor.device)
        if tensor.numel() == 0:
            storage_id = self.storages.new_id()
        else:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            storage_id = self.storages.id_for((device, address), storage)
            start, end = _span(offset, shape, stride, itemsize)
            try:
                version = tensor._version
            except RuntimeError:  # inference tensors track no version
                version = -1
            use = self.uses.get(storage_id)
            if use is None:
                self.uses[storage_id] = _StorageUse(
                    device, start, end, self.static, tensor, storage, address, storage.nbytes(), version
                )
            else:
                use.start, use.end = min(use.start, start), max(use.end, end)
                use.static = use.static or self.static
                use.version = max(use.version, version)
        return _payload(tensor.dtype, itemsize, shape, stride, offset, device, storage_id, tensor.is_conj())

    def _record_given(self, given: TensorBytes) -> dict[str, Any]:
        dtype, shape, stride = given.dtype, list(given.shape), list(given.stride)
        if not isinstance(dtype, torch.dtype) or len(shape) != len(stride):
            raise UnsupportedValueError(
                "TensorBytes needs a torch.dtype and a shape and stride of one length"
            )
        numbers = [*shape, *stride, given.storage_offset, given.base]
        if any(type(number) is not int or number < 0 for number in numbers):
            raise UnsupportedValueError(
                "TensorBytes shape, stride, offset and base must be non-negative ints"
            )
        itemsize = _itemsize(dtype)
        if math.prod(shape) == 0:
            storage_id = self.storages.new_id()
        else:
            data = given.data
            if data is not None:
                if data.dtype is not torch.uint8 or data.dim() != 1 or not data.is_contiguous():
                    raise UnsupportedValueError("TensorBytes.data must be a contiguous 1-D uint8 tensor")
                length = data.numel()
            elif given.static_key is not None and given.static_key in self.static_lengths:
                length = self.static_lengths[given.static_key]
            else:
                raise UnsupportedValueError(
                    f"TensorBytes without data and with unknown static key {given.static_key!r}"
                )
            storage_id = self.storages.id_for(("given", given.storage), given)
            start, end = _span(given.storage_offset, shape, stride, itemsize)
            use = self.uses.get(storage_id)
            if use is None:
                use = _StorageUse(given.device, given.base, given.base + length, self.static, given=given)
                use.given_length = length
                self.uses[storage_id] = use
            if use.given is None or start < use.start or end > use.end or (start - use.start) % itemsize:
                raise UnsupportedValueError(
                    f"TensorBytes view [{start}, {end}) lies outside the bytes given for its storage"
                )
        return _payload(dtype, itemsize, shape, stride, given.storage_offset, given.device, storage_id, False)


def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _span(offset: int, shape: list[int], stride: list[int], itemsize: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of the storage a non-empty view touches."""
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    return offset * itemsize, (last + 1) * itemsize


def _payload(
    dtype: torch.dtype,
    itemsize: int,
    shape: list[int],
    stride: list[int],
    offset: int,
    device: str,
    storage_id: int,
    conj: bool,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "dt": dtype_name(dtype),
        "is": itemsize,
        "sh": shape,
        "st": stride,
        "of": offset,
        "dev": device,
        "sid": storage_id,
    }
    if conj:
        payload["cj"] = True
    return payload


class CaptureWriter:
    """Write one capture file. Use as a context manager, or call :meth:`close`.

    ``header`` is merged (shallowly) over the automatic environment header; ``magic`` and
    ``format_version`` cannot be overridden. ``index_every``: calls between index records (smaller: faster
    recovery of random access, slightly larger files). ``compression_level``: zstd level for every frame.
    ``compression_threads``: zstd worker threads inside each blob frame (0: none; -1: one per CPU).
    ``workers``: threads that hash and compress blobs (0: the calling thread does, one blob after the other;
    -1: :func:`default_workers`) — see the module docstring.
    """

    def __init__(
        self,
        path: str | Path,
        header: Mapping[str, Any] | None = None,
        *,
        index_every: int = 64,
        compression_level: int = 3,
        compression_threads: int = 0,
        workers: int = 0,
    ) -> None:
        if index_every < 1:
            raise ValueError("index_every must be at least 1")
        if workers < -1:
            raise ValueError("workers must be >= -1")
        self.path = Path(path)
        self.index_every = index_every
        self._lock = threading.Lock()
        merged: dict[str, Any] = collect_environment()
        merged.update(header or {})
        merged["magic"] = MAGIC
        merged["format_version"] = [FORMAT_MAJOR, FORMAT_MINOR]
        merged["blob_hash"] = BLOB_HASH
        self.header: dict[str, Any] = merged
        wire_header = to_wire(merged, None)
        try:
            self._file: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        except OSError as error:
            raise CaptureFileError(f"{self.path}: cannot create: {error.strerror or error}") from error
        self._sink = FrameSink(self._file, compression_level, compression_threads)
        self.workers = default_workers() if workers == -1 else workers
        self._pool = (
            ThreadPoolExecutor(self.workers, thread_name_prefix="moereplay-blob") if self.workers else None
        )
        self._pool_refused: str | None = None  # why the pool refused work (from then on: no pool)
        self._prefetched: dict[int, _Prefetched] = {}
        self._hash_lock = threading.Lock()
        self._hash_seconds = 0.0
        self._wait_seconds = 0.0
        self._closed = False
        self._broken: str | None = None
        self._next_call = 0
        self._pending: OrderedDict[int, _CallStorages] = OrderedDict()
        self._forgotten: dict[int, int] = {}  # call index → storage ids its arguments used
        self._unindexed_calls: list[list[int]] = []
        self._unindexed_done: list[list[int]] = []
        self._last_index: int | None = None
        self._blobs: dict[bytes, int] = {}
        self._static_cache: dict[tuple[Any, ...], tuple[bytes, int, Any]] = {}
        self._static_given: dict[Any, tuple[bytes, int, int]] = {}
        self._static_lengths: dict[Any, int] = {}
        self.byte_limit = 0
        """When positive: a call or completion whose new blobs (uncompressed, before deduplication: an upper bound)
        would take the file past this many bytes raises :class:`FileLimitError` and records nothing."""
        self.blob_count = 0
        self.blob_bytes = 0
        self.completed = 0
        self.failed = 0
        self._flushed = (0, 0)  # (call, completion) records known to be on disk
        self._unflushed: list[tuple[int, bool]] = []  # (end offset, is a completion) of records written since
        self._kept: tuple[int, int] | None = None
        try:
            self._guarded(lambda: self._sink.write_document(RecordKind.HEADER, _version_value(), wire_header))
        except BaseException:
            self._closed = True
            self._file.close()
            self._stop_pool()
            raise

    # ------------------------------------------------------------------------------------------ public

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    @property
    def calls(self) -> int:
        """Calls begun so far."""
        return self._next_call

    @property
    def bytes_written(self) -> int:
        """Size of the file so far, in bytes (records handed to the file object, flushed or not)."""
        return self._sink.position

    @property
    def kept(self) -> tuple[int, int] | None:
        """After a failed write (disk full …): how many call and completion records the file holds whole — its
        size as the operating system had it when the write failed, against where each record ends (buffered
        records are counted as written before they reach the disk). ``None`` while no write failed."""
        return self._kept

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Cumulative seconds (for benchmarks): ``hash`` and ``compress`` are thread-seconds summed over the
        threads that did them (with ``workers`` they overlap each other and the rest, and count time slices lost
        to other threads when CPUs are short); ``write`` is the calling thread's time in file writes;
        ``pool_wait`` the calling thread's time waiting for the workers' results."""
        seconds = self._sink.seconds
        seconds["hash"] = self._hash_seconds
        seconds["pool_wait"] = self._wait_seconds
        return seconds

    def prefetch(self, data: torch.Tensor) -> bool:
        """Start hashing and compressing ``data`` (a contiguous 1-D uint8 CPU tensor whose bytes no longer
        change) on the worker pool, for a later ``begin_call``/``complete_call`` that stores it as
        ``TensorBytes.data`` — the very same tensor object. Returns whether work was started (no pool, a
        tensor under :data:`POOL_MIN_BYTES`, on another device or already prefetched: no). Release what a call will not use with :meth:`forget`.
        """
        if (
            self._pool is None
            or data.device.type != "cpu"
            or data.dtype is not torch.uint8
            or data.dim() != 1
            or not data.is_contiguous()
            or data.numel() < POOL_MIN_BYTES
        ):
            return False
        with self._lock:
            if self._closed or self._broken is not None or id(data) in self._prefetched:
                return False
            future = self._pool_submit(data.numpy().data.cast("B"))
            if future is None:
                return False
            self._prefetched[id(data)] = _Prefetched(data, future)
            return True

    def forget(self, data: torch.Tensor) -> None:
        """Drop the prefetched work for ``data`` (if any), e.g. when its call is not going to be written."""
        with self._lock:
            entry = self._prefetched.get(id(data))
            if entry is not None and entry.tensor is data:
                del self._prefetched[id(data)]
                entry.future.cancel()

    def begin_call(
        self,
        op: str,
        args: Mapping[str, Any],
        *,
        site: str = "",
        context: Mapping[Any, Any] | None = None,
        parent: int | None = None,
        static: Collection[str] = (),
    ) -> int:
        """Record a call's inputs (status ``inputs_saved``); return its index (0, 1, 2, … in this file).

        ``args``: argument name → value (tensors, scalars, containers, enums, codec objects).
        ``context``: small metadata (layer, step, rank, tags) — tensors there are recorded as unsupported.
        ``parent``: index of an enclosing call, if any. ``static``: names of arguments whose tensors are
        weights (see the module docstring). Raises UnsupportedValueError when a value cannot be encoded
        (a failing codec, cyclic data); nothing of the call is then recorded.
        """
        if not isinstance(op, str) or not op:
            raise ValueError("op must be a non-empty string")
        if not isinstance(site, str):
            raise ValueError("site must be a string")
        if parent is not None and type(parent) is not int:
            raise ValueError("parent must be a call index or None")
        _check_names(args, "argument")
        static_names = frozenset(static)
        with self._lock:
            self._check_writable()
            storages = _CallStorages()
            tensors = _TreeTensors(storages, self._static_lengths)
            wire_args: dict[str, Any] = {}
            for name, value in args.items():
                tensors.static = name in static_names
                wire_args[name] = to_wire(value, tensors.hook)
            wire_context = to_wire(dict(context or {}), None)
            index = self._next_call

            def write() -> int:
                entries = self._store(tensors)
                document = {
                    "i": index,
                    "op": op,
                    "site": site,
                    "parent": parent,
                    "t": time.time(),
                    "ctx": wire_context,
                    "args": wire_args,
                    "static": sorted(static_names & set(args)),
                    "storages": entries,
                }
                return self._sink.write_document(RecordKind.CALL, index, document)

            self._check_limit(tensors)
            offset = self._guarded(write)
            self._record_written(False)
            self._next_call += 1
            self._pending[index] = storages
            if len(self._pending) > MAX_PENDING_CALLS:
                forgotten, old = self._pending.popitem(last=False)
                self._forgotten[forgotten] = old.count
            self._unindexed_calls.append([index, offset])
            if len(self._unindexed_calls) >= self.index_every:
                self._guarded(self._write_index)
            return index

    def complete_call(
        self,
        index: int,
        outputs: Mapping[str, Any],
        *,
        timings: Mapping[str, float] | None = None,
        status: str = "completed",
        error: str | None = None,
    ) -> None:
        """Record a call's outputs and timings; ``status`` is ``completed`` or ``failed`` (with ``error``).

        Outputs that are views of an argument's storage keep that argument's storage id, so readers see
        in-place writes as aliasing.
        """
        if status not in COMPLETION_STATUSES:
            raise ValueError(f"status must be one of {COMPLETION_STATUSES}, not {status!r}")
        if error is not None and not isinstance(error, str):
            raise ValueError("error must be a string or None")
        _check_names(outputs, "output")
        clean_timings = {str(name): float(value) for name, value in (timings or {}).items()}
        with self._lock:
            self._check_writable()
            storages = self._pending.get(index)
            if storages is None and index in self._forgotten:
                # completed very late: recorded, with fresh storage ids (no aliasing to its inputs)
                storages = _CallStorages(count=self._forgotten[index])
            if storages is None:
                raise ValueError(f"call {index} was not begun in this file, or was already completed")
            tensors = _TreeTensors(storages, self._static_lengths)
            wire_outputs = {name: to_wire(value, tensors.hook) for name, value in outputs.items()}

            def write() -> int:
                entries = self._store(tensors)
                document = {
                    "i": index,
                    "status": status,
                    "error": error,
                    "t": time.time(),
                    "timings": clean_timings,
                    "outputs": wire_outputs,
                    "storages": entries,
                }
                return self._sink.write_document(RecordKind.COMPLETION, index, document)

            self._check_limit(tensors)
            offset = self._guarded(write)
            self._record_written(True)
            self._pending.pop(index, None)
            self._forgotten.pop(index, None)
            self._unindexed_done.append([index, offset])
            if status == "completed":
                self.completed += 1
            else:
                self.failed += 1

    def flush(self) -> None:
        """Hand buffered records to the operating system (no fsync)."""
        with self._lock:
            if not self._closed:
                self._guarded(self._file.flush)
                self._on_disk()

    def close(self, counters: Mapping[str, int] | None = None) -> None:
        """Write the last index, the footer (with ``counters``, e.g. dropped calls) and the tail; close.

        Idempotent. A writer whose file failed (disk full …) just closes the file.
        """
        clean_counters = {str(name): int(value) for name, value in (counters or {}).items()}
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._broken is None:
                    self._guarded(lambda: self._finish(clean_counters))
            finally:
                self._pending.clear()
                self._forgotten.clear()
                self._static_cache.clear()
                self._static_given.clear()
                self._prefetched.clear()
                self._file.close()
                self._stop_pool()

    # ----------------------------------------------------------------------------------------- private

    def _check_writable(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: the capture writer is closed")
        if self._broken is not None:
            raise CaptureFileError(
                f"{self.path}: an earlier write failed ({self._broken}); nothing more is written"
            )

    def _guarded(self, action: Any) -> Any:
        try:
            return action()
        except OSError as error:
            self._broken = error.strerror or str(error)
            self._kept = self._on_disk()
            for entry in self._prefetched.values():
                entry.future.cancel()
            self._prefetched.clear()
            raise CaptureFileError(f"{self.path}: write failed: {self._broken}") from error
        except (TypeError, ValueError, OverflowError) as error:  # msgpack refused a value (e.g. a surrogate)
            raise UnsupportedValueError(
                f"{self.path}: cannot encode: {type(error).__name__}: {error}"
            ) from error

    def _record_written(self, completion: bool) -> None:
        self._unflushed.append((self._sink.position, completion))
        if len(self._unflushed) >= _UNFLUSHED_RECORDS:  # never flushed by the caller: bounded all the same
            self._on_disk()

    def _on_disk(self) -> tuple[int, int]:
        """(calls, completions) whose records the file on disk holds whole: those of earlier checks plus those
        written since that end within the file's size as the operating system has it (one ``fstat``)."""
        try:
            size = os.fstat(self._file.fileno()).st_size
        except (OSError, ValueError):
            size = -1
        whole = [done for end, done in self._unflushed if end <= size]
        calls, completions = self._flushed
        self._flushed = (calls + whole.count(False), completions + whole.count(True))
        self._unflushed = [entry for entry in self._unflushed if entry[0] > size]
        return self._flushed

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _given_cached(self, use: _StorageUse) -> tuple[bytes, int, int] | None:
        """Where this file already holds a given static tensor's bytes (same key and length), else None."""
        assert use.given is not None
        key = use.given.static_key
        cached = self._static_given.get(key) if key is not None else None
        return cached if cached is not None and cached[2] == use.given_length else None

    @staticmethod
    def _static_key(use: _StorageUse, base: int) -> tuple[Any, ...]:
        """A live static tensor's identity in :attr:`_static_cache` (storage, span, version)."""
        return (use.device, use.address, use.storage_bytes, base, use.end, use.version)

    def _new_bytes(self, tensors: _TreeTensors) -> int:
        """Bytes of the blobs :meth:`_store` would write for ``tensors`` before compression and deduplication:
        every storage span except static ones this file already holds (weights are written once per file)."""
        total = 0
        for use in tensors.uses.values():
            if use.given is not None:
                total += 0 if self._given_cached(use) is not None else use.given_length
                continue
            base = span_start(use.start)
            if not (use.static and self._static_key(use, base) in self._static_cache):
                total += use.end - base
        return total

    def _check_limit(self, tensors: _TreeTensors) -> None:
        if self.byte_limit <= 0:
            return
        needed = self._new_bytes(tensors)
        if self.bytes_written + needed > self.byte_limit:
            raise FileLimitError(
                f"the record needs up to {needed} bytes of new blobs; the file holds {self.bytes_written} of "
                f"its {self.byte_limit}"
            )

    def _store(self, tensors: _TreeTensors) -> dict[int, dict[str, Any]]:
        """Write the blobs a tree needs; return its storage table (storage id → where its bytes are).

        Every blob's hash and compression is started first (on the pool, if any), then the blobs are written
        in storage order as their results arrive."""
        entries: dict[int, dict[str, Any]] = {}
        static_keys: dict[int, tuple[Any, ...]] = {}
        given_keys: dict[int, tuple[Any, int]] = {}
        work: list[tuple[int, memoryview, Future[_Encoded]]] = []  # (storage id, bytes, digest and frame)
        for storage_id, use in tensors.uses.items():
            if use.given is not None:
                given, key, length = use.given, use.given.static_key, use.given_length
                cached = self._given_cached(use)
                if cached is not None:
                    entries[storage_id] = self._given_entry(given, use.start, length, cached[0], cached[1])
                    continue
                if given.data is None:
                    raise UnsupportedValueError(f"TensorBytes without data for static key {key!r}")
                host = given.data if given.data.device.type == "cpu" else given.data.cpu()
                data = host.numpy().data.cast("B")
                prefetched = self._prefetched.pop(id(host), None)
                if prefetched is not None and prefetched.tensor is host:
                    future = prefetched.future
                else:
                    future = self._submit(data)
                if key is not None:
                    given_keys[storage_id] = (key, length)
                work.append((storage_id, data, future))
                continue
            assert use.tensor is not None
            base = span_start(use.start)
            static_key = self._static_key(use, base)
            cached_static = self._static_cache.get(static_key) if use.static else None
            if cached_static is not None:
                entries[storage_id] = self._storage_entry(use, base, cached_static[0], cached_static[1])
                continue
            if use.static:
                static_keys[storage_id] = static_key
            host_view = storage_span_to_host(use.tensor, base, use.end)
            work.append((storage_id, host_view, self._submit(host_view)))
        for storage_id, data, future in work:
            length = data.nbytes
            digest, offset = self._write_encoded(future, data)
            use = tensors.uses[storage_id]
            if use.given is not None:
                entries[storage_id] = self._given_entry(use.given, use.start, length, digest, offset)
                if storage_id in given_keys:
                    key, _ = given_keys[storage_id]
                    self._static_given[key] = (digest, offset, length)
                    self._static_lengths[key] = length
            else:
                base = span_start(use.start)
                entries[storage_id] = self._storage_entry(use, base, digest, offset)
                if storage_id in static_keys:
                    self._static_cache[static_keys[storage_id]] = (digest, offset, use.storage)
        return {storage_id: entries[storage_id] for storage_id in tensors.uses}

    @staticmethod
    def _storage_entry(use: _StorageUse, base: int, digest: bytes, offset: int) -> dict[str, Any]:
        return {
            "h": digest,
            "at": offset,
            "base": base,
            "n": use.end - base,
            "sz": use.storage_bytes,
            "dev": use.device,
        }

    @staticmethod
    def _given_entry(
        given: TensorBytes, base: int, length: int, digest: bytes, offset: int
    ) -> dict[str, Any]:
        return {"h": digest, "at": offset, "base": base, "n": length, "dev": given.device}

    def _submit(self, data: memoryview) -> Future[_Encoded]:
        """Hash and (unless the file holds it already) compress ``data`` on the pool; without a pool (or once it
        refused work), hash it here and now (the blob is compressed when it is written, if it is new)."""
        future = self._pool_submit(data) if data.nbytes >= POOL_MIN_BYTES else None
        if future is None:
            return _done(self._encode(data, False))
        return future

    def _pool_submit(self, data: memoryview) -> Future[_Encoded] | None:
        """``data``'s hash and compression started on the pool, or ``None`` when there is no pool or it refuses
        work (interpreter shutdown, a broken pool): the caller then does the work itself (lock held)."""
        if self._pool is None or self._pool_refused is not None:
            return None
        try:
            return self._pool.submit(self._encode, data, True)
        # "cannot schedule new futures after interpreter shutdown"; BrokenExecutor is a RuntimeError too
        except RuntimeError as error:
            self._pool_refused = str(error)
            return None

    @property
    def pool_refused(self) -> str | None:
        """Why the worker pool refused work (hashing and compression moved to the calling thread), or ``None``."""
        return self._pool_refused

    def _encode(self, data: memoryview, compress: bool) -> _Encoded:
        """Runs on a worker (or the calling thread without a pool). Bytes whose digest the file already holds
        are not compressed (a dict lookup is safe while the writing thread adds to the dict)."""
        started = time.perf_counter()
        digest = hashlib.new(BLOB_HASH, data).digest()
        elapsed = time.perf_counter() - started
        with self._hash_lock:
            self._hash_seconds += elapsed
        if not compress or digest in self._blobs:
            return digest, None
        return digest, self._sink.encoder.encode(digest, data)

    def _write_encoded(self, future: Future[_Encoded], data: memoryview) -> tuple[bytes, int]:
        """Wait for a blob's digest and frame; write the frame unless this file already holds those bytes.
        Returns (digest, offset)."""
        started = time.perf_counter()
        digest, encoded = future.result()
        self._wait_seconds += time.perf_counter() - started
        offset = self._blobs.get(digest)
        if offset is None:
            if encoded is None:  # no pool: compress here
                encoded = self._sink.encoder.encode(digest, data)
            offset = self._sink.write_encoded(encoded)
            self._blobs[digest] = offset
            self.blob_count += 1
            self.blob_bytes += data.nbytes
        return digest, offset

    def _write_index(self) -> None:
        document = {"calls": self._unindexed_calls, "done": self._unindexed_done, "prev": self._last_index}
        self._last_index = self._sink.write_document(RecordKind.INDEX, len(self._unindexed_calls), document)
        self._unindexed_calls, self._unindexed_done = [], []

    def _finish(self, counters: dict[str, int]) -> None:
        if self._unindexed_calls or self._unindexed_done or self._last_index is None:
            self._write_index()
        footer = {
            "index": self._last_index,
            "calls": self._next_call,
            "completed": self.completed,
            "failed": self.failed,
            "pending": len(self._pending) + len(self._forgotten),
            "blobs": self.blob_count,
            "blob_bytes": self.blob_bytes,
            "counters": counters,
            "t": time.time(),
        }
        gpu = late_gpu(self.header.get("gpu"))
        if (
            gpu is not None
        ):  # CUDA was not initialised when the header was written (a serving worker arms early)
            footer["gpu"] = gpu
        offset = self._sink.write_document(RecordKind.FOOTER, self._next_call, footer)
        self._sink.write_tail(offset)
        self._file.flush()


def _version_value() -> int:
    """The header envelope's value: ``major << 32 | minor`` (lets a reader refuse a version before decoding)."""
    return FORMAT_MAJOR << 32 | FORMAT_MINOR


def _check_names(values: Mapping[str, Any], what: str) -> None:
    if not isinstance(values, Mapping):
        raise ValueError(f"{what}s must be a mapping of names to values")
    for name in values:
        if not isinstance(name, str):
            raise ValueError(f"{what} names must be strings, got {name!r}")
