"""The background writer: a bounded queue in front of the capture file, drained by one daemon thread.

The serving thread only ever calls :meth:`WriterThread.offer`, which never blocks: when the queue is full (in
calls or in bytes of copied tensors) the call is dropped and counted. The thread waits for each snapshot's CUDA
event (so copies complete off the serving thread), then hands the record to the file. Any error writing the file
(a full disk raises ``OSError``) or past ``max_bytes`` stops the writing for good: later records are dropped and
counted, the file keeps every whole record written so far, and the failure is reported once through
``on_failure`` — the recorder disables itself, the wrapped functions keep working. Whenever the queue runs empty
the file is flushed to the operating system, so a process killed without running its exit handlers (vLLM ends
its engine and worker processes that way) still leaves every record written before its last idle moment.

Polling (the flight recorders' checks, :meth:`set_poll`): the thread runs ``poll`` whenever its queue has been
idle ``poll_interval`` seconds (5 ms) and, while it is busy writing, between two messages once ``poll_interval``
has passed since the last poll — so a check never waits on the serving thread, which may be idle: the delay from
a call's completion on the device to its check is about ``poll_interval`` (the ring kernels store finished checks
in host-mapped memory; on CUDA without them, two polls: one launches the read, the next reads it), plus at most
one message's write. The layer-scope recorder's eager calls are checked sooner, by the serving thread itself at the
end of the next call; while it does (and no CUDA graph holds ring launches), its poll leaves them alone and asks
for the next poll up to ``flight_layer.QUIET_POLL_S`` later (fewer GIL hand-offs), and the serving thread calls
:meth:`WriterThread.wake_poll` when it leaves a call to the writer — so a trigger among them waits at most that
window and one quiet poll after the serving thread stops making calls. With nothing outstanding (no call waiting
for its check: a process whose layers are not recorded, or between requests) a poll asks for
``flight_layer.IDLE_POLL_S``, and the serving thread wakes the writer when it next leaves a call unchecked.

Delivery: a :class:`Begin` or :class:`Complete` may carry ``delivered``, told exactly once whether the message
reached the file — ``(True, None)`` after the sink's write returned, ``(False, why)`` when it never will (refused
by :meth:`offer`, a failed write, the writer failed before, its call's Begin was not written). The flight
recorders count ``flight_written`` by it, never by having queued a message. :meth:`drain` runs a last settle on
this thread and waits (bounded) until what it queued is written — the SIGTERM handler's flush.

Look-ahead: before writing a message the thread offers the messages queued behind it whose copies have landed
(their CUDA event has completed: a non-blocking query, inside the graph gate like every CUDA call of this
thread) to the sink's ``prefetch``, at most ``prefetch_bytes`` of copied tensors ahead, so the file writer's pool
hashes and compresses them while earlier records are written. ``release`` gives back what a message did not use.

Messages (in queue order, so a parent's begin precedes its children's):

- :class:`Begin`: a call's inputs (file status ``inputs_saved``); its ``sequence`` names it for later messages;
- :class:`Complete`: that call's outputs, timings and status;
- :class:`Barrier`: set an event once everything before it is written (tests, flush at exit);
- :class:`Drain`: run a settle function on this thread, then a Barrier behind what it queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from moereplay.capture.graph_gate import GraphGate
from moereplay.capture.snapshot import Snapshot
from moereplay.errors import FileLimitError

logger = logging.getLogger("moereplay.capture")

Delivered = Callable[[bool, str | None], None]
"""``delivered(written, why_not)``: see the module docstring (Delivery)."""


POLL_INTERVAL_S = 0.005
"""The default seconds between two polls of an idle writer thread (:meth:`WriterThread.set_poll`)."""

MAX_POLL_WAIT_S = 0.5
"""The longest a poll may ask the thread to wait for the next one (see :meth:`WriterThread.set_poll`): the layer
flight recorder's wait while nothing is outstanding (``flight_layer.IDLE_POLL_S``)."""


class RecordSink(Protocol):
    """What the writer thread writes into (the capture file, adapted)."""

    def begin(self, message: Begin, parent: int | None) -> int: ...

    def complete(self, index: int, message: Complete) -> None: ...

    def bytes_written(self) -> int: ...

    def flush(self) -> None: ...

    def close(self, counters: dict[str, int]) -> None: ...


class PrefetchingSink(RecordSink, Protocol):
    """A sink that can start work on a queued message early (optional: the thread checks with ``hasattr``)."""

    def prefetch(self, message: Begin | Complete) -> None: ...

    def release(self, message: Begin | Complete) -> None: ...


@dataclass
class Begin:
    sequence: int
    op: str
    site: str
    snapshot: Snapshot
    context: dict[str, Any]
    parent_sequence: int | None
    static: tuple[str, ...] = ()
    started: float = 0.0
    delivered: Delivered | None = None

    @property
    def nbytes(self) -> int:
        return self.snapshot.copied


@dataclass
class Complete:
    sequence: int
    outputs: Snapshot | None
    timings: dict[str, float]
    status: str
    error: str | None = None
    device_timing: tuple[Any, Any] | None = None  # CUDA start / end events, resolved on the writer thread
    finished: float = 0.0
    delivered: Delivered | None = None

    @property
    def nbytes(self) -> int:
        return self.outputs.copied if self.outputs is not None else 0


@dataclass
class Barrier:
    done: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0


@dataclass
class Drain:
    """``settle(seconds)`` runs on the writer thread (the flight recorder's last checks: their triggers queue
    more messages), then ``done`` is set once everything queued by then is written."""

    settle: Callable[[float], Any] | None
    deadline: float  # time.monotonic()
    done: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0


Message = Begin | Complete | Barrier | Drain

DEFAULT_PREFETCH_BYTES = 1 << 30
"""Copied bytes of queued messages the thread may hand to the sink's ``prefetch`` ahead of writing them (their
compressed frames wait in host memory until written)."""
_PREFETCH_MESSAGES = 32
_EMPTY = object()


@dataclass
class Counters:
    """What was written and dropped, and why; written into the file's footer and logged at close.
    ``copied_bytes``: bytes of copied (non-static) tensor spans handed to the file, inputs and outputs."""

    recorded: int = 0
    completed: int = 0
    copied_bytes: int = 0
    dropped_queue_full: int = 0
    dropped_after_failure: int = 0
    dropped_max_bytes: int = 0
    outputs_dropped: int = 0
    write_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Together:
    """One ``delivered`` for several messages of one call: told once all of them were, written only if all were."""

    def __init__(self, parts: int, delivered: Delivered) -> None:
        self._left = parts
        self._why: str | None = None
        self._delivered = delivered
        self._lock = threading.Lock()

    def part(self, written: bool, why: str | None) -> None:
        with self._lock:
            self._left -= 1
            if not written and self._why is None:
                self._why = why or "not written"
            if self._left:
                return
        self._delivered(self._why is None, self._why)


class WriterThread:
    """See the module docstring. ``max_bytes`` 0 = no limit."""

    def __init__(
        self,
        sink: RecordSink,
        *,
        max_calls_queued: int,
        max_bytes_queued: int,
        max_file_bytes: int = 0,
        on_failure: Callable[[str], None] | None = None,
        poll: Callable[[], float | None] | None = None,
        poll_interval: float = POLL_INTERVAL_S,
        name: str = "moereplay-writer",
        gate: GraphGate | None = None,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
    ) -> None:
        self._gate = gate
        self._poll = poll
        self._poll_interval = poll_interval
        self._poll_wait = poll_interval  # until the next poll: what the last poll asked for (see set_poll)
        self._wakes = 0  # wake_poll calls: a poll that overlapped one does not stretch the wait
        self.extra_counters: Callable[[], dict[str, int]] | None = None
        self.sink = sink
        self.counters = Counters()
        # writer-thread time: waiting for copies, writing the file, looking ahead (prefetch)
        self.seconds = {"wait": 0.0, "sink": 0.0, "prefetch": 0.0}
        self.max_calls_queued = max_calls_queued
        self.max_bytes_queued = max_bytes_queued
        self.max_file_bytes = max_file_bytes
        if max_file_bytes and hasattr(sink, "byte_limit"):
            # the sink knows what a call adds to the file (weights are written once per file, not per call)
            sink.byte_limit = max_file_bytes
        self._on_failure = on_failure
        self._queue: deque[Message | None] = deque()
        self._ready = threading.Condition()
        self.prefetch_bytes = prefetch_bytes
        self._prefetched: dict[int, int] = {}  # id(message) -> its bytes, for messages handed to prefetch
        self._prefetched_bytes = 0
        self._lock = threading.Lock()
        self._queued_calls = 0
        self._queued_bytes = 0
        self._failed: str | None = None
        self._stopping = False
        self._closed = False
        self._indices: dict[int, int] = {}  # sequence -> file index
        self._dropped_sequences: set[int] = set()
        self._last_poll = 0.0  # time.monotonic() of the last poll
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- producer side (serving thread) ---------------------------------------------------------------------

    @property
    def failed(self) -> str | None:
        return self._failed

    def has_room(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` would be accepted now (checked before paying for copies)."""
        with self._lock:
            return (
                self._failed is None
                and not self._stopping
                and self._queued_calls < self.max_calls_queued
                and self._queued_bytes + nbytes <= self.max_bytes_queued
            )

    def offer(self, message: Begin | Complete) -> bool:
        """Queue ``message`` unless full or failed; never blocks. Returns whether it was queued."""
        nbytes = message.nbytes
        refused: str | None = None
        with self._lock:
            if isinstance(message, Complete) and message.sequence in self._dropped_sequences:
                self._dropped_sequences.discard(message.sequence)
                refused = "its call's inputs were not queued"
            elif self._failed is not None or self._stopping:
                refused = f"the writer stopped ({self._failed})" if self._failed else "the capture is closing"
                self.counters.dropped_after_failure += isinstance(message, Begin)
            elif (
                self._queued_calls >= self.max_calls_queued
                or self._queued_bytes + nbytes > self.max_bytes_queued
            ):
                refused = "the writer's queue was full"
                if isinstance(message, Begin):
                    self.counters.dropped_queue_full += 1
                else:
                    self.counters.outputs_dropped += 1
            else:
                self._queued_calls += 1
                self._queued_bytes += nbytes
            if refused is not None and isinstance(message, Begin):
                self._dropped_sequences.add(message.sequence)
        if refused is not None:
            _report(message, False, refused)
            return False
        self._put(message)
        return True

    def offer_call(self, begin: Begin, complete: Complete | None, delivered: Delivered | None = None) -> bool:
        """:meth:`offer` a call's Begin and (if given) its Complete; ``delivered`` is told once whether both
        reached the file. Returns whether the Begin was queued."""
        if delivered is not None:
            together = _Together(1 if complete is None else 2, delivered)
            begin.delivered = together.part
            if complete is not None:
                complete.delivered = together.part
        accepted = self.offer(begin)
        if complete is not None:
            self.offer(complete)  # refused (and reported) when its Begin was
        return accepted

    def set_poll(self, poll: Callable[[], float | None]) -> None:
        """Run ``poll`` on the writer thread every ``poll_interval`` seconds (see the module docstring). Wakes the
        thread: one waiting for a message without a timeout (no poll until now) starts polling at once. ``poll``
        may return how many seconds it can wait for the next one (at least ``poll_interval``, at most
        :data:`MAX_POLL_WAIT_S`; None: ``poll_interval``) — a recorder whose checks another thread makes for now
        — and then :meth:`wake_poll` brings the next poll forward."""
        with self._ready:
            self._poll = poll
            self._poll_wait = self._poll_interval
            self._ready.notify()

    def wake_poll(self) -> None:
        """Poll now (at once if the thread is idle, else after the message it is writing), and every
        ``poll_interval`` from then until a poll that began after this asks to wait longer. Safe from any
        thread (and in a signal handler's way: see :meth:`drain`)."""
        with self._ready:
            self._wakes += 1
            self._poll_wait = self._poll_interval
            self._ready.notify()

    @property
    def poll_interval(self) -> float:
        """Seconds between two polls of an idle writer thread."""
        return self._poll_interval

    def drop(self, sequence: int) -> None:
        """Forget a call whose Begin was never offered (its Complete will be ignored)."""
        with self._lock:
            self._dropped_sequences.add(sequence)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written (or failed). Returns False on timeout."""
        if self._closed or not self._thread.is_alive():
            return True
        barrier = Barrier()
        self._put(barrier)
        return barrier.done.wait(timeout)

    def drain(self, settle: Callable[[float], Any] | None, timeout: float) -> bool:
        """Run ``settle(seconds left)`` on the writer thread, then wait until everything queued by then (what
        ``settle`` queued included) is written — at most ``timeout`` seconds from now: safe in a signal handler
        of the serving thread (it only appends to the queue and waits on an event; the thread does the rest).
        Returns False on timeout."""
        if self._closed or not self._thread.is_alive():
            return True
        drain = Drain(settle, time.monotonic() + timeout)
        self._put(drain)
        owned = getattr(self._ready, "_is_owned", None)
        if owned is not None and owned():
            # a signal handler that interrupted this thread inside the queue's lock (an offer, a wake_poll): wait
            # on the condition, which lets go of every level of that lock, so the writer thread can take the drain
            with self._ready:
                while not drain.done.is_set() and time.monotonic() < drain.deadline:
                    self._ready.wait(0.01)
            return drain.done.is_set()
        return drain.done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, then the footer with the counters, and stop the thread."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._put(None)
        self._thread.join(timeout)
        self._closed = True

    def _put(self, item: Message | None) -> None:
        with self._ready:
            self._queue.append(item)
            self._ready.notify()

    # --- consumer side (writer thread) ----------------------------------------------------------------------

    def _get(self) -> Message | object | None:
        """The next queued item, or ``_EMPTY`` after ``poll_interval`` seconds without one (without a poll: when
        woken, e.g. by :meth:`set_poll`). The timeout is read again on every wait."""
        with self._ready:
            if not self._queue:
                if self._poll is None:
                    self._ready.wait()
                else:  # counted from the last poll, so messages in between do not put the next one off
                    self._ready.wait(max(0.0, self._last_poll + self._poll_wait - time.monotonic()))
                if not self._queue:
                    return _EMPTY
            return self._queue.popleft()

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = reason
        if self._on_failure is not None:
            try:
                self._on_failure(reason)
            except Exception:
                logger.exception("moereplay: capture failure handler raised")

    def _run(self) -> None:
        while True:
            item = self._get()
            if item is _EMPTY:
                self._run_poll()
                continue
            if item is None:
                break
            message: Message = item  # type: ignore[assignment]
            if isinstance(message, Barrier):
                self._flush_sink()
                message.done.set()
                continue
            if isinstance(message, Drain):
                self._drain(message)
                continue
            why_not: str | None = None
            try:
                if self._failed is None:
                    self._prefetch_ahead(message)
                    if self._gate is None:
                        why_not = self._write(message)
                    else:
                        with self._gate.device_work():  # never inside another thread's CUDA graph capture
                            why_not = self._write(message)
                else:
                    why_not = f"an earlier write failed ({self._failed})"
                    if isinstance(message, Begin):
                        self.counters.dropped_after_failure += 1
            except OSError as error:
                self.counters.write_errors += 1
                why_not = f"writing the capture file failed: {error}"
                self._fail(why_not)
            except Exception as error:
                self.counters.write_errors += 1
                why_not = (
                    f"recording a {type(message).__name__.lower()} failed: {type(error).__name__}: {error}"
                )
                self._fail(why_not)
            finally:
                self._release(message)
                with self._lock:
                    self._queued_calls -= 1
                    self._queued_bytes -= message.nbytes
            _report(message, why_not is None, why_not)
            if not self._queue:
                self._flush_sink()
            elif self._poll is not None and time.monotonic() - self._last_poll >= self._poll_wait:
                self._run_poll()  # busy: checks still run every poll_interval
        self._finish()

    def _drain(self, drain: Drain) -> None:
        if drain.settle is not None and self._failed is None:
            try:
                drain.settle(max(0.0, drain.deadline - time.monotonic()))
            except Exception as error:
                logger.error(
                    "moereplay: the last flight recorder checks failed: %s: %s", type(error).__name__, error
                )
        self._put(Barrier(drain.done))  # behind what the settle queued

    def _prefetch_ahead(self, current: Begin | Complete) -> None:
        """Hand ``current`` and the messages queued behind it whose copies are done to the sink's prefetch, in
        queue order, within ``prefetch_bytes`` (see the module docstring)."""
        prefetch = getattr(self.sink, "prefetch", None)
        if prefetch is None or self.prefetch_bytes <= 0:
            return
        started = time.perf_counter()
        with self._ready:
            ahead = list(islice(self._queue, _PREFETCH_MESSAGES))
        for item in [current, *ahead]:
            if item is None or isinstance(item, (Barrier, Drain)):
                continue
            if id(item) in self._prefetched:
                continue
            copies = item.snapshot if isinstance(item, Begin) else item.outputs
            if copies is None or not item.nbytes:
                continue
            if item is not current and self._prefetched_bytes + item.nbytes > self.prefetch_bytes:
                break
            if copies.event is not None:
                if self._gate is None:
                    landed = bool(copies.event.query())
                else:
                    with self._gate.device_work():  # never inside another thread's CUDA graph capture
                        landed = bool(copies.event.query())
                if not landed:
                    break  # later messages were copied later: keep the order
            self._prefetched[id(item)] = item.nbytes
            self._prefetched_bytes += item.nbytes
            prefetch(item)
        self.seconds["prefetch"] += time.perf_counter() - started

    def _release(self, message: Begin | Complete) -> None:
        nbytes = self._prefetched.pop(id(message), None)
        if nbytes is None:
            return
        self._prefetched_bytes -= nbytes
        release = getattr(self.sink, "release", None)
        if release is not None:
            try:
                release(message)
            except Exception:
                logger.exception("moereplay: releasing prefetched capture work failed")

    def _flush_sink(self) -> None:
        if self._failed is not None:
            return
        try:
            self.sink.flush()
        except Exception as error:
            self.counters.write_errors += 1
            self._fail(f"flushing the capture file failed: {type(error).__name__}: {error}")

    def _run_poll(self) -> None:
        self._last_poll = time.monotonic()
        if self._poll is None or self._failed is not None:
            return
        wanted = None
        wakes = self._wakes
        try:
            if self._gate is None:
                wanted = self._poll()
            else:
                with self._gate.device_work():
                    wanted = self._poll()
        except Exception as error:
            self._fail(f"the flight recorder check failed: {type(error).__name__}: {error}")
        interval = self._poll_interval
        with self._ready:  # wake_poll writes both under this lock: a wake cannot land between test and store
            if isinstance(wanted, (int, float)) and wanted > interval and self._wakes == wakes:
                interval = min(float(wanted), MAX_POLL_WAIT_S)
            self._poll_wait = interval

    def _at_bound(self, *, outputs: bool) -> str:
        """A record refused by ``MOEREPLAY_MAX_BYTES``: counted, and writing stops; returns why."""
        self.counters.dropped_max_bytes += 1
        self.counters.outputs_dropped += outputs
        reason = f"the capture file reached MOEREPLAY_MAX_BYTES={self.max_file_bytes}"
        self._fail(reason)
        return reason

    def _write(self, message: Begin | Complete) -> str | None:
        """Write ``message``; ``None`` when the sink took it, else why it was not written."""
        if isinstance(message, Begin):
            if self.max_file_bytes and self.sink.bytes_written() + message.nbytes > self.max_file_bytes:
                return self._at_bound(outputs=False)
            started = time.perf_counter()
            message.snapshot.wait()
            waited = time.perf_counter()
            parent = None if message.parent_sequence is None else self._indices.get(message.parent_sequence)
            try:
                index = self.sink.begin(message, parent)
            except FileLimitError:  # its weights, new to this file, would pass the bound
                return self._at_bound(outputs=False)
            self.seconds["wait"] += waited - started
            self.seconds["sink"] += time.perf_counter() - waited
            self._indices[message.sequence] = index
            self.counters.recorded += 1
            self.counters.copied_bytes += message.nbytes
            return None
        index_or_none = self._indices.pop(message.sequence, None)
        if index_or_none is None:
            return "its call's inputs were not written"
        started = time.perf_counter()
        if message.outputs is not None:
            message.outputs.wait()
        self.seconds["wait"] += time.perf_counter() - started
        if message.device_timing is not None:
            start, end = message.device_timing
            end.synchronize()
            message.timings["device_ms"] = float(start.elapsed_time(end))
        if self.max_file_bytes and self.sink.bytes_written() + message.nbytes > self.max_file_bytes:
            return self._at_bound(outputs=True)
        started = time.perf_counter()
        try:
            self.sink.complete(index_or_none, message)
        except FileLimitError:
            return self._at_bound(outputs=True)
        self.seconds["sink"] += time.perf_counter() - started
        self.counters.completed += 1
        self.counters.copied_bytes += message.nbytes
        return None

    def _finish(self) -> None:
        counters = self.counters.as_dict()
        if self.extra_counters is not None:
            try:
                counters.update(self.extra_counters())
            except Exception:
                logger.exception("moereplay: collecting capture counters failed")
        try:
            self.sink.close(counters)
        except Exception as error:  # a full disk can fail the footer too: the records before it stay readable
            self._fail(f"closing the capture file failed: {type(error).__name__}: {error}")
        kept = getattr(self.sink, "kept", None) if self._failed is not None else None
        if kept is not None:  # what the file holds, not what was handed to it (buffered bytes were lost)
            counters["file_calls"], counters["file_completions"] = kept
        logger.warning("%s", summary_line(getattr(self.sink, "path", None), counters, self._failed))


def summary_line(path: Any, counters: dict[str, int], failed: str | None) -> str:
    """The one line logged when a capture file is closed: what reached it, what did not and why (the footer's
    counters say the same)."""
    parts = [
        f"{counters.get('recorded', 0)} call(s) written ({counters.get('completed', 0)} with outputs)",
        f"write_errors={counters.get('write_errors', 0)}",
    ]
    if "flight_triggers" in counters:
        parts.append(
            f"flight recorder: flight_triggers={counters['flight_triggers']} "
            f"flight_written={counters.get('flight_written', 0)} "
            f"flight_write_failed={counters.get('flight_write_failed', 0)} "
            f"flight_lost={counters.get('flight_lost', 0)}"
        )
    dropped = {
        key: value
        for key, value in counters.items()
        if key.startswith(("dropped", "outputs", "recorder_dropped")) and value
    }
    if dropped:
        parts.append(f"dropped: {dropped}")
    if failed is not None:
        parts.append(f"writing stopped: {failed}")
    if "file_calls" in counters:
        parts.append(
            f"the file keeps {counters['file_calls']} call(s) ({counters.get('file_completions', 0)} with outputs)"
        )
    where = f" {path}" if path is not None else ""
    return f"moereplay: capture closed{where}: " + "; ".join(parts)


def _report(message: Begin | Complete, written: bool, why_not: str | None) -> None:
    """Tell ``message.delivered`` (once) whether the message reached the file."""
    delivered = message.delivered
    if delivered is None:
        return
    message.delivered = None
    try:
        delivered(written, why_not)
    except Exception:
        logger.exception("moereplay: a capture delivery callback raised")


def monotonic() -> float:
    return time.perf_counter()
