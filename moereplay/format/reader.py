"""``CaptureReader``: list, inspect and load the calls of a capture file.

Opening reads the header and then either the footer and its chain of index records (a closed file: no scan),
or — when the footer is missing or unreadable — walks the record envelopes (32 bytes each, nothing
decompressed) to find every whole call and completion record. Listing decompresses call and completion
records only; blob frames are read only by :meth:`CaptureReader.load_args` / :meth:`load_outputs`.

Opening and listing do not import torch (≈200 MB resident, ≈1 s): it is imported when tensors are loaded, or
when a record holds a dtype, device or ``torch.Size`` value (see :mod:`moereplay.format.values`).
"""

from __future__ import annotations

import fnmatch
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from moereplay.errors import (
    CaptureFileError,
    MemoryBudgetError,
    MoereplayError,
    TruncatedFileError,
    UnsupportedValueError,
)
from moereplay.format.budget import BUDGET_VARIABLE, default_memory_budget
from moereplay.format.codecs import codec_for
from moereplay.format.dtypes import ITEMSIZES, LOADABLE
from moereplay.format.framing import (
    DEFAULT_MAX_BLOB_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    ENVELOPE_SIZE,
    FORMAT_MAJOR,
    MAGIC,
    Envelope,
    FrameSource,
    ReadLimits,
    RecordKind,
    pack_envelope,
)
from moereplay.format.records import (
    CALL_STATUSES,
    COMPLETION_STATUSES,
    CallRecord,
    CallStatus,
    CaptureStats,
    DamagedCall,
    Recovery,
)
from moereplay.format.schema import CodecValue, TensorMeta, iter_tensor_metas
from moereplay.format.values import ext_hook
from moereplay.wording import plural

if TYPE_CHECKING:
    import torch

_DIGEST_BYTES = 32
DEFAULT_BLOB_CACHE_BYTES = 256 * 2**20
_CUT = "the file ends inside a record"
_RESYNC_CHUNK = 1 << 20


@dataclass
class _Slot:
    call: int
    completion: int | None = None


@dataclass(frozen=True)
class _Storage:
    digest: bytes
    offset: int
    base: int
    length: int


@dataclass(frozen=True)
class _Phase:
    """One decoded value tree (arguments or outputs) and the storage table it refers to."""

    tree: dict[str, Any]
    storages: dict[int, _Storage]


class CaptureReader:
    """Read one capture file. Use as a context manager, or call :meth:`close`.

    ``max_frame_bytes`` caps one decompressed metadata record; ``max_blob_bytes`` caps one blob. Claims over
    either (or over what the file can hold) are refused before anything is allocated. ``verify_hashes``
    re-hashes every blob loaded (sha256, ~1.5 GB/s); zstd checksums are always checked.
    ``memory_budget``: the most bytes loading one call's arguments or outputs may allocate (default:
    :func:`~moereplay.format.budget.default_memory_budget`, ``MOEREPLAY_LOAD_BUDGET`` or ¾ of the available
    memory); checked before anything is allocated. ``blob_cache_bytes``: verified blob bytes kept (least recently used first out) so loading many calls that
    share weights decodes them once; every load still gets fresh buffers. 0 disables it.

    One reader is used by one thread at a time (it owns a file position); open one per thread.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        verify_hashes: bool = True,
        blob_cache_bytes: int = DEFAULT_BLOB_CACHE_BYTES,
        memory_budget: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self.verify_hashes = verify_hashes
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = blob_cache_bytes
        self._source = FrameSource(self.path, ReadLimits(max_frame_bytes, max_blob_bytes))
        try:
            self.header, self._header_end = self._read_header()
            self._slots, self.footer, self.recovery = self._read_table()
        except BaseException:
            self._source.close()
            raise
        self._order = sorted(self._slots)

    # ------------------------------------------------------------------------------------------ public

    def __enter__(self) -> CaptureReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._source.close()

    def __len__(self) -> int:
        return len(self._order)

    @property
    def file_bytes(self) -> int:
        return self._source.size

    @property
    def bytes_read(self) -> int:
        """Bytes read from the file so far (diagnostics; listing stays far below the blob bytes)."""
        return self._source.bytes_read

    @property
    def blob_frames_read(self) -> int:
        """Blob frames read so far (only loading tensors reads them)."""
        return self._source.blob_frames_read

    @property
    def indices(self) -> list[int]:
        """Recorded call indices, ascending."""
        return list(self._order)

    def calls(self) -> Iterator[CallRecord]:
        """Every readable call, in index order, without reading blobs (damaged ones: :meth:`entries`)."""
        for entry in self.entries():
            if isinstance(entry, CallRecord):
                yield entry

    def entries(self) -> Iterator[CallRecord | DamagedCall]:
        """Every call the file lists, in index order: a :class:`CallRecord`, or a :class:`DamagedCall` saying why
        its records cannot be read — one bad record hides nothing else."""
        for index in self._order:
            try:
                yield self.call(index)
            except CaptureFileError as error:
                yield DamagedCall(
                    index, str(error).removeprefix(f"{self.path}: ").removeprefix(f"call {index}: ")
                )

    @property
    def damaged(self) -> dict[int, str]:
        """Call index → why it cannot be read, for every damaged call (reads every call and completion record)."""
        return {entry.index: entry.problem for entry in self.entries() if isinstance(entry, DamagedCall)}

    def call(self, index: int) -> CallRecord:
        """Random access to one call through the index."""
        call, completion = self._documents(index)
        status: CallStatus = "inputs_saved" if completion is None else completion["status"]
        return CallRecord(
            index=index,
            op=call["op"],
            site=call["site"],
            context=call["ctx"],
            parent=call["parent"],
            status=status,
            args=call["args"],
            outputs=None if completion is None else completion["outputs"],
            timings={} if completion is None else completion["timings"],
            error=None if completion is None else completion["error"],
            static=tuple(call["static"]),
            started=call["t"],
            finished=None if completion is None else completion["t"],
        )

    def load_args(self, index: int, device: str | torch.device = "cpu") -> dict[str, Any]:
        """The call's arguments with tensors materialised on ``device`` and codec objects decoded.

        Views of one recorded storage come back as views of one buffer holding the stored span; shapes and
        strides are the recorded ones, storage offsets are relative to that span. Storages recorded with the same
        bytes (one blob) share one buffer: clone a tensor before writing to it in place.
        """
        call, _ = self._documents(index)
        return self._materialise(index, "arguments", _Phase(call["args"], call["storages"]), device)

    def load_outputs(self, index: int, device: str | torch.device = "cpu") -> dict[str, Any]:
        """The call's outputs as recorded after it ran (see :meth:`CallRecord.aliases` for in-place writes)."""
        _, completion = self._documents(index)
        if completion is None:
            raise CaptureFileError(f"{self.path}: call {index} has no recorded outputs (status inputs_saved)")
        return self._materialise(
            index, "outputs", _Phase(completion["outputs"], completion["storages"]), device
        )

    @property
    def counters(self) -> dict[str, int]:
        """The footer's counters (the writing process's counts and timers): the integer ones only — a file
        written by someone else may hold anything there, and every reader of them does arithmetic."""
        found = self.footer.get("counters") if self.footer else None
        if not isinstance(found, dict):
            return {}
        return {
            name: value
            for name, value in found.items()
            if isinstance(name, str) and isinstance(value, int) and not isinstance(value, bool)
        }

    def stats(self) -> CaptureStats:
        """Counts and sizes over every call (reads call and completion records, not blobs)."""
        by_op: dict[str, Counter[str]] = {}
        by_status: Counter[str] = Counter()
        unique: dict[bytes, int] = {}
        referenced = tensor_bytes = expanded_bytes = largest = 0
        largest_call: int | None = None
        damaged: dict[int, str] = {}
        for index in self._order:
            try:
                call, completion = self._documents(index)
            except CaptureFileError as error:
                damaged[index] = str(error).removeprefix(f"{self.path}: ").removeprefix(f"call {index}: ")
                continue
            status = "inputs_saved" if completion is None else completion["status"]
            by_op.setdefault(call["op"], Counter())[status] += 1
            by_status[status] += 1
            needs = 0
            for document, tree in ((call, "args"), (completion, "outputs")):
                if document is None:
                    continue
                for storage in document["storages"].values():
                    unique[storage.digest] = storage.length
                    referenced += storage.length
                elements = sum(meta.nbytes for _, meta in iter_tensor_metas(document[tree]))
                tensor_bytes += elements
                kept = _declared_tensor_bytes(document[tree])
                expanded_bytes += elements + kept
                needs += sum(storage.length for storage in document["storages"].values()) + kept
            if largest_call is None or needs > largest:
                largest_call, largest = index, needs
        unique_bytes = sum(unique.values())
        return CaptureStats(
            calls=len(self._order) - len(damaged),
            by_op={op: dict(counts) for op, counts in sorted(by_op.items())},
            by_status={status: by_status[status] for status in CALL_STATUSES if by_status[status]},
            file_bytes=self._source.size,
            blobs=len(unique),
            unique_blob_bytes=unique_bytes,
            referenced_blob_bytes=referenced,
            tensor_bytes=tensor_bytes,
            expanded_bytes=expanded_bytes,
            largest_call=largest_call,
            largest_call_bytes=largest,
            dedup_ratio=referenced / unique_bytes if unique_bytes else 1.0,
            counters=self.counters,
            damaged=damaged,
        )

    def select(
        self,
        *,
        op: str | None = None,
        layer: Any = None,
        status: str | None = None,
        step: Any = None,
    ) -> Iterator[CallRecord]:
        """Calls filtered by op glob (``fnmatch``), layer (``context["layer"]`` compared as text, or a glob over
        ``context["layer_name"]``, vLLM's module name such as ``model.layers.3.mlp.experts``), status and
        ``context["step"]`` (compared as text)."""
        for record in self.calls():
            if op is not None and not fnmatch.fnmatchcase(record.op, op):
                continue
            if layer is not None and not _layer_matches(record.context, str(layer)):
                continue
            if status is not None and record.status != status:
                continue
            if step is not None and str(record.context.get("step")) != str(step):
                continue
            yield record

    # -------------------------------------------------------------------------------------- opening

    def _read_header(self) -> tuple[dict[str, Any], int]:
        source = self._source
        if source.size == 0:
            raise source.fail("empty file, not a moereplay capture")
        expected = pack_envelope(RecordKind.HEADER, 0, 0)[:11]
        start = source.read_prefix(len(expected))
        if start != expected[: len(start)]:
            raise source.fail("not a moereplay capture file (bad magic)")
        try:
            envelope = source.envelope_at(0)
        except TruncatedFileError:
            raise
        except CaptureFileError as error:
            raise source.fail("not a moereplay capture file (bad magic)") from error
        if envelope.kind is not RecordKind.HEADER:
            raise source.fail("not a moereplay capture file (no header record)")
        major, minor = envelope.value >> 32, envelope.value & 0xFFFFFFFF
        if major != FORMAT_MAJOR:
            raise source.fail(
                f"capture format {major}.{minor} is not supported (this moereplay reads {FORMAT_MAJOR}.x)"
            )
        _, header = source.document_at(0, RecordKind.HEADER, ext_hook)
        if header.get("magic") != MAGIC:
            raise source.fail("not a moereplay capture file (bad magic in the header)")
        version = header.get("format_version")
        if not (
            isinstance(version, list) and len(version) == 2 and all(type(part) is int for part in version)
        ):
            raise source.fail("the header has no valid format_version")
        if version[0] != FORMAT_MAJOR:
            raise source.fail(
                f"capture format {version[0]}.{version[1]} is not supported (this moereplay reads {FORMAT_MAJOR}.x)"
            )
        return header, envelope.end

    def _read_table(self) -> tuple[dict[int, _Slot], dict[str, Any] | None, Recovery]:
        source = self._source
        problem = ""
        tail_offset = source.size - ENVELOPE_SIZE
        if tail_offset >= self._header_end:
            try:
                tail: Envelope | None = source.envelope_at(tail_offset)
            except CaptureFileError:
                tail = None
            if tail is not None and tail.kind is RecordKind.TAIL:
                try:
                    slots, footer = self._read_indexed(tail)
                except CaptureFileError as error:
                    problem = str(error).removeprefix(f"{self.path}: ")
                else:
                    return self._verify_indexed(slots, footer, tail)
        return self._scan(problem)

    def _verify_indexed(
        self, slots: dict[int, _Slot], footer: dict[str, Any], tail: Envelope
    ) -> tuple[dict[int, _Slot], dict[str, Any], Recovery]:
        """Walk every record envelope between the header and the tail (32 bytes each, nothing decompressed): a
        file holds exactly what its index lists, so records the index does not list (appended or spliced in after
        the file was closed) or damaged bytes between records mean it is not complete. Unindexed calls whose index
        is free are listed too — they are recorded data."""
        indexed = {slot.call for slot in slots.values()} | {
            slot.completion for slot in slots.values() if slot.completion is not None
        }
        found: list[Envelope] = []
        damaged = self._walk(self._header_end, tail.offset, found)
        extra = [
            envelope
            for envelope in found
            if envelope.kind in (RecordKind.CALL, RecordKind.COMPLETION) and envelope.offset not in indexed
        ]
        notes = list(damaged)
        if extra:
            for envelope in extra:
                slot = slots.get(envelope.value)
                if envelope.kind is RecordKind.CALL and slot is None:
                    slots[envelope.value] = _Slot(envelope.offset)
                elif envelope.kind is RecordKind.COMPLETION and slot is not None and slot.completion is None:
                    slot.completion = envelope.offset
            notes.append(
                f"{len(extra)} {envelope_kinds(extra)} the index does not list (first at offset {extra[0].offset})"
            )
        if not notes:
            message = f"complete: {_count(len(slots), 'call')}, footer and index present"
            return slots, footer, Recovery(True, False, None, len(slots), message)
        message = f"footer and index present, but {'; '.join(notes)}: not complete; {_count(len(slots), 'call')} listed"
        return slots, footer, Recovery(False, False, None, len(slots), message)

    def _walk(self, position: int, end: int, found: list[Envelope]) -> list[str]:
        """Append every readable envelope in ``[position, end)`` to ``found``; return what was damaged (skipped
        by searching for the next envelope)."""
        source = self._source
        damaged: list[str] = []
        while position < end:
            try:
                envelope = source.envelope_at(position)
                if envelope.end > end:
                    raise source.fail(f"the record at offset {position} runs past offset {end}")
            except CaptureFileError as error:
                resumed = self._resync(position + 1, end)
                reason = str(error).removeprefix(f"{self.path}: ")
                damaged.append(f"damaged bytes {position}-{resumed} skipped ({reason})")
                position = resumed
                continue
            found.append(envelope)
            position = envelope.end
        return damaged

    def _resync(self, start: int, end: int) -> int:
        """Offset of the first readable envelope in ``[start, end)`` (``end`` when there is none). Reads the
        bytes in between once, 1 MiB at a time; the envelope's 10-byte prefix and CRC make false hits rare,
        and a false hit is only an envelope that fails its next check."""
        source = self._source
        prefix = pack_envelope(RecordKind.HEADER, 0, 0)[:10]
        position = start
        while position < end:
            chunk = source.read_range(position, min(_RESYNC_CHUNK, end - position))
            found = chunk.find(prefix)
            while found >= 0:
                candidate = position + found
                try:
                    envelope = source.envelope_at(candidate)
                except CaptureFileError:
                    found = chunk.find(prefix, found + 1)
                    continue
                if envelope.end <= end:
                    return candidate
                found = chunk.find(prefix, found + 1)
            if position + len(chunk) >= end:
                break
            position += max(len(chunk) - len(prefix) + 1, 1)
        return end

    def _read_indexed(self, tail: Envelope) -> tuple[dict[int, _Slot], dict[str, Any]]:
        source = self._source
        footer_envelope, footer = source.document_at(
            _offset(source, tail.value, self._header_end), RecordKind.FOOTER
        )
        if footer_envelope.end != tail.offset:
            raise source.fail("the footer is not followed by the tail")
        slots: dict[int, _Slot] = {}
        done: dict[int, int] = {}
        position = footer.get("index")
        limit = footer_envelope.offset
        while position is not None:
            position = _offset(source, position, self._header_end)
            if position >= limit:
                raise source.fail(f"index chain points forward (offset {position})")
            _, index = source.document_at(position, RecordKind.INDEX)
            for call, offset in _pairs(source, index.get("calls"), self._header_end, position):
                if call in slots:
                    raise source.fail(f"call {call} appears twice in the index")
                slots[call] = _Slot(offset)
            for call, offset in _pairs(source, index.get("done"), self._header_end, position):
                done[call] = offset
            limit, position = position, index.get("prev")
        for call, offset in done.items():
            if call not in slots:
                raise source.fail(f"the index completes call {call}, which it does not list")
            slots[call].completion = offset
        if footer.get("calls") != len(slots):
            raise source.fail(
                f"the footer's call count is {footer.get('calls')!r}, the index lists {plural(len(slots), 'call')}"
            )
        return slots, footer

    def _scan(self, problem: str) -> tuple[dict[int, _Slot], dict[str, Any] | None, Recovery]:
        source = self._source
        slots: dict[int, _Slot] = {}
        footer: dict[str, Any] | None = None
        position = self._header_end
        stopped: str | None = None
        cut: TruncatedFileError | None = None
        tail_seen = False
        damaged: list[str] = []
        while position < source.size and not tail_seen:
            try:
                envelope = source.envelope_at(position)
            except TruncatedFileError as error:
                stopped, cut = _CUT, error
                break
            except CaptureFileError as error:
                resumed = self._resync(position + 1, source.size)
                if resumed >= source.size:
                    stopped = str(error).removeprefix(f"{self.path}: ")
                    break
                damaged.append(
                    f"damaged bytes {position}-{resumed} skipped ({str(error).removeprefix(f'{self.path}: ')})"
                )
                position = resumed
                continue
            kind = envelope.kind
            if kind is RecordKind.CALL:
                if envelope.value in slots:
                    damaged.append(
                        f"call {envelope.value} recorded twice (offset {position}; the first kept)"
                    )
                else:
                    slots[envelope.value] = _Slot(position)
            elif kind is RecordKind.COMPLETION:
                slot = slots.get(envelope.value)
                if slot is not None and slot.completion is None:
                    slot.completion = position
            elif kind is RecordKind.FOOTER:
                try:
                    _, footer = source.document_at(position, RecordKind.FOOTER)
                except CaptureFileError as error:
                    damaged.append(f"footer unreadable ({str(error).removeprefix(f'{self.path}: ')})")
            elif kind is RecordKind.TAIL:
                tail_seen = True
            elif kind is RecordKind.HEADER:
                damaged.append(f"a second header at offset {position} skipped")
            position = envelope.end
        completed = sum(slot.completion is not None for slot in slots.values())
        recovered = f"recovered {_count(len(slots), 'call')} ({completed} with outputs)"
        if damaged:
            recovered = f"{'; '.join(damaged[:3])}{f' (+{len(damaged) - 3} more)' if len(damaged) > 3 else ''}; {recovered}"
        footer_missing = footer is None
        if stopped is not None:
            missing = None
            if cut is not None:  # say where the file was cut, not only where the last whole record ended
                missing, where = _cut_description(cut, position, source.size)
                message = f"truncated: {where}; {recovered}"
            else:
                message = f"stopped at byte {position} of {source.size}: {stopped}; {recovered}"
            if footer_missing:
                message += "; footer missing"
            return slots, footer, Recovery(False, footer_missing, position, len(slots), message, missing)
        if tail_seen and position < source.size:
            message = f"{source.size - position} bytes after the tail ignored; {recovered}"
            return slots, footer, Recovery(False, footer_missing, position, len(slots), message)
        if problem:
            message = f"index unreadable ({problem}); {recovered} by scanning"
        elif footer_missing:
            message = f"footer missing (the writer did not close the file); {recovered}"
        else:
            message = f"tail missing; {recovered}"
        return slots, footer, Recovery(False, footer_missing, None, len(slots), message)

    # ------------------------------------------------------------------------------------ documents

    def raw_documents(self, index: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Call ``index``'s call and completion documents exactly as recorded (checked, no codec runs).

        For tools that copy calls between files without decoding them (``moereplay trim``); tensors appear as
        their recorded descriptions and storages, whose bytes :meth:`storage_bytes` reads.
        """
        return self._documents(index)

    def storage_bytes(self, storage: _Storage) -> torch.Tensor:
        """A fresh host uint8 buffer holding a recorded storage's bytes (hash-verified when verification is on)."""
        return self._blob(storage)

    def _blob(self, storage: _Storage) -> torch.Tensor:
        """A fresh host uint8 buffer holding the storage's recorded bytes."""
        from moereplay.format.tensors import empty_buffer  # torch: paid only when bytes are loaded

        cached = self._cache.get(storage.offset)
        if cached is not None and cached.numel() == storage.length:
            self._cache.move_to_end(storage.offset)
            return cached.clone()
        envelope = self._source.blob_envelope(storage.offset, storage.length)
        buffer = empty_buffer(storage.length)
        self._source.read_blob(
            envelope, storage.digest, buffer.numpy().data.cast("B"), verify=self.verify_hashes
        )
        if storage.length > self._cache_limit:
            return buffer
        self._cache[storage.offset] = buffer
        self._cache_bytes += storage.length
        while self._cache_bytes > self._cache_limit:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.numel()
        return buffer.clone()

    def _documents(self, index: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        slot = self._slots.get(index)
        if slot is None:
            raise CaptureFileError(
                f"{self.path}: no call {index} (the file holds {plural(len(self._order), 'call')})"
            )
        try:
            _, call = self._source.document_at(slot.call, RecordKind.CALL, ext_hook)
            checked = _check_call(self._source, call, index, self._header_end)
            completion = None
            if slot.completion is not None:
                _, raw = self._source.document_at(slot.completion, RecordKind.COMPLETION, ext_hook)
                completion = _check_completion(self._source, raw, index, self._header_end)
        except CaptureFileError as error:  # name the call whose record it is
            text = str(error).removeprefix(f"{self.path}: ")
            if text.startswith(f"call {index}:"):
                raise
            raise type(error)(f"{self.path}: call {index}: {text}") from error
        return checked, completion

    # --------------------------------------------------------------------------------- materialising

    def _materialise(
        self, index: int, what: str, phase: _Phase, device: str | torch.device
    ) -> dict[str, Any]:
        """Check every tensor and the memory the call needs, then allocate, read and build the tree.

        Nothing from the file reaches torch before it is checked: dtype names against a fixed allow-list, every
        view inside its storage's recorded bytes, and the total — each distinct blob once, plus what codec values
        (recipes) say they will allocate — against :attr:`memory_budget`.
        """
        source = self._source
        where = f"call {index} {what}"
        needed: dict[int, _Storage] = {}  # storage id → its bytes
        for path, meta in iter_tensor_metas(phase.tree):
            if meta.dtype not in LOADABLE:
                raise source.fail(
                    f"{where}: tensor {path} has dtype {meta.dtype!r}, which moereplay does not load"
                )
            if meta.numel == 0:
                continue
            storage = phase.storages.get(meta.storage)
            if storage is None:
                raise source.fail(
                    f"{where}: tensor {path} refers to storage {meta.storage}, which has no bytes"
                )
            start, end = meta.byte_span()
            if (
                start < storage.base
                or end > storage.base + storage.length
                or (start - storage.base) % meta.itemsize
            ):
                raise source.fail(f"{where}: tensor {path} lies outside the bytes recorded for its storage")
            needed[meta.storage] = storage
        scratch: dict[str, int] = {}
        total = sum(storage.length for storage in needed.values()) + _codec_bytes(
            phase.tree, "", lambda message: source.fail(f"{where}: {message}"), scratch
        )
        total += sum(scratch.values())
        if total > self.memory_budget:
            raise MemoryBudgetError(
                f"{self.path}: {where} need {total:,} bytes, over the memory budget of {self.memory_budget:,} "
                f"(set {BUDGET_VARIABLE} to change it)"
            )

        import torch

        from moereplay.format.tensors import DTYPES, empty_buffer, view_of

        for path, meta in iter_tensor_metas(phase.tree):
            if meta.dtype not in DTYPES:
                raise source.fail(
                    f"{where}: tensor {path} has dtype {meta.dtype}, unknown to torch {torch.__version__}"
                )
        target = torch.device(device)
        # Each blob is read, decompressed and hashed once; each storage still gets its own buffer (storages that
        # were distinct when recorded must not alias now: a kernel writing one would change the other), and the
        # budget above counted every one of them.
        decoded: dict[tuple[int, int], torch.Tensor] = {}
        buffers: dict[int, torch.Tensor] = {}
        for storage_id, storage in needed.items():
            key = (storage.offset, storage.length)
            first = decoded.get(key)
            buffer = self._blob(storage) if first is None else first.clone()
            decoded.setdefault(key, buffer)
            buffers[storage_id] = buffer.to(target) if target.type != "cpu" else buffer

        def tensor(path: str, meta: TensorMeta) -> torch.Tensor:
            dtype = DTYPES[meta.dtype]
            if meta.numel == 0:
                return view_of(empty_buffer(0).to(target), 0, meta, dtype)
            return view_of(buffers[meta.storage], needed[meta.storage].base, meta, dtype)

        tree = _rebuild(
            phase.tree, "", tensor, lambda message: UnsupportedValueError(f"{self.path}: {where}: {message}")
        )
        if not isinstance(tree, dict):
            raise source.fail(f"{where} is not a map")
        return tree


# ------------------------------------------------------------------------------------------ helpers


def _rebuild(
    tree: Any,
    path: str,
    tensor: Callable[[str, TensorMeta], torch.Tensor],
    error: Callable[[str], Exception],
) -> Any:
    """Copy a decoded tree, replacing tensor metas by tensors and codec values by decoded objects."""
    if isinstance(tree, TensorMeta):
        return tensor(path, tree)
    if isinstance(tree, dict):
        return {
            key: _rebuild(value, f"{path}.{key}" if path else str(key), tensor, error)
            for key, value in tree.items()
        }
    if isinstance(tree, list):
        return [_rebuild(value, f"{path}[{position}]", tensor, error) for position, value in enumerate(tree)]
    if type(tree) is tuple:  # decoded tuples are plain; a torch.Size (a tuple subclass) is kept as it is
        return tuple(
            _rebuild(value, f"{path}[{position}]", tensor, error) for position, value in enumerate(tree)
        )
    if isinstance(tree, CodecValue):
        value = _rebuild(tree.value, f"{path}<{tree.type_name.rsplit('.', 1)[-1]}>", tensor, error)
        codec = codec_for(tree.type_name)
        if codec is None:
            return CodecValue(tree.type_name, value)
        try:
            return codec.decode(value)
        except Exception as failure:
            raise error(
                f"codec for {tree.type_name} failed to decode {path}: {type(failure).__name__}: {failure}"
            ) from failure
    return tree


def _codec_bytes(
    tree: Any, path: str, error: Callable[[str], Exception], scratch: dict[str, int] | None = None
) -> int:
    """What the codec values in a raw tree say decoding them will keep (codecs without an estimate: 0); their
    shared scratch needs go into ``scratch`` (key → the largest bytes asked under it)."""
    shared: dict[str, int] = {} if scratch is None else scratch
    if isinstance(tree, dict):
        return sum(
            _codec_bytes(value, f"{path}.{key}" if path else str(key), error, shared)
            for key, value in tree.items()
        )
    if isinstance(tree, (list, tuple)):
        return sum(
            _codec_bytes(value, f"{path}[{position}]", error, shared) for position, value in enumerate(tree)
        )
    if isinstance(tree, CodecValue):
        inner = _codec_bytes(tree.value, f"{path}<{tree.type_name.rsplit('.', 1)[-1]}>", error, shared)
        codec = codec_for(tree.type_name)
        if codec is None or codec.nbytes is None:
            return inner
        try:
            kept = inner + int(codec.nbytes(tree.value))
            if codec.scratch is not None:
                key, size = codec.scratch(tree.value)
                shared[key] = max(shared.get(key, 0), int(size))
            return kept
        except MoereplayError as failure:
            raise error(f"{path}: {failure}") from failure
        except Exception as failure:
            raise error(
                f"codec for {tree.type_name} cannot size {path}: {type(failure).__name__}: {failure}"
            ) from failure
    return 0


def _cut_description(cut: TruncatedFileError, start: int, size: int) -> tuple[int | None, str]:
    """(bytes missing, where the file ends) for a file cut inside the record at ``start``."""
    if cut.record_end is None:
        return None, (
            f"the file ends at byte {size}, {size - start} bytes into the {ENVELOPE_SIZE}-byte envelope of a record "
            f"that starts at byte {start} (its length is unknown)"
        )
    missing = cut.record_end - size
    kind = cut.kind or "record"
    article = "an" if kind[:1] in "aeiou" else "a"
    return missing, (
        f"the file ends at byte {size} inside {article} {kind} record that starts at byte {start} "
        f"and ends at byte {cut.record_end} ({missing} bytes missing)"
    )


def _declared_tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors codec values stand for, as they declare them (a recipe's ``dtype``, ``shape`` and
    ``stride``), without importing their codecs (torch): for figures such as ``info``'s, not for the budget."""
    if isinstance(tree, dict):
        return sum(_declared_tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_declared_tensor_bytes(value) for value in tree)
    if isinstance(tree, CodecValue):
        value = tree.value
        inner = _declared_tensor_bytes(value)
        if not isinstance(value, dict):
            return inner
        dtype, shape, stride = value.get("dtype"), value.get("shape"), value.get("stride")
        itemsize = ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
        if itemsize is None or not isinstance(shape, list) or not isinstance(stride, list):
            return inner
        if not all(type(v) is int and 0 <= v < 2**50 for v in (*shape, *stride)) or len(shape) != len(stride):
            return inner
        if any(size == 0 for size in shape):
            return inner
        span = 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
        return inner + span * itemsize
    return 0


def envelope_kinds(envelopes: list[Envelope]) -> str:
    """``"call and completion records"`` — the kinds among ``envelopes``, for messages."""
    kinds = sorted({envelope.kind.name.lower() for envelope in envelopes})
    return f"{' and '.join(kinds)} record{'s' if len(envelopes) > 1 else ''}"


def _offset(source: FrameSource, value: Any, header_end: int) -> int:
    if type(value) is not int or not header_end <= value < source.size:
        raise source.fail(f"record offset {value!r} lies outside the file")
    return value


def _pairs(source: FrameSource, value: Any, header_end: int, limit: int) -> Iterator[tuple[int, int]]:
    if not isinstance(value, list):
        raise source.fail("an index record is malformed")
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(item) is int for item in pair)):
            raise source.fail("an index entry is malformed")
        call, offset = pair
        if call < 0 or not header_end <= offset < limit:
            raise source.fail(f"index entry for call {call} points outside the indexed range")
        yield call, offset


def _require(source: FrameSource, condition: bool, index: int, problem: str) -> None:
    if not condition:
        raise source.fail(f"call {index}: {problem}")


def _storages(source: FrameSource, value: Any, index: int, header_end: int) -> dict[int, _Storage]:
    _require(source, isinstance(value, dict), index, "storage table is not a map")
    storages: dict[int, _Storage] = {}
    for storage_id, entry in value.items():
        _require(
            source, type(storage_id) is int and isinstance(entry, dict), index, "storage table is malformed"
        )
        digest, offset, base, length = entry.get("h"), entry.get("at"), entry.get("base"), entry.get("n")
        _require(
            source,
            isinstance(digest, bytes)
            and len(digest) == _DIGEST_BYTES
            and type(offset) is int
            and header_end <= offset < source.size
            and type(base) is int
            and base >= 0
            and type(length) is int
            and length > 0,
            index,
            f"storage {storage_id} entry is malformed",
        )
        if length > source.limits.max_blob_bytes:
            raise source.fail(
                f"call {index}: storage {storage_id} claims {length} bytes, over the cap of {source.limits.max_blob_bytes}"
            )
        storages[storage_id] = _Storage(digest, offset, base, length)
    return storages


_CALL_KEYS = ("i", "op", "site", "parent", "t", "ctx", "args", "storages")
_COMPLETION_KEYS = ("i", "status", "error", "t", "timings", "outputs", "storages")


def _require_keys(
    source: FrameSource, document: dict[Any, Any], keys: tuple[str, ...], index: int, what: str
) -> None:
    missing = [key for key in keys if key not in document]
    if missing:
        raise source.fail(f"call {index}: the {what} record has no {', '.join(repr(key) for key in missing)}")


def _check_call(source: FrameSource, call: dict[str, Any], index: int, header_end: int) -> dict[str, Any]:
    _require_keys(source, call, _CALL_KEYS, index, "call")
    _require(source, call["i"] == index, index, f"the call record says it is call {call['i']!r}")
    _require(
        source,
        isinstance(call["op"], str) and isinstance(call["site"], str),
        index,
        "op or site is not text",
    )
    parent = call["parent"]
    _require(source, parent is None or type(parent) is int, index, "parent is not a call index")
    _require(
        source,
        isinstance(call["ctx"], dict) and isinstance(call["args"], dict),
        index,
        "context or arguments are not maps",
    )
    static = call.get("static", [])
    _require(
        source,
        isinstance(static, list) and all(isinstance(name, str) for name in static),
        index,
        "static names are malformed",
    )
    started = call["t"]
    _require(source, started is None or isinstance(started, float), index, "start time is not a float")
    return {**call, "static": static, "storages": _storages(source, call["storages"], index, header_end)}


def _check_completion(
    source: FrameSource, completion: dict[str, Any], index: int, header_end: int
) -> dict[str, Any]:
    _require_keys(source, completion, _COMPLETION_KEYS, index, "completion")
    _require(source, completion["i"] == index, index, "the completion record names another call")
    _require(
        source,
        completion["status"] in COMPLETION_STATUSES,
        index,
        f"unknown status {completion['status']!r}",
    )
    error = completion["error"]
    _require(source, error is None or isinstance(error, str), index, "error is not text")
    timings = completion["timings"]
    _require(
        source,
        isinstance(timings, dict)
        and all(isinstance(key, str) and isinstance(value, float) for key, value in timings.items()),
        index,
        "timings are malformed",
    )
    _require(source, isinstance(completion["outputs"], dict), index, "outputs are not a map")
    finished = completion["t"]
    _require(source, finished is None or isinstance(finished, float), index, "finish time is not a float")
    return {**completion, "storages": _storages(source, completion["storages"], index, header_end)}


def _layer_matches(context: dict[Any, Any], wanted: str) -> bool:
    if str(context.get("layer")) == wanted:
        return True
    name = context.get("layer_name")
    return isinstance(name, str) and fnmatch.fnmatchcase(name, wanted)


def _count(number: int, noun: str) -> str:
    """``1 call``, ``2 calls``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
