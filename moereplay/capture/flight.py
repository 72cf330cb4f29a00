"""The flight recorder: keep the last K calls on the device, write them only when an output goes bad.

Per call (serving thread): the inputs and outputs are copied device-to-device into a ring entry (no host
transfer, one multi-tensor copy each), and each floating-point output is reduced on the device to its largest
magnitude (``torch.linalg.vector_norm(ord=inf)``, which propagates NaN) straight into a slot of a preallocated
device ring of float32 magnitudes — one small kernel, no allocation, no event, no host copy. Every
:data:`FLUSH_EVERY` calls (and whenever the writer thread polls, every few ms while serving is idle) the slots
written since the last flush go to pinned host memory in one asynchronous copy followed by one CUDA event, on the
stream the calls ran on; that event also stands for every snapshot taken before it (their copies were queued
earlier on the same stream), so the writer waits on it before reading a written entry. Nothing waits on the
serving thread: a batch is checked once its event has completed, from :meth:`FlightRecorder.poll` (called by the
writer thread between messages and by the serving thread on each new call) — ``event.query()`` and one read of
pinned memory per batch.

When a value is non-finite or above ``absmax``, the ring's entries up to and including the offending call are
handed to the writer (their device copies are moved to the host there); enclosing calls still running (the
parent of the offending kernel call) are written with their completion when it comes. The recorder stays
armed: the next bad output (often the same incident's next call) triggers again with what the ring holds then.
On CPU the check is immediate (there is nothing to overlap with).

The ring is bounded by entry count (``MOEREPLAY_FLIGHT_CALLS``) and device bytes (``MOEREPLAY_FLIGHT_BYTES``);
oldest entries are evicted first. A trigger detected after its call was evicted (a very large call, or a check
lagging more than K calls) is counted as ``flight_lost`` and logged.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from moereplay.capture.snapshot import Snapshot, TensorCopy, current_stream
from moereplay.capture.writer_thread import Begin, Complete
from moereplay.format.schema import CodecValue

logger = logging.getLogger("moereplay.capture")


FLUSH_EVERY = 4
"""Calls whose magnitudes are moved to the host together (one copy + one event per batch)."""

SLOTS = 4096
"""Device magnitude slots per device (a ring). A slot is reused only after its batch was checked."""

_NORM_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass(eq=False)
class FlightEntry:
    begin: Begin | None  # None: the call's inputs left the ring before it completed
    complete: Complete | None = None
    slots: list[int] | None = None  # magnitude slots of its floating-point outputs (CUDA)
    checked: bool = False
    value: float | None = None
    emitted: bool = False  # handed to the writer by a trigger (its own check no longer matters)

    @property
    def nbytes(self) -> int:
        held = self.begin.nbytes if self.begin is not None else 0
        return held + (self.complete.nbytes if self.complete is not None else 0)


@dataclass(eq=False)
class _Batch:
    """Entries whose magnitudes are ready together: ``values`` (CPU) or, once ``event`` completed,
    ``host[first:first + count]`` of the pinned mirror (CUDA; ``count`` slots from ``first``, ring order)."""

    entries: list[FlightEntry]
    event: Any = None
    slots: _Slots | None = None
    first: int = 0
    count: int = 0
    values: list[float] | None = None
    position: int = 0  # entries before this one were checked (a trigger stops a batch midway)


class _Slots:
    """One device's magnitude ring: ``SLOTS`` float32 on the device, its pinned host mirror, 0-d views of the
    device slots (made on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values = torch.full((SLOTS,), float("nan"), dtype=torch.float32, device=device)
        self.host = torch.empty(SLOTS, dtype=torch.float32, pin_memory=True)
        self.views: list[torch.Tensor | None] = [None] * SLOTS
        self.next = 0  # next slot to write
        self.flushed = 0  # slots before this one (ring order, counted from 0) are in a batch
        self.outstanding = 0  # slots written and not yet checked

    def view(self, index: int) -> torch.Tensor:
        view = self.views[index]
        if view is None:
            view = self.views[index] = self.values[index]
        return view


@dataclass
class FlightCounters:
    checked: int = 0
    triggers: int = 0
    written: int = 0
    lost: int = 0
    evicted: int = 0


def _magnitude_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor to reduce for ``tensor``'s largest magnitude, or ``None`` when it is not checked (not floating
    point, empty, complex). float8 and other narrow floats are reduced through a float32 copy."""
    dtype = tensor.dtype
    if dtype in _NORM_DTYPES:
        return tensor if tensor.numel() else None
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    return tensor.float()


def output_magnitude(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Largest |value| over the floating-point tensors, as a 0-d float32 on their device (NaN if any NaN);
    ``None`` when there is nothing to check. Launches one reduction per tensor (plus a max when several)."""
    result: torch.Tensor | None = None
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for tensor in tensors:
        source = _magnitude_source(tensor)
        if source is None:
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        value = torch.linalg.vector_norm(source, ord=math.inf, dtype=torch.float32)
        result = value if result is None else torch.maximum(result, value)
    return result


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _snapshot_device(snapshot: Snapshot) -> torch.device | None:
    """The device of a snapshot's copies (its first top-level copy; nested ones are looked for only when
    there is none at the top)."""
    for value in snapshot.tree.values():
        if isinstance(value, TensorCopy):
            return value.data.device
    stack: list[Any] = list(snapshot.tree.values())
    while stack:
        value = stack.pop()
        if isinstance(value, TensorCopy):
            return value.data.device
        if isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, CodecValue):
            stack.append(value.value)
    return None


def _largest(values: list[float]) -> float:
    """max() that propagates NaN."""
    largest = values[0]
    for value in values[1:]:
        if math.isnan(value) or value > largest:
            largest = value
    return largest


@dataclass
class FlightRecorder:
    """See the module docstring. ``emit`` hands an entry's Begin and Complete to the writer."""

    max_calls: int
    max_bytes: int
    absmax: float | None
    emit: Callable[[FlightEntry], bool]
    emit_complete: Callable[[Complete], None]
    counters: FlightCounters = field(default_factory=FlightCounters)
    flush_every: int = 0  # 0: FLUSH_EVERY, fewer for small rings (a check must land before its call leaves)
    _ring: deque[FlightEntry] = field(default_factory=deque)
    _by_sequence: dict[int, FlightEntry] = field(default_factory=dict)
    _forward: set[int] = field(default_factory=set)  # written before they completed (open parents)
    _bytes: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _slots: dict[torch.device, _Slots] = field(default_factory=dict)
    _open: list[FlightEntry] = field(default_factory=list)  # entries with magnitudes launched, not flushed
    _open_device: _Slots | None = None
    _open_stream: Any = None
    _unflushed: list[Snapshot] = field(default_factory=list)  # CUDA snapshots waiting for a batch event
    _batches: deque[_Batch] = field(default_factory=deque)  # flushed, not yet checked, in stream order

    def __post_init__(self) -> None:
        if self.flush_every <= 0:
            self.flush_every = max(1, min(FLUSH_EVERY, self.max_calls // 4))

    def add_begin(self, begin: Begin) -> None:
        entry = FlightEntry(begin)
        with self._lock:
            self._ring.append(entry)
            self._by_sequence[begin.sequence] = entry
            self._bytes += entry.nbytes
            self._register(begin.snapshot)
            self._evict()

    def add_complete(self, complete: Complete, outputs: list[torch.Tensor]) -> None:
        """Attach a call's outputs and launch its check (immediate on CPU). A call already written (a parent
        whose child triggered) has its completion written straight away."""
        with self._lock:
            forward = complete.sequence in self._forward
            self._forward.discard(complete.sequence)
            if complete.outputs is not None:
                self._register(complete.outputs)
            if forward:
                self._flush()  # gives the completion's copies their event before the writer sees them
        if forward:
            self.emit_complete(complete)
            return
        check_now = False
        with self._lock:
            entry = self._by_sequence.get(complete.sequence)
            if entry is None:  # evicted already (larger than the ring): still check the call
                entry = FlightEntry(None)
            entry.complete = complete
            if entry.begin is not None:
                self._bytes += complete.nbytes
            check_now = self._launch_check(entry, outputs)
            self._evict()
            if len(self._open) >= self.flush_every or len(self._unflushed) >= 4 * self.flush_every:
                self._flush()
        if check_now:
            self.poll()

    def _register(self, snapshot: Snapshot) -> None:
        """A CUDA snapshot taken without an event waits for the next batch event (lock held)."""
        if snapshot.event is not None or not snapshot.copied:
            return
        device = _snapshot_device(snapshot)
        if device is None or device.type != "cuda":
            return
        self._join(current_stream(_index(device)), None)
        self._unflushed.append(snapshot)

    def _join(self, stream: Any, slots: _Slots | None) -> None:
        """Make the pending batch the one of ``stream`` (and of ``slots``' device), flushing the pending one if
        it belongs elsewhere: one batch event covers one stream's work (lock held)."""
        pending = self._open or self._unflushed
        if pending and (
            stream is not self._open_stream
            or (slots is not None and self._open_device is not None and self._open_device is not slots)
        ):
            self._flush()
        self._open_stream = stream
        if slots is not None:
            self._open_device = slots

    def _launch_check(self, entry: FlightEntry, outputs: list[torch.Tensor]) -> bool:
        """Queue ``entry``'s magnitude reduction (lock held). Returns whether it is ready now (CPU)."""
        sources: list[torch.Tensor] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for tensor in outputs:
            source = _magnitude_source(tensor)
            if source is None:
                continue
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
            sources.append(source)
        if not sources:
            return False
        device = sources[0].device
        if device.type != "cuda":
            values = [
                float(torch.linalg.vector_norm(source, ord=math.inf, dtype=torch.float32))
                for source in sources
            ]
            self._batches.append(_Batch([entry], values=[_largest(values)]))
            return True
        slots = self._slots.get(device)
        if slots is None:
            slots = self._slots[device] = _Slots(device)
        self._join(current_stream(_index(device)), slots)
        if slots.outstanding + len(sources) > SLOTS:
            self._drain()
            self._join(current_stream(_index(device)), slots)
        indices = []
        for source in sources:
            if source.device != device:
                continue  # another device than the call's first output: left unchecked
            index = slots.next
            slots.next = (index + 1) % SLOTS
            slots.outstanding += 1
            torch.linalg.vector_norm(source, ord=math.inf, dtype=torch.float32, out=slots.view(index))
            indices.append(index)
        entry.slots = indices
        self._open.append(entry)
        return False

    def _flush(self) -> None:
        """Move the open entries' magnitudes to the host and record one event after them and after every
        snapshot registered so far (lock held). Runs on the stream they ran on, from either thread."""
        if not self._open and not self._unflushed:
            return
        slots = self._open_device
        stream = self._open_stream
        first = count = 0
        with torch.cuda.stream(stream):
            if slots is not None and self._open:
                first = slots.flushed
                count = (slots.next - first) % SLOTS
                if count == 0:
                    count = SLOTS  # a whole lap of slots written since the last flush
                end = first + count
                if end <= SLOTS:
                    slots.host[first:end].copy_(slots.values[first:end], non_blocking=True)
                else:
                    slots.host[first:].copy_(slots.values[first:], non_blocking=True)
                    slots.host[: end - SLOTS].copy_(slots.values[: end - SLOTS], non_blocking=True)
                slots.flushed = slots.next
            event = torch.cuda.Event()
            torch._C._CudaEventBase.record(event, stream)
        for snapshot in self._unflushed:
            snapshot.event = event
        self._unflushed = []
        if self._open:
            self._batches.append(_Batch(self._open, event=event, slots=slots, first=first, count=count))
            self._open = []
        self._open_device = None
        self._open_stream = None

    def _drain(self) -> None:
        """More than ``SLOTS`` magnitudes outstanding (the device is thousands of calls behind): flush, wait for
        the batches and read their magnitudes so their slots can be reused. Never happens in steady serving."""
        self._flush()
        for batch in self._batches:
            if batch.event is not None and batch.values is None:
                batch.event.synchronize()
        self._materialize()

    def _evict(self) -> None:
        while self._ring and (len(self._ring) > self.max_calls or self._bytes > self.max_bytes):
            old = self._ring.popleft()
            if old.begin is not None:
                self._by_sequence.pop(old.begin.sequence, None)
            self._bytes -= old.nbytes
            self.counters.evicted += 1

    def _is_bad(self, value: float) -> bool:
        return not math.isfinite(value) or (self.absmax is not None and value > self.absmax)

    def _materialize(self) -> None:
        """Read the magnitudes of every batch whose event has completed from the pinned mirror (lock held),
        oldest first; their slots may be written again from then on."""
        for batch in self._batches:
            if batch.values is not None:
                continue
            if not batch.event.query():
                return  # later batches were recorded after this one on the same stream, or wait their turn
            slots = batch.slots
            assert slots is not None
            end = batch.first + batch.count
            if end <= SLOTS:
                raw = slots.host[batch.first : end].tolist()
            else:
                raw = slots.host[batch.first :].tolist() + slots.host[: end - SLOTS].tolist()
            slots.outstanding -= batch.count
            by_slot = {(batch.first + i) % SLOTS: value for i, value in enumerate(raw)}
            batch.values = [
                _largest([by_slot[i] for i in entry.slots]) if entry.slots else math.nan
                for entry in batch.entries
            ]

    def _check_ready(self) -> FlightEntry | None:
        """Check the batches whose magnitudes are on the host, oldest first (lock held); stop at the first bad
        value of an entry still in the ring and return it (the rest is checked on a later poll)."""
        self._materialize()
        batches = self._batches
        while batches:
            batch = batches[0]
            values = batch.values
            if values is None:
                return None
            while batch.position < len(batch.entries):
                entry = batch.entries[batch.position]
                value = values[batch.position]
                batch.position += 1
                if entry.emitted or (batch.event is not None and not entry.slots):
                    continue  # written already by an earlier trigger, or nothing of it checked
                entry.checked = True
                entry.value = value
                self.counters.checked += 1
                if not self._is_bad(value):
                    continue
                in_ring = entry.begin is not None and self._by_sequence.get(entry.begin.sequence) is entry
                if in_ring:
                    return entry
                self.counters.triggers += 1
                self.counters.lost += 1
                logger.error(
                    "moereplay: flight recorder: call %s had a bad output but left the ring before the "
                    "check (raise MOEREPLAY_FLIGHT_CALLS / MOEREPLAY_FLIGHT_BYTES)",
                    entry.complete.sequence if entry.complete else "?",
                )
            batches.popleft()
        return None

    def poll(self, *, flush: bool = False) -> None:
        """Check every batch whose magnitudes have arrived; write the ring on a trigger. Never blocks.
        ``flush``: first move the open magnitudes to the host (the writer thread, while serving is idle)."""
        if not self._batches and not (flush and (self._open or self._unflushed)):
            return
        with self._lock:
            if flush:
                self._flush()
            trigger = self._check_ready()
            if trigger is None:
                return
            self.counters.triggers += 1
            batch: list[FlightEntry] = []
            while self._ring:
                entry = self._ring.popleft()
                if entry.begin is not None:
                    self._by_sequence.pop(entry.begin.sequence, None)
                self._bytes -= entry.nbytes
                entry.emitted = True
                batch.append(entry)
                if entry is trigger:
                    break
            # calls after the trigger stay in the ring: they are the next incident's history
        assert trigger.begin is not None
        logger.error(
            "moereplay: flight recorder triggered by %s call %d (largest |output| = %s): writing %d call(s)",
            trigger.begin.op,
            trigger.begin.context.get("call", -1),
            trigger.value,
            len(batch),
        )
        for entry in batch:
            if entry.begin is None:
                continue
            entry.begin.context["flight"] = {"trigger": entry is trigger, "magnitude": entry.value}
            if self.emit(entry):
                self.counters.written += 1
                if entry.complete is None:
                    with self._lock:
                        self._forward.add(entry.begin.sequence)

    def as_counters(self) -> dict[str, int]:
        return {f"flight_{key}": value for key, value in self.counters.__dict__.items()}
