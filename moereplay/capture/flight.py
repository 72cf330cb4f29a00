"""The flight recorder: keep the last K calls on the device, write them only when an output goes bad.

Per call (serving thread) the cost is a fixed handful of launches and no host sync, no allocation once warm:

- inputs and outputs are copied device-to-device into ring buffers taken from a
  :class:`~moereplay.capture.snapshot.BufferPool` (one multi-tensor copy each; a buffer goes back to the pool
  when its entry leaves the ring), and their records are built only if they are ever written;
- the call's floating-point outputs are reduced on the device to their largest magnitude
  (``torch.linalg.vector_norm(ord=inf)``, which propagates NaN) straight into the call's slot of a preallocated
  device vector (:class:`MagnitudeSlots`), and that one float is copied asynchronously into the same slot of a
  pinned host mirror whose value was set to a sentinel (-1; a magnitude is never negative) just before. The slot
  is ready once the sentinel is gone: no CUDA event per call, no ``.item()``.

The check happens later, from :meth:`FlightRecorder.poll` (the serving thread on each new call, and the writer
thread when idle): completed calls wait in completion order and are checked from the oldest while their value
has arrived — a read of pinned memory.

When a value is non-finite or above ``absmax``, the ring's entries up to and including the offending call are
handed to the writer (it waits for the device before moving their copies to the host); enclosing calls still
running (the parent of the offending kernel call) are written with their completion when it comes. The
recorder stays armed: the next bad output (often the same incident's next call) triggers again with what the
ring holds then. On CPU the value is known at once.

The ring is bounded by entry count (``MOEREPLAY_FLIGHT_CALLS``) and device bytes (``MOEREPLAY_FLIGHT_BYTES``);
oldest entries are evicted first. A trigger detected after its call was evicted (a very large call, or a check
lagging more than K calls) is counted as ``flight_lost`` and logged; a check lagging so far that its slot was
reused (more than :attr:`MagnitudeSlots.count` calls) is counted as ``flight_overrun`` (unchecked).
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

from moereplay.capture.writer_thread import Begin, Complete

logger = logging.getLogger("moereplay.capture")

SENTINEL = -1.0
"""Host value of a magnitude slot whose device value has not arrived yet (magnitudes are >= 0 or NaN)."""
SLOTS = 4096
"""Magnitude slots per device (16 KiB of device memory and of pinned host memory)."""


class DeviceSync:
    """What a flight snapshot waits on before its device copies are read: the whole device (the writer thread
    only, and only when the ring is written; no per-call CUDA event)."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _DeviceSlots:
    """One device's magnitude vector and its pinned host mirror, with per-slot views made on first use."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.values = torch.zeros(count, dtype=torch.float32, device=device)
        self.host = torch.full((count,), SENTINEL, dtype=torch.float32, pin_memory=True)
        self.host_array = self.host.numpy()
        self.views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * count

    def view(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(0-d device value, 1-element device slice, 1-element pinned host slice) of ``slot``."""
        views = self.views[slot]
        if views is None:
            views = self.views[slot] = (
                self.values[slot],
                self.values[slot : slot + 1],
                self.host[slot : slot + 1],
            )
        return views


class MagnitudeSlots:
    """Largest |output| per call, written on the device into a ring of ``count`` slots and read back through
    pinned memory without a sync (see the module docstring). Not thread-safe for :meth:`record` (the serving
    thread); :meth:`read` may run on any thread."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0
        self._owners = [-1] * count
        self._devices: dict[torch.device, _DeviceSlots] = {}
        self._cpu_values = [SENTINEL] * count

    def record(self, sequence: int, tensors: Iterable[torch.Tensor]) -> tuple[Any, int] | None:
        """Queue the reduction of ``tensors`` (floating point, non-empty, on the first such tensor's device;
        others are ignored) for call ``sequence``; return its ticket for :meth:`read`, or ``None`` when there
        is nothing to check."""
        floats = [t for t in tensors if t.is_floating_point() and t.numel()]
        if not floats:
            return None
        slot = self._next
        self._next = slot + 1 if slot + 1 < self.count else 0
        self._owners[slot] = sequence
        device = floats[0].device
        floats = [t for t in floats if t.device == device]  # outputs on another device go unchecked
        if device.type == "cpu":
            values = [_magnitude(t).item() for t in floats]  # CPU: nothing to overlap with
            self._cpu_values[slot] = math.nan if any(math.isnan(v) for v in values) else max(values)
            return None, slot
        slots = self._devices.get(device)
        if slots is None:
            slots = self._devices[device] = _DeviceSlots(device, self.count)
        slots.host_array[slot] = SENTINEL
        out, device_slice, host_slice = slots.view(slot)
        torch.linalg.vector_norm(_reducible(floats[0]), ord=math.inf, dtype=torch.float32, out=out)
        for tensor in floats[1:]:
            torch.maximum(out, _magnitude(tensor), out=out)
        host_slice.copy_(device_slice, non_blocking=True)
        return slots, slot

    def read(self, sequence: int, ticket: tuple[Any, int]) -> float | None:
        """The value for ``ticket`` if it has arrived; ``None`` if not yet. Raises ``LookupError`` when the slot
        was reused by a later call before this one was read."""
        slots, slot = ticket
        if self._owners[slot] != sequence:
            raise LookupError(slot)
        value = float(self._cpu_values[slot] if slots is None else slots.host_array[slot])
        if value == SENTINEL:
            return None
        return value


_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _reducible(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a float32 copy of it for dtypes the reduction does not take (float8 variants)."""
    return tensor if tensor.dtype in _REDUCIBLE else tensor.float()


def _magnitude(tensor: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(_reducible(tensor), ord=math.inf, dtype=torch.float32)


def output_magnitude(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Largest |value| over the floating-point tensors, as a 0-d float32 on their device (NaN if any NaN);
    ``None`` when there is nothing to check."""
    result: torch.Tensor | None = None
    for tensor in tensors:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        value = _magnitude(tensor)
        result = value if result is None else torch.maximum(result, value)
    return result


class FlightEntry:
    """One call in the ring: its Begin (``None`` if it left the ring before completing), its Complete, its
    magnitude ticket and, once read, its value."""

    __slots__ = ("begin", "checked", "complete", "evicted", "sequence", "ticket", "value")

    def __init__(self, begin: Begin | None, sequence: int = -1) -> None:
        self.begin = begin
        self.sequence = begin.sequence if begin is not None else sequence
        self.complete: Complete | None = None
        self.ticket: tuple[Any, int] | None = None
        self.checked = False
        self.evicted = False
        self.value: float | None = None

    @property
    def nbytes(self) -> int:
        held = self.begin.nbytes if self.begin is not None else 0
        return held + (self.complete.nbytes if self.complete is not None else 0)

    def release(self) -> None:
        """Give the entry's device buffers back (it left the ring unwritten)."""
        if self.begin is not None:
            self.begin.snapshot.release()
        if self.complete is not None and self.complete.outputs is not None:
            self.complete.outputs.release()


@dataclass
class FlightCounters:
    checked: int = 0
    triggers: int = 0
    written: int = 0
    lost: int = 0
    evicted: int = 0
    overrun: int = 0


@dataclass
class FlightRecorder:
    """See the module docstring. ``emit`` hands an entry's Begin and Complete to the writer."""

    max_calls: int
    max_bytes: int
    absmax: float | None
    emit: Callable[[FlightEntry], bool]
    emit_complete: Callable[[Complete], None]
    counters: FlightCounters = field(default_factory=FlightCounters)
    slots: MagnitudeSlots | None = None
    _ring: deque[FlightEntry] = field(default_factory=deque)
    _by_sequence: dict[int, FlightEntry] = field(default_factory=dict)
    _unchecked: deque[FlightEntry] = field(default_factory=deque)  # completed, value not read, oldest first
    _forward: set[int] = field(default_factory=set)  # written before they completed (open parents)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.slots is None:
            # a slot is refilled only after this many later calls: far more than the device ever lags behind
            # the host (a whole forward pass of a large MoE model is ~100 wrapped calls)
            self.slots = MagnitudeSlots(max(SLOTS, 8 * self.max_calls))

    def add_begin(self, begin: Begin) -> None:
        entry = FlightEntry(begin)
        with self._lock:
            self._ring.append(entry)
            self._by_sequence[begin.sequence] = entry
            self._bytes += entry.nbytes
            self._evict()

    def add_complete(self, complete: Complete, outputs: list[torch.Tensor]) -> None:
        """Attach a call's outputs and queue its check (immediate on CPU). A call already written (a parent
        whose child triggered) has its completion written straight away."""
        sequence = complete.sequence
        if self._forward:
            with self._lock:
                forward = sequence in self._forward
                self._forward.discard(sequence)
            if forward:
                self.emit_complete(complete)
                return
        assert self.slots is not None
        ticket = self.slots.record(sequence, outputs)
        with self._lock:
            entry = self._by_sequence.get(sequence)
            if entry is None:  # evicted already (larger than the ring): still check the call
                entry = FlightEntry(None, sequence)
                entry.evicted = True
                if complete.outputs is not None:
                    complete.outputs.release()
            else:
                entry.complete = complete
                self._bytes += complete.nbytes
            entry.ticket = ticket
            if ticket is not None:
                self._unchecked.append(entry)
            self._evict()
        if ticket is not None and ticket[0] is None:
            self.poll()

    def _evict(self) -> None:
        while self._ring and (len(self._ring) > self.max_calls or self._bytes > self.max_bytes):
            old = self._ring.popleft()
            self._by_sequence.pop(old.sequence, None)
            self._bytes -= old.nbytes
            self.counters.evicted += 1
            old.evicted = True
            old.release()
            old.begin = None
            old.complete = None

    def _is_bad(self, value: float) -> bool:
        return not math.isfinite(value) or (self.absmax is not None and value > self.absmax)

    def poll(self) -> None:
        """Check every completed call whose value has arrived, oldest first; write the ring on a trigger.
        Never blocks on the device."""
        if not self._unchecked:
            return
        assert self.slots is not None
        with self._lock:
            trigger: FlightEntry | None = None
            while self._unchecked:
                entry = self._unchecked[0]
                assert entry.ticket is not None
                try:
                    value = self.slots.read(entry.sequence, entry.ticket)
                except LookupError:
                    self._unchecked.popleft()
                    self.counters.overrun += 1
                    continue
                if value is None:
                    break
                self._unchecked.popleft()
                entry.checked = True
                entry.value = value
                self.counters.checked += 1
                if not self._is_bad(value):
                    continue
                self.counters.triggers += 1
                if entry.evicted:
                    self.counters.lost += 1
                    logger.error(
                        "moereplay: flight recorder: call %s had a bad output but left the ring before the "
                        "check (raise MOEREPLAY_FLIGHT_CALLS / MOEREPLAY_FLIGHT_BYTES)",
                        entry.sequence,
                    )
                    continue
                trigger = entry
                break
            if trigger is None:
                return
            batch: list[FlightEntry] = []
            while self._ring:
                entry = self._ring.popleft()
                self._by_sequence.pop(entry.sequence, None)
                self._bytes -= entry.nbytes
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
                        self._forward.add(entry.sequence)
            else:
                entry.release()

    def as_counters(self) -> dict[str, int]:
        return {f"flight_{key}": value for key, value in self.counters.__dict__.items()}
