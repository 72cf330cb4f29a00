"""The flight recorder: keep the last K calls on the device, write them only when an output goes bad.

Per call (serving thread): the inputs and outputs are copied device-to-device into a ring entry (no host
transfer), and each floating-point output is reduced on the device to its largest magnitude
(``torch.linalg.vector_norm(ord=inf)``, which propagates NaN) — one small kernel. The 0-d result is copied
asynchronously into pinned host memory and a CUDA event is recorded after it. Nothing waits: the check happens
later, when the event has completed, from :meth:`FlightRecorder.poll` (called by the writer thread between
messages, and by the serving thread on each new call) — ``event.query()`` and a read of pinned memory.

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

from moereplay.capture.writer_thread import Begin, Complete

logger = logging.getLogger("moereplay.capture")


@dataclass
class FlightEntry:
    begin: Begin | None  # None: the call's inputs left the ring before it completed
    complete: Complete | None = None
    stat_host: torch.Tensor | None = None  # 0-d float32; pinned on CUDA
    stat_event: Any = None
    checked: bool = False
    value: float | None = None

    @property
    def nbytes(self) -> int:
        held = self.begin.nbytes if self.begin is not None else 0
        return held + (self.complete.nbytes if self.complete is not None else 0)


@dataclass
class FlightCounters:
    checked: int = 0
    triggers: int = 0
    written: int = 0
    lost: int = 0
    evicted: int = 0


def output_magnitude(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Largest |value| over the floating-point tensors, as a 0-d float32 on their device (NaN if any NaN);
    ``None`` when there is nothing to check. Launches one reduction per tensor (plus a max when several)."""
    result: torch.Tensor | None = None
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for tensor in tensors:
        if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        value = torch.linalg.vector_norm(tensor, ord=math.inf, dtype=torch.float32)
        result = value if result is None else torch.maximum(result, value)
    return result


@dataclass
class FlightRecorder:
    """See the module docstring. ``emit`` hands an entry's Begin and Complete to the writer."""

    max_calls: int
    max_bytes: int
    absmax: float | None
    emit: Callable[[FlightEntry], bool]
    emit_complete: Callable[[Complete], None]
    counters: FlightCounters = field(default_factory=FlightCounters)
    _ring: deque[FlightEntry] = field(default_factory=deque)
    _by_sequence: dict[int, FlightEntry] = field(default_factory=dict)
    _orphans: list[FlightEntry] = field(default_factory=list)
    _forward: set[int] = field(default_factory=set)  # written before they completed (open parents)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

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
        with self._lock:
            forward = complete.sequence in self._forward
            self._forward.discard(complete.sequence)
        if forward:
            self.emit_complete(complete)
            return
        magnitude = output_magnitude(outputs)
        stat_host = None
        event = None
        if magnitude is not None:
            if magnitude.is_cuda:
                stat_host = torch.empty((), dtype=torch.float32, pin_memory=True)
                stat_host.copy_(magnitude, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                stat_host = magnitude
        with self._lock:
            entry = self._by_sequence.get(complete.sequence)
            if entry is None:  # evicted already (larger than the ring): still check the call
                entry = FlightEntry(None)
            entry.complete = complete
            entry.stat_host = stat_host
            entry.stat_event = event
            if entry.begin is not None:
                self._bytes += complete.nbytes
            self._evict()
            if entry.begin is None:
                self._orphans.append(entry)
        if event is None:
            self.poll()

    def _evict(self) -> None:
        while self._ring and (len(self._ring) > self.max_calls or self._bytes > self.max_bytes):
            old = self._ring.popleft()
            if old.begin is not None:
                self._by_sequence.pop(old.begin.sequence, None)
            self._bytes -= old.nbytes
            self.counters.evicted += 1
            if not old.checked and old.stat_host is not None:
                self._orphans.append(old)

    def _ready(self, entry: FlightEntry) -> bool:
        if entry.checked or entry.stat_host is None:
            return False
        return entry.stat_event is None or bool(entry.stat_event.query())

    def _is_bad(self, value: float) -> bool:
        return not math.isfinite(value) or (self.absmax is not None and value > self.absmax)

    def poll(self) -> None:
        """Check every entry whose reduction has finished; write the ring on a trigger. Never blocks."""
        with self._lock:
            trigger: FlightEntry | None = None
            for entry in list(self._orphans):
                if self._ready(entry):
                    entry.checked = True
                    self._orphans.remove(entry)
                    self.counters.checked += 1
                    if self._is_bad(float(entry.stat_host)):  # type: ignore[arg-type]
                        self.counters.triggers += 1
                        self.counters.lost += 1
                        logger.error(
                            "moereplay: flight recorder: call %s had a bad output but left the ring before the "
                            "check (raise MOEREPLAY_FLIGHT_CALLS / MOEREPLAY_FLIGHT_BYTES)",
                            entry.complete.sequence if entry.complete else "?",
                        )
            for entry in self._ring:
                if entry.complete is None:
                    continue
                if self._ready(entry):
                    entry.checked = True
                    entry.value = float(entry.stat_host)  # type: ignore[arg-type]
                    self.counters.checked += 1
                    if self._is_bad(entry.value):
                        trigger = entry
                        break
            if trigger is None:
                return
            self.counters.triggers += 1
            batch: list[FlightEntry] = []
            while self._ring:
                entry = self._ring.popleft()
                if entry.begin is not None:
                    self._by_sequence.pop(entry.begin.sequence, None)
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
                        self._forward.add(entry.begin.sequence)

    def as_counters(self) -> dict[str, int]:
        return {f"flight_{key}": value for key, value in self.counters.__dict__.items()}
