"""The flight recorder: keep the last K calls on the device, write them only when an output goes bad.

Per call (serving thread): the inputs and outputs are copied device-to-device into a ring entry (no host
transfer, one multi-tensor copy each) and the entry is queued for its check. Nothing else touches the device on
the serving thread: no reduction, no event, no host copy (Python bookkeeping only). The check runs on the
writer thread (:meth:`FlightRecorder.poll` with ``launch=True``, from ``WriterThread._run_poll`` inside the
graph gate's ``device_work()``, every ``poll_interval`` ≈ 5 ms while its queue is idle): it records one CUDA
event on the serving stream after every snapshot registered so far (that event also stands for those snapshots
when the writer later reads them), makes a side stream of its own wait for it (``wait_event``: no host
block), reduces the *ring copies* of the queued outputs there to their largest magnitudes (one
``torch._foreach_norm(ord=inf, dtype=float32)`` per output dtype over all queued entries — ``max_propagate_nan``
in the CUDA kernel, so NaN propagates; inf-norm is exact in any float dtype — then one stack and one copy to
pinned host memory) and records one event on the side stream. A later poll, from either thread (the serving
thread's poll on each new call only queries events and reads pinned memory: it launches nothing), reads the
magnitudes once that event has completed and checks them in call order.

Detection lag: a call is checked at most about two writer polls after it completed (≈ 2 × 5 ms; while the writer
is busy writing a trigger it still polls between two messages, so add at most one message's write) plus the
device time for the serving stream to reach the call and the side stream to reduce it. The writer thread polls
whether or not the serving thread makes further calls: a bad output followed by idling is found and written
within that delay. While unchecked, an entry stays in the ring even past ``MOEREPLAY_FLIGHT_CALLS``
(by at most :data:`LAG_CALLS` entries), so a lagging check still finds its call and the calls before it; the
byte bound (``MOEREPLAY_FLIGHT_BYTES``) is never exceeded by the ring. An entry evicted by the byte bound keeps
its output copies (not its inputs) until its check ran; a bad value found then counts as ``flight_lost``.
Evicted entries still waiting for their check launch are dropped past another ``max_bytes`` of held outputs
and counted as ``flight_unchecked`` (the writer thread stalled).

When a value is non-finite or above ``absmax``, the ring's entries up to and including the offending call (at
most ``MOEREPLAY_FLIGHT_CALLS`` of them) are handed to the writer (their device copies are moved to the host
there); enclosing calls still running (the parent of the offending kernel call) are written with their
completion when it comes. The recorder stays armed: the next bad output (often the same incident's next call)
triggers again with what the ring holds then. On CPU the check is immediate (there is nothing to overlap with).

Counters (``flight_*`` in the footer): ``written`` counts calls whose records the writer thread reports written
(the sink's write returned), ``write_failed`` those a trigger handed to the writer that never reached the file (a
failed write — also counted as the writer's ``write_errors`` —, a full queue, a writer stopped by an earlier
error); each trigger logs one line when its last call is settled (:class:`TriggerDelivery`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch

from moereplay.capture.snapshot import Snapshot, TensorCopy, current_stream
from moereplay.capture.writer_thread import Begin, Complete, Delivered
from moereplay.format.schema import CodecValue

logger = logging.getLogger("moereplay.capture")


LAG_CALLS = 1024
"""Entries past ``max_calls`` an unchecked suffix of the ring may hold (the byte bound still applies)."""

_NORM_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_FOREACH_FLOAT32 = frozenset({torch.float16, torch.bfloat16, torch.float32})


@dataclass(eq=False)
class FlightEntry:
    begin: Begin | None  # None: left the ring (evicted or written), or its inputs left before it completed
    complete: Complete | None = None
    pending: bool = False  # CUDA: queued for its check, or its check launched and not read yet
    queued: bool = False  # CUDA: its check is not launched yet
    evicted: bool = False
    checked: bool = False
    value: float | None = None
    emitted: bool = False  # handed to the writer by a trigger (its own check no longer matters)

    @property
    def nbytes(self) -> int:
        held = self.begin.nbytes if self.begin is not None else 0
        return held + (self.complete.nbytes if self.complete is not None else 0)


@dataclass(eq=False)
class _Batch:
    """Entries whose magnitudes are ready together: ``values`` (CPU, or once read), or, once ``event`` (side
    stream) completed, ``host`` (pinned float32: ``counts[i]`` magnitudes per entry, in order). ``keep`` holds
    the reduced device tensors until then (their memory is not reused while the side stream reads it)."""

    entries: list[FlightEntry]
    values: list[float] | None = None
    event: Any = None
    host: torch.Tensor | None = None
    counts: list[int] | None = None
    keep: list[torch.Tensor] | None = None
    position: int = 0  # entries before this one were checked (a trigger stops a batch midway)


@dataclass
class FlightCounters:
    """See the module docstring (Counters); ``lost``, ``evicted``, ``unchecked``: see the ring's bounds above."""

    checked: int = 0
    triggers: int = 0
    written: int = 0
    write_failed: int = 0
    lost: int = 0
    evicted: int = 0
    unchecked: int = 0


class TriggerBudget:
    """How many triggers of one process are written (``MOEREPLAY_FLIGHT_TRIGGERS``; 0: no limit), shared by the
    eager and the graph-replay recorders. A model that stays non-finite after its first bad call would otherwise
    trigger on every later call: every trigger past the budget is counted (``suppressed``) and not written, and
    one line says so when the first is suppressed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0
        self.suppressed = 0
        self._lock = threading.Lock()

    def take(self, what: str) -> bool:
        with self._lock:
            if not self.limit or self.taken < self.limit:
                self.taken += 1
                return True
            self.suppressed += 1
            first = self.suppressed == 1
        if first:
            logger.error(
                "moereplay: flight recorder: %s is past MOEREPLAY_FLIGHT_TRIGGERS=%d: it and every later trigger "
                "are counted (flight_triggers_suppressed), not written",
                what,
                self.limit,
            )
        return False


_COUNTING = threading.Lock()
"""Delivery reports arrive from the writer thread and, for a refused offer, from the offering thread."""


class TriggerDelivery:
    """One trigger's calls on their way to the file. :meth:`delivered` (the writer's report for one call) counts it
    in ``counters.written`` or ``counters.write_failed``; :meth:`not_handed_over` notes a call never handed over
    (``MOEREPLAY_MAX_CALLS``, overwritten in the ring: counted where that happened). When the last of ``calls``
    is settled, one line says how many were written — an error when any was not."""

    def __init__(self, counters: FlightCounters, trigger: str, calls: int) -> None:
        self.counters = counters
        self.trigger = trigger
        self.calls = calls
        self.written = 0
        self.failed = 0
        self.not_sent = 0
        self.why_not: str | None = None

    def delivered(self, written: bool, why_not: str | None) -> None:
        with _COUNTING:
            if written:
                self.counters.written += 1
                self.written += 1
            else:
                self.counters.write_failed += 1
                self.failed += 1
                self.why_not = self.why_not or why_not
            done = self.written + self.failed + self.not_sent == self.calls
        if done:
            self._log()

    def not_handed_over(self, why: str) -> None:
        with _COUNTING:
            self.not_sent += 1
            self.why_not = self.why_not or why
            done = self.written + self.failed + self.not_sent == self.calls
        if done:
            self._log()

    def _log(self) -> None:
        if self.written == self.calls:
            logger.warning(
                "moereplay: flight recorder: the %d call(s) of the trigger by %s are written",
                self.calls,
                self.trigger,
            )
            return
        logger.error(
            "moereplay: flight recorder: of the %d call(s) of the trigger by %s, %d written, %d NOT written: %s",
            self.calls,
            self.trigger,
            self.written,
            self.calls - self.written,
            self.why_not,
        )


def _magnitude_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor to reduce for ``tensor``'s largest magnitude, or ``None`` when it is not checked (not floating
    point, empty, complex). float8 and other narrow floats are reduced through a float32 copy."""
    dtype = tensor.dtype
    if dtype in _NORM_DTYPES:
        return tensor if tensor.numel() else None
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    return tensor.float()


def _checkable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not tensor.is_complex() and tensor.numel() > 0


def _output_copies(complete: Complete) -> list[TensorCopy]:
    """The checked outputs of a call: its top-level floating-point output copies on CUDA, each view once."""
    found: list[TensorCopy] = []
    seen: set[tuple[Any, ...]] = set()
    if complete.outputs is None:
        return found
    for value in complete.outputs.tree.values():
        if not isinstance(value, TensorCopy) or value.data.device.type != "cuda":
            continue
        if not value.dtype.is_floating_point or value.dtype.is_complex or 0 in value.shape:
            continue
        key = (value.storage, value.storage_offset, value.shape, value.stride, value.dtype)
        if key in seen:
            continue
        seen.add(key)
        found.append(value)
    return found


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


def _any_pending(ring: deque[FlightEntry], count: int) -> bool:
    """Whether one of the first ``count`` entries awaits its check (a plain loop: this runs per call, ~0.5 µs)."""
    for entry in islice(ring, count):  # noqa: SIM110 (any() over a generator costs ~1.7x here)
        if entry.pending:
            return True
    return False


def _largest(values: list[float]) -> float:
    """max() that propagates NaN."""
    largest = values[0]
    for value in values[1:]:
        if math.isnan(value) or value > largest:
            largest = value
    return largest


class PollingRecorder:
    """What both flight recorders (this kernel-scope one and :class:`~moereplay.capture.flight_layer.LayerFlight`)
    share: closing by polling, and their counters under ``flight_`` names. Subclasses provide ``poll``,
    ``settled`` and ``counters``.

    Who polls: the writer thread, every ``poll_interval`` (``WriterThread.set_poll``), whether the serving thread
    is busy or idle (the layer-scope recorder's serving thread checks its eager calls' finished words too, see
    ``LayerFlight._check_inline``); at close (or on SIGTERM, through ``WriterThread.drain``) :meth:`settle` polls to
    the end."""

    counters: Any
    absmax: float | None

    def _is_bad(self, value: float) -> bool:
        """Whether a checked magnitude triggers: NaN, an infinity, or above ``MOEREPLAY_ABSMAX``."""
        return not math.isfinite(value) or (self.absmax is not None and value > self.absmax)

    def poll(self, *, launch: bool = False) -> float | None:
        """Returns the seconds the writer may wait for the next poll (None: its ``poll_interval``)."""
        raise NotImplementedError

    @property
    def settled(self) -> bool:
        raise NotImplementedError

    def settle(self, timeout: float, device_work: Callable[[], Any] | None = None) -> bool:
        """At close: launch and read the remaining checks, so a bad output in the last few calls still triggers.
        Polls (never blocks on the device) until :attr:`settled` or ``timeout`` seconds; ``device_work`` is the
        graph gate's context manager factory for the launches. Returns whether everything was checked (a trigger
        found here has handed its calls to the writer: flush it to have them written)."""
        deadline = time.monotonic() + timeout
        while True:
            if device_work is None:
                self.poll(launch=True)
            else:
                with device_work():
                    self.poll(launch=True)
            if self.settled:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def as_counters(self) -> dict[str, int]:
        counters = {f"flight_{key}": value for key, value in self.counters.__dict__.items()}
        budget = getattr(self, "budget", None)
        if isinstance(budget, TriggerBudget):
            counters["flight_triggers_suppressed"] = budget.suppressed
        return counters


@dataclass
class FlightRecorder(PollingRecorder):
    """See the module docstring. ``emit(entry, delivered)`` hands an entry's Begin and Complete to the writer:
    False when it did not (``MOEREPLAY_MAX_CALLS``), else ``delivered`` is told once whether they were written."""

    max_calls: int
    max_bytes: int
    absmax: float | None
    emit: Callable[[FlightEntry, Delivered], bool]
    emit_complete: Callable[[Complete], None]
    budget: TriggerBudget = field(default_factory=lambda: TriggerBudget(0))
    counters: FlightCounters = field(default_factory=FlightCounters)
    _ring: deque[FlightEntry] = field(default_factory=deque)
    _by_sequence: dict[int, FlightEntry] = field(default_factory=dict)
    _forward: set[int] = field(default_factory=set)  # written before they completed (open parents)
    _bytes: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _waiting: deque[FlightEntry] = field(default_factory=deque)  # CUDA entries whose check is not launched
    _held: int = 0  # output bytes of evicted entries in ``_waiting``
    _stream: Any = None  # the stream of the snapshots in ``_unflushed``
    _unflushed: list[Snapshot] = field(default_factory=list)  # CUDA snapshots waiting for an event
    _batches: deque[_Batch] = field(default_factory=deque)  # not yet checked, in launch order
    _sides: dict[torch.device, Any] = field(default_factory=dict)  # the writer thread's side streams
    _launching: threading.Lock = field(default_factory=threading.Lock)  # one launcher at a time, in order

    def add_begin(self, begin: Begin) -> None:
        entry = FlightEntry(begin)
        with self._lock:
            self._ring.append(entry)
            self._by_sequence[begin.sequence] = entry
            self._bytes += entry.nbytes
            self._register(begin.snapshot)
            self._evict()

    def add_complete(self, complete: Complete, outputs: list[torch.Tensor]) -> None:
        """Attach a call's outputs and queue its check (immediate on CPU). A call already written (a parent
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
                entry = FlightEntry(None, evicted=True)
            entry.complete = complete
            if entry.begin is not None:
                self._bytes += complete.nbytes
            check_now = self._queue_check(entry, outputs)
            self._evict()
        if check_now:
            self.poll()

    def _register(self, snapshot: Snapshot) -> None:
        """A CUDA snapshot taken without an event waits for the next event on its stream (lock held). A
        snapshot of another stream first gives the pending ones their event (rare: one serving stream)."""
        if snapshot.event is not None or not snapshot.copied:
            return
        device = _snapshot_device(snapshot)
        if device is None or device.type != "cuda":
            return
        stream = current_stream(_index(device))
        if self._unflushed and stream is not self._stream:
            self._flush()
        self._stream = stream
        self._unflushed.append(snapshot)

    def _queue_check(self, entry: FlightEntry, outputs: list[torch.Tensor]) -> bool:
        """Check ``entry`` now (CPU: returns True) or queue it for the writer thread (CUDA; lock held)."""
        first = None
        for tensor in outputs:
            if _checkable(tensor):
                first = tensor
                break
        if first is None:
            return False
        if first.device.type == "cuda":
            entry.pending = entry.queued = True
            self._waiting.append(entry)
            if entry.evicted and entry.complete is not None:
                self._held += entry.complete.nbytes
            return False
        values: list[float] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for tensor in outputs:
            source = _magnitude_source(tensor)
            if source is None or source.device.type == "cuda":
                continue
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
            values.append(float(torch.linalg.vector_norm(source, ord=math.inf, dtype=torch.float32)))
        self._batches.append(_Batch([entry], values=[_largest(values)], counts=[len(values)]))
        return True

    def _flush(self) -> None:
        """Record one event on the serving stream after every snapshot registered so far (lock held)."""
        if not self._unflushed:
            return
        event = torch.cuda.Event()
        torch._C._CudaEventBase.record(event, self._stream)
        for snapshot in self._unflushed:
            snapshot.event = event
        self._unflushed = []
        self._stream = None

    def _evict(self) -> None:
        """Oldest first, while the ring is over its bounds; an entry whose check is outstanding keeps itself and the
        ``max_calls - 1`` entries before it (its history, should its output be bad) past ``max_calls`` (up to
        :data:`LAG_CALLS` more), never past ``max_bytes`` (lock held)."""
        ring = self._ring
        while ring:
            over_bytes = self._bytes > self.max_bytes
            if not over_bytes and len(ring) <= self.max_calls:
                break
            if (
                not over_bytes
                and len(ring) <= self.max_calls + LAG_CALLS
                and _any_pending(ring, self.max_calls)
            ):
                break
            self._drop(ring.popleft())
        while self._held > self.max_bytes and self._waiting and self._waiting[0].evicted:
            dropped = self._waiting.popleft()
            dropped.pending = dropped.queued = False
            self._held -= dropped.complete.nbytes if dropped.complete is not None else 0
            self.counters.unchecked += 1

    def _drop(self, old: FlightEntry) -> None:
        """``old`` leaves the ring unwritten: its inputs are released; its outputs stay with a pending check."""
        if old.begin is not None:
            self._by_sequence.pop(old.begin.sequence, None)
        self._bytes -= old.nbytes
        self.counters.evicted += 1
        old.begin = None
        old.evicted = True
        if old.queued and old.complete is not None:
            self._held += old.complete.nbytes

    def _side(self, device: torch.device) -> Any:
        side = self._sides.get(device)
        if side is None:
            side = self._sides[device] = torch.cuda.Stream(device)
        return side

    def _launch(self) -> None:
        """Writer thread: give the registered snapshots their event and reduce the queued entries' output
        copies on a side stream after it; one batch (one side event, one pinned result) per device."""
        with self._lock:
            self._flush()
            entries = list(self._waiting)
            self._waiting.clear()
            self._held = 0
            for entry in entries:
                entry.queued = False
        if not entries:
            return
        by_device: dict[torch.device, list[tuple[FlightEntry, list[TensorCopy]]]] = {}
        for entry in entries:
            copies = _output_copies(entry.complete) if entry.complete is not None else []
            device = copies[0].data.device if copies else torch.device("cuda", torch.cuda.current_device())
            by_device.setdefault(device, []).append((entry, [c for c in copies if c.data.device == device]))
        for device, items in by_device.items():
            self._launch_on(device, items)

    def _launch_on(self, device: torch.device, items: list[tuple[FlightEntry, list[TensorCopy]]]) -> None:
        side = self._side(device)
        events: dict[int, Any] = {}
        for entry, _ in items:
            outputs = entry.complete.outputs if entry.complete is not None else None
            event = outputs.event if outputs is not None else None
            if event is not None:
                for one in getattr(event, "events", (event,)):
                    events[id(one)] = one
        for event in events.values():
            side.wait_event(event)
        counts: list[int] = []
        groups: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        keep: list[torch.Tensor] = []
        total = 0
        with torch.cuda.stream(side):
            for _, copies in items:
                counts.append(len(copies))
                for copy in copies:
                    view = copy.view(on_host=False)
                    keep.append(view)
                    if copy.dtype not in _NORM_DTYPES:
                        view = view.float()  # float8 and other narrow floats (on the side stream)
                    groups.setdefault(view.dtype, []).append((total, view))
                    total += 1
            if total == 0:
                batch = _Batch([entry for entry, _ in items], values=[math.nan] * len(items), counts=counts)
            else:
                results: list[Any] = [None] * total
                for dtype, members in groups.items():
                    tensors = [tensor for _, tensor in members]
                    norms: Sequence[torch.Tensor]
                    if dtype in _FOREACH_FLOAT32:
                        norms = torch._foreach_norm(tensors, math.inf, dtype=torch.float32)
                    else:  # float64: no narrowing inside the reduction
                        norms = [norm.float() for norm in torch._foreach_norm(tensors, math.inf)]
                    for (position, _), norm in zip(members, norms, strict=True):
                        results[position] = norm
                host = torch.empty(total, dtype=torch.float32, pin_memory=True)
                host.copy_(torch.stack(results), non_blocking=True)
                event = torch.cuda.Event()
                torch._C._CudaEventBase.record(event, side)
                entries = [entry for entry, _ in items]
                batch = _Batch(entries, event=event, host=host, counts=counts, keep=keep)
        with self._lock:
            self._batches.append(batch)

    def _materialize(self) -> None:
        """Read the magnitudes of every batch whose side event has completed (lock held), oldest first."""
        for batch in self._batches:
            if batch.values is not None:
                continue
            if not batch.event.query():
                return
            assert batch.host is not None and batch.counts is not None
            raw = batch.host.tolist()
            values = []
            at = 0
            for count in batch.counts:
                values.append(_largest(raw[at : at + count]) if count else math.nan)
                at += count
            batch.values = values
            batch.host = None
            batch.keep = None  # the side stream is done with the copies
            # entries stay pending until _check_ready has looked at them (a trigger stops it midway)

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
            counts = batch.counts
            while batch.position < len(batch.entries):
                entry = batch.entries[batch.position]
                value = values[batch.position]
                counted = counts[batch.position] if counts is not None else 1
                batch.position += 1
                entry.pending = False
                if entry.emitted or not counted:
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
        self._evict()  # checked entries past max_calls may leave now
        return None

    def poll(self, *, launch: bool = False) -> None:
        """Check every batch whose magnitudes have arrived; write the ring on a trigger. Never blocks.
        ``launch`` (the writer thread only, inside the graph gate): first launch the queued checks. Without
        it nothing is launched (the serving thread: event queries and pinned reads only)."""
        if launch and (self._waiting or self._unflushed):
            with self._launching:
                self._launch()
        if not self._batches:
            return
        with self._lock:
            trigger = self._check_ready()
            if trigger is None:
                return
            self.counters.triggers += 1
            batch: list[FlightEntry] = []
            while self._ring:
                entry = self._ring.popleft()
                if entry is trigger:
                    batch.append(entry)
                    break
                batch.append(entry)
            while len(batch) > self.max_calls:  # an unchecked suffix may have kept more: K calls at most
                self._drop(batch.pop(0))
            for entry in batch:
                if entry.begin is not None:
                    self._by_sequence.pop(entry.begin.sequence, None)
                self._bytes -= entry.nbytes
                entry.emitted = True
            # calls after the trigger stay in the ring: they are the next incident's history
            what = (
                f"{trigger.begin.op} call {trigger.begin.context.get('call', -1)}"
                if trigger.begin
                else "a call"
            )
            if self.budget.take(what):
                self._emit_batch(trigger, batch)

    def _emit_batch(self, trigger: FlightEntry, batch: list[FlightEntry]) -> None:
        """Hand a trigger's calls to the writer (lock held: an open parent's completion, handed over by the serving
        thread when it comes, must queue behind its Begin)."""
        assert trigger.begin is not None
        writable = [entry for entry in batch if entry.begin is not None]
        name = f"{trigger.begin.op} call {trigger.begin.context.get('call', -1)}"
        logger.error(
            "moereplay: flight recorder triggered by %s (largest |output| = %s): writing %d call(s)",
            name,
            trigger.value,
            len(writable),
        )
        delivery = TriggerDelivery(self.counters, name, len(writable))
        for entry in writable:
            assert entry.begin is not None
            entry.begin.context["flight"] = {"trigger": entry is trigger, "magnitude": entry.value}
            if not self.emit(entry, delivery.delivered):
                delivery.not_handed_over("MOEREPLAY_MAX_CALLS reached")
            elif entry.complete is None:  # an open parent: its completion is written when it comes
                self._forward.add(entry.begin.sequence)

    @property
    def settled(self) -> bool:
        """Whether every call seen so far has been checked (nothing queued, launched or unread)."""
        return not (self._waiting or self._unflushed or self._batches)
