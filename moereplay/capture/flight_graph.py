"""The layer-scope flight recorder under CUDA graphs: graph-replayed layer calls kept and checked on the device.

A layer call made while vLLM captures a CUDA graph runs again on every replay of that graph, with no Python. So
instead of skipping it, :meth:`GraphFlight.capture` captures one small kernel right after it into the same graph
(:mod:`moereplay.capture.graph_ring`): on every replay it reserves the call's entry in a device ring (position,
sequence number and step are device counters), copy its dynamic inputs and output there, reduce the output to its
largest magnitude and store the finished tag word into pinned host memory. The host keeps, per captured launch
(its *launch id*), what a written record needs — target, layer and layer name, each copied tensor's metadata and
offset in the entry, the argument trees with static weights by reference (the dynamic tensors themselves are let
go at capture: a graph replays into the same addresses) — and nothing per replay.

Writer thread (:meth:`GraphFlight.poll`, beside the eager checks, every ≈ 5 ms): read the tag words of the
sequences finished since the last poll (plain memory reads of a NumPy view; no CUDA call), in sequence order,
stopping at the first not yet finished — only as far as the device's hint word says it has reserved, and not at
all when the hint has not moved (a whole chunk every :data:`FULL_READ_S` whatever it says). The poll holds the
GIL, which at decode it takes from the serving thread: 20.7 µs with 48 new words and 2.7 µs with none, against
54.5 and 44.7 µs when every poll read a whole chunk (``tools/bench/graph_poll_bench.py``, development machine).
A non-finite magnitude, or one above ``MOEREPLAY_ABSMAX``, triggers: read the metadata rows of the offending
sequence and the ``MOEREPLAY_FLIGHT_CALLS - 1`` checked sequences before it that no earlier trigger wrote (a
small copy on a side stream, waited for: it waits on nothing but itself),
copy their entries and then the ring's head to pinned memory on that stream, and once those landed write every
entry the head had not lapped (the rest count as ``flight_graph_lost``). These CUDA calls run only through the
graph gate, never while a graph is being captured. A sequence whose word was overwritten before it was read
(the writer fell ``tags`` graph layer calls behind) counts as ``flight_graph_unchecked``.

Records are the eager layer scope's (:class:`~moereplay.capture.flight_layer.LayerFlight`): parent records
without children, ready for ``moereplay expand``; their context adds ``cudagraph: true``, ``graph_launch``,
``graph_sequence`` (the device's sequence number), when the call had a layer number at capture, ``graph_step``
(replays of a first MoE layer's launch so far), and where the check reads the step's token count (below)
``graph_tokens`` (that count at this replay) and ``graph_batch`` (the padded batch's tokens, the output's rows):
the rows from ``graph_tokens`` on are padding, which :mod:`moereplay.replay` leaves unjudged. They have no host
time and no step of the host's forward count: a graph replay is not seen by the host.

Detection delay: about one writer poll (≈ 5 ms; ``MOEREPLAY_FLIGHT_GRAPH_POLL_MS`` sets it, 5–500 ms, while no
eager call waits for the writer) after the device finished the call, plus the copy-out (4–5 ms measured on the
H200, ``tests/gpu/test_flight_graph_gpu.py``). Polling every 50 ms instead of 5 left the served batch-32 cost where
it was (an H100, 2026-12-07: the polls are not what graph mode costs; the ring nodes' device time is).
The check skips padding rows where it can tell them: a graph replays a batch padded to its captured size, and its
padding rows hold whatever the buffers held. For an output with one row per token of the captured batch,
:mod:`moereplay.capture.padded_rows` finds the model runner's token count, which the kernel reads when the graph
replays; elsewhere (data-parallel all-gathers, draft models, outputs of another shape, no runner found) every row is
checked and the launch counts in ``flight_graph_rows_unknown``. The copy keeps every row.
What is not kept (counted ``flight_graph_not_kept``, one warning each reason): a call that may write its inputs
(its inputs would have to be copied before it: not supported under graphs), an output the kernel cannot reduce
(not a contiguous float16/bfloat16/float32), an entry larger than a quarter of ``MOEREPLAY_FLIGHT_GRAPH_BYTES``,
a device without the graph ring (no Triton; or its first capture did not begin through ``torch.cuda.CUDAGraph``,
or began while another thread was capturing: :class:`~moereplay.capture.graph_gate.GraphGate` prepares it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moereplay.capture import padded_rows
from moereplay.capture.device_ring import ALIGNMENT, DeviceRing, over_bits
from moereplay.capture.flight import FlightCounters, PollingRecorder, TriggerDelivery
from moereplay.capture.flight_layer import LayerCall, LayerFlight, collect_outputs
from moereplay.capture.graph_ring import (
    ALONE_BYTES,
    DEFAULT_LAUNCHES,
    DEFAULT_TAGS,
    META_COLUMNS,
    META_LAUNCH,
    META_SEQUENCE,
    META_START,
    META_STEP,
    META_TOKENS,
    STATE_HEAD,
    GraphRing,
    Spans,
    fallback_views,
    kernel_error,
    kernels_available,
)
from moereplay.capture.writer_thread import POLL_INTERVAL_S

logger = logging.getLogger("moereplay.capture")

SEQUENCE_BASE = 1 << 62
"""Writer message sequences of graph records (``SEQUENCE_BASE`` + the device's sequence): apart from the
recorder's own, which count calls seen by the host."""

CHUNK = 4096
"""Tag words read per step of a poll."""

STALL = 1024
"""A sequence still unfinished while this many later ones have finished is given up (counted unchecked)."""

HINT_SLACK = 8
"""Tag words a poll reads past the device's hint (the last reserved sequence + 1, stored before the entry's copies
and its tag word): a hint store still on its way when the word behind it has landed."""

GRAPH_POLL_S = POLL_INTERVAL_S
"""The default of ``MOEREPLAY_FLIGHT_GRAPH_POLL_MS``: how long the writer waits between two polls while CUDA graphs
hold ring launches and no eager call waits for it (an eager call it must look at wakes it) — the writer's own
interval, so no wait of its own (a longer one marks the writer idle: see ``LayerFlight.poll``)."""

FULL_READ_S = 0.1
"""How often a poll reads a whole :data:`CHUNK` whatever the hint says: launches replayed on two streams may store
their hints out of order, so a finished word past a stale hint is read within this. Between those reads a poll
that finds no new reservation returns at once, with no NumPy work: at decode most polls fall between two steps."""


@dataclass
class GraphCounters(FlightCounters):
    launches: int = 0  # layer calls captured into graphs with the ring kernels
    not_kept: int = 0  # layer calls captured into graphs without them (see the log for why)
    lone: int = 0  # of the launches, those whose ring nodes run as one program each (no handshake)
    # of the launches, those staged: only a copy on the graph's path, recorded by the graph's batch node at its end
    # (or, without batch recording, by a record node beside the path)
    staged: int = 0
    entry_bytes: int = 0  # bytes the launches' entries take in the ring, together (each replay copies them)
    # launches whose check covers every row of the graph's padded batch: the step's token count was not found
    rows_unknown: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f"flight_graph_{key}": value for key, value in self.__dict__.items()}


@dataclass(eq=False)
class GraphLaunch:
    """What the host remembers of one captured launch: the described call (``copies[i].start`` is the copy's
    offset in the entry), its ring and launch id."""

    launch: int
    ring: GraphRing
    call: LayerCall
    # the padded batch's tokens (the checked output's rows) when the check reads the count
    batch: int | None = None


@dataclass(eq=False)
class _Watch:
    """The writer thread's reading position on one ring."""

    ring: GraphRing
    launches: dict[int, GraphLaunch]
    keep: int  # the checked sequences a trigger may write (``MOEREPLAY_FLIGHT_CALLS``)
    # the last checked sequences, in segments: (sequences, bits of their magnitudes), ``held`` of them in all
    recent: deque[tuple[np.ndarray, np.ndarray]] = field(default_factory=deque)
    held: int = 0
    next: int = 0  # the next sequence to read
    written: int = -1  # the last sequence a trigger wrote (earlier ones are not written again)
    full_at: float = -math.inf  # when the last read of a whole chunk began (perf_counter seconds)


@dataclass(eq=False)
class _Entry:
    sequence: int
    magnitude: float
    launch: GraphLaunch
    start: int
    step: int
    tokens: int = -1  # the replay's real token count (the metadata row's), -1 unknown


@dataclass(eq=False)
class _CopyOut:
    watch: _Watch
    entries: list[_Entry]
    trigger: int
    event: Any
    hosts: list[torch.Tensor]
    head: torch.Tensor
    delivery: TriggerDelivery


class GraphFlight(PollingRecorder):
    """See the module docstring. ``layer``: the eager layer-scope recorder (its call description, messages and
    ``emit`` are reused); ``capacity``, ``tags``, ``launches``, ``stage_bytes`` (the largest entry staged: only a copy
    on the graph's path, ``MOEREPLAY_FLIGHT_GRAPH_STAGE``), ``batch`` (staged entries recorded by one node at the
    graph's end, ``MOEREPLAY_FLIGHT_GRAPH_BATCH``): of each device's graph ring (:class:`GraphRing`)."""

    def __init__(
        self,
        layer: LayerFlight,
        capacity: int,
        *,
        tags: int = DEFAULT_TAGS,
        launches: int = DEFAULT_LAUNCHES,
        stage_bytes: int = ALONE_BYTES,
        poll_s: float = GRAPH_POLL_S,
        batch: bool = False,
        compact: bool = False,
    ) -> None:
        self.layer = layer
        self.capacity = capacity
        self.batch = batch  # staged entries recorded by one node at the graph's end (GraphRing's ``batch``)
        self.compact = compact  # that node's one-loop kernel (GraphRing's ``compact``)
        # the writer's wait between polls while graphs hold ring launches (and no eager work)
        self.poll_s = poll_s
        self.stage_bytes = stage_bytes
        self.tags = tags
        self.launches = launches
        self.counters = GraphCounters()
        self._watches: dict[int, _Watch] = {}
        self._copy_outs: deque[_CopyOut] = deque()
        self._sides: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._prepare_lock = threading.Lock()
        self._warned: set[str] = set()
        # the magnitude bits above which a word triggers: the eager ring's lean limit, the host's _is_bad
        self._threshold = over_bits(layer.absmax)

    # --- before a capture (serving thread, outside the capture) -------------------------------------------------

    def prepare(self, device: torch.device) -> GraphRing | None:
        """Allocate ``device``'s graph ring (and compile its kernels) unless it exists: called before a graph
        capture begins, where allocations and compiles are still allowed. None (logged once) where the
        kernels are not available on a CUDA device."""
        key = device.index if device.type == "cuda" and device.index is not None else -1
        if device.type == "cuda" and device.index is None:
            key = torch.cuda.current_device()
            device = torch.device("cuda", key)
        with self._prepare_lock:
            watch = self._watches.get(key)
            if watch is not None:
                return watch.ring
            cuda = device.type == "cuda"
            if cuda and not kernels_available():
                self._warn("kernels", f"no Triton ring kernels: {kernel_error()}")
                return None
            ring = GraphRing(
                self.capacity,
                device,
                tags=self.tags,
                launches=self.launches,
                use_kernel=cuda,
                stage_bytes=self.stage_bytes,
                batch=self.batch,
                compact=self.compact,
            )
            self._watches[key] = _Watch(ring, {}, max(1, self.layer.max_calls))
            return ring

    def open_capture(self, index: int) -> tuple[GraphRing, int] | None:
        """A graph capture has begun on device ``index``'s current stream: its ring may stage lone launches (and
        those up to ``stage_bytes``, :meth:`GraphRing.open_capture`). Returns the token for :meth:`close_capture`."""
        watch = self._watches.get(index)
        if watch is None:
            return None
        handle = watch.ring.open_capture()
        return None if handle is None else (watch.ring, handle)

    @staticmethod
    def close_capture(token: object) -> None:
        """That capture is about to end: join its ring's side branch (:meth:`GraphRing.close_capture`)."""
        if isinstance(token, tuple):
            ring, handle = token
            ring.close_capture(handle)

    @staticmethod
    def release_capture(token: object) -> None:
        """That capture has ended: its side stream is free (:meth:`GraphRing.release_capture`)."""
        if isinstance(token, tuple):
            ring, handle = token
            ring.release_capture(handle)

    # --- during a capture (serving thread) -----------------------------------------------------------------------

    def capture(self, call: LayerCall, result: Any, error: BaseException | None) -> bool:
        """Capture ``call``'s ring kernels into the graph being captured (queued on the current stream); remember
        its description under a new launch id. Returns whether it is kept (else counted and warned once)."""
        if error is not None:
            return self.not_kept("a call raised during the capture", error)
        tensors = call.tensors
        assert tensors is not None
        outputs, check = collect_outputs(call, result)
        tensors.extend(outputs)
        if not tensors:
            return self.not_kept("a call without tensors to keep")
        key = tensors[0].get_device()
        watch = self._watches.get(key)
        if watch is None:
            return self.not_kept("no graph ring on this device (the capture did not begin in CUDAGraph)")
        if any(tensor.get_device() != key for tensor in tensors):
            return self.not_kept("tensors on several devices")
        ring = watch.ring
        cuda = ring.kernels is not None
        sources, leads, sizes, total, check_info = DeviceRing._measure(tensors, check, cuda)
        if check is not None and check_info is None:
            return self.not_kept(
                f"an output the kernel cannot check ({check.dtype}, contiguous or not)", key="check"
            )
        if total > ring.max_entry:
            return self.not_kept(
                f"an entry of {total} bytes, over the graph ring's {ring.max_entry} (a quarter of "
                "MOEREPLAY_FLIGHT_GRAPH_BYTES)",
                key="size",
            )
        launch = ring.new_launch()
        if launch is None:
            return self.not_kept(
                f"more than {ring.launches} launch ids (captured layer calls and batch nodes) on one device"
            )
        offsets: list[int] = []
        at = 0
        for size in sizes:
            offsets.append(at)
            at += (size + ALIGNMENT - 1) & ~(ALIGNMENT - 1)
        real = self._real_rows(check) if call.target.role == "parent" else None  # a kernel call's rows: no
        limit = (real[0].data_ptr(), real[1]) if real is not None else None
        unknown = check is not None and real is None
        spans = Spans(tuple(sources), tuple(offsets), tuple(sizes), check_info, total, limit)
        views = None if cuda else fallback_views(tensors, leads, sizes)
        programs = ring.capture(
            launch,
            spans,
            first=call.where.layer == 0,
            views=views,
            check=None if cuda else check,
            rows=None if cuda or real is None else real[0],
        )
        self.counters.rows_unknown += int(unknown)
        call.output_copy = (offsets, leads, sizes)
        self.layer._describe(call)  # trees and tensor metadata now; the tensors are let go
        with self._lock:
            watch.launches[launch] = GraphLaunch(
                launch, ring, call, None if real is None or check is None else int(check.shape[0])
            )
        self.counters.launches += 1
        self.layer.wake_if_idle()  # its replays are found by polls only: every poll_interval from now
        self.counters.lone += int(programs == 1)
        self.counters.staged += int(launch in ring.staged)
        self.counters.entry_bytes += total
        return True

    def _real_rows(self, check: torch.Tensor | None) -> tuple[torch.Tensor, int] | None:
        """The model runner's token count for the check's device (:mod:`moereplay.capture.padded_rows`) and the
        elements of one row of the checked output, so the check skips a replay's padding rows; None when the
        count does not say which rows of this output are real, or is not found."""
        if check is None:
            return None
        per_row = padded_rows.limits_rows(check, padded_rows.batch_tokens())
        if per_row is None:
            return None
        rows = padded_rows.token_count(check.device)
        return None if rows is None else (rows, per_row)

    def not_kept(self, reason: str, error: BaseException | None = None, *, key: str | None = None) -> bool:
        """Count a call captured into a graph that is not kept; the first of each kind (``key``, else the
        ``reason``) is logged."""
        self.counters.not_kept += 1
        self._warn(key or reason, reason if error is None else f"{reason}: {type(error).__name__}: {error}")
        return False

    def _warn(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "moereplay: flight recorder: a layer call captured into a CUDA graph is not kept (%s); its replays "
            "are not checked (flight_graph_not_kept counts them; --enforce-eager records every call)",
            text,
        )

    # --- writer thread -------------------------------------------------------------------------------------------

    def poll(self, *, launch: bool = False, full: bool = False) -> None:
        """Read the finished sequences' tag words; trigger on a bad one; write finished copy-outs. CUDA calls
        (a trigger's copies) only with ``launch`` (the writer thread, inside the graph gate). ``full``: read a
        whole chunk whatever the hint says (a settling poll: the last words before the file closes)."""
        if not launch:
            return
        with self._lock:
            self._finish_copy_outs()
            now = time.perf_counter()
            for watch in list(self._watches.values()):
                self._read(watch, now, full)

    @property
    def copying(self) -> bool:
        """A trigger's copy-out is on its way (the next poll writes it)."""
        return bool(self._copy_outs)

    @property
    def settled(self) -> bool:
        """Nothing being copied out, and every sequence the device reserved has been read."""
        return not self._copy_outs and all(watch.next >= watch.ring.hint for watch in self._watches.values())

    def as_counters(self) -> dict[str, int]:
        return self.counters.as_dict()

    def _read(self, watch: _Watch, now: float, full: bool = False) -> None:
        """Read tag words from ``watch.next`` on, in sequence order, up to the first not finished (lock held).

        Only as far as the device's hint says it has reserved (a few words past it, for a hint store still on its
        way), and not at all while the hint shows nothing new — except every :data:`FULL_READ_S` and with
        ``full``, when a whole :data:`CHUNK` is read whatever the hint says (a hint stored out of order by
        launches on two streams).
        The words are read in contiguous runs (a copy of a slice: the device may store into them meanwhile),
        whose sequences share one generation; their checks compare the magnitude's bits (never negative: their
        order is the floats' order, NaN above Inf) with the trigger's threshold's."""
        ring = watch.ring
        tags = ring.tags
        hint = ring.hint
        full = full or now - watch.full_at >= FULL_READ_S
        if hint <= watch.next and not full:
            return
        if full:
            watch.full_at = now
        threshold = self._threshold
        while True:
            first = watch.next
            low = first % tags
            wanted = CHUNK if full else hint - first + HINT_SLACK
            count = min(wanted, CHUNK, tags - low)  # up to the array's end: one generation
            found = ring.words[low : low + count].copy()
            generation = (first // tags + 1) & 0x7FFFFFFF
            ahead = ((found >> 32) - generation) % (1 << 31)
            ok = ahead == 0
            if ok.all():
                stop = count
                checked: np.ndarray | None = None
                lost = 0
            else:
                gone = (ahead > 0) & (ahead < (1 << 30))
                waiting = ~(ok | gone)
                stop = int(np.argmax(waiting)) if waiting.any() else count
                # finished words after the run, past the array's end (the next generation, from slot 0): a
                # sequence stuck near the end is given up as one anywhere else is, seeing a whole chunk ahead
                later = None
                if stop < count and low + count == tags and count < CHUNK:
                    after = ring.words[: min(CHUNK - count, low)].copy()
                    later = ((after >> 32) - ((generation + 1) & 0x7FFFFFFF)) % (1 << 31) == 0
                while stop < count and _finished_after(ok, later, stop + STALL):  # stalled: later calls
                    gone[stop] = True  # finished long since
                    waiting[stop] = False
                    stop = int(np.argmax(waiting)) if waiting.any() else count
                if stop == 0:
                    return
                checked = ok[:stop]
                lost = int(gone[:stop].sum())
            bits = found[:stop] & 0xFFFFFFFF
            bad = bits > threshold
            if checked is not None:
                bad &= checked
            self.counters.checked += stop - lost if checked is None else int(checked.sum())
            self.counters.unchecked += lost
            pushed = 0
            if bad.any():
                for index in np.flatnonzero(bad).tolist():
                    self._remember(watch, first, bits, checked, pushed, index + 1)
                    pushed = index + 1
                    if first + index > watch.written:
                        self._trigger(watch, first + index)
            self._remember(watch, first, bits, checked, pushed, stop)
            watch.next = first + stop
            if stop < count or (not full and watch.next >= hint):
                return

    @staticmethod
    def _remember(
        watch: _Watch, first: int, bits: np.ndarray, checked: np.ndarray | None, low: int, high: int
    ) -> None:
        """Keep the magnitudes (bits) of the checked sequences ``first + [low, high)`` among the recent ones; only
        segments that hold some of the last ``max_calls`` stay."""
        if high <= low:
            return
        sequences = np.arange(first + low, first + high, dtype=np.int64)
        kept = bits[low:high]
        if checked is not None:
            mask = checked[low:high]
            sequences, kept = sequences[mask], kept[mask]
            if not len(sequences):
                return
        watch.recent.append((sequences, kept))
        watch.held += len(sequences)
        while watch.held - len(watch.recent[0][0]) >= watch.keep:
            watch.held -= len(watch.recent.popleft()[0])

    @staticmethod
    def _window(watch: _Watch, sequence: int) -> list[tuple[int, float]]:
        """The last ``max_calls`` checked sequences after the last written one, up to ``sequence``, with their
        magnitudes."""
        window: list[tuple[int, float]] = []
        for sequences, bits in reversed(watch.recent):
            values = bits.astype(np.uint32).view(np.float32)
            for index in range(len(sequences) - 1, -1, -1):
                wanted = int(sequences[index])
                if wanted > sequence:
                    continue
                if wanted <= watch.written or len(window) == watch.keep:
                    window.reverse()
                    return window
                window.append((wanted, float(values[index])))
        window.reverse()
        return window

    def _side(self, ring: GraphRing) -> Any:
        side = self._sides.get(ring.index)
        if side is None:
            side = self._sides[ring.index] = torch.cuda.Stream(ring.index)
        return side

    def _trigger(self, watch: _Watch, sequence: int) -> None:
        """Write ``sequence`` and the checked sequences before it that no trigger wrote, ``max_calls`` at most."""
        ring = watch.ring
        self.counters.triggers += 1
        window = self._window(watch, sequence)
        watch.written = sequence
        if not self.layer.budget.take(f"graph sequence {sequence}"):
            return
        cuda = ring.device.type == "cuda"
        side = self._side(ring) if cuda else None
        rows = self._meta(ring, [s for s, _ in window], side)
        entries: list[_Entry] = []
        for (wanted, magnitude), row in zip(window, rows, strict=True):
            launch = watch.launches.get(int(row[META_LAUNCH]))
            if int(row[META_SEQUENCE]) != wanted or launch is None:
                self.counters.lost += 1  # its metadata row was reused: `tags` graph calls ago
                continue
            entries.append(
                _Entry(
                    wanted,
                    magnitude,
                    launch,
                    int(row[META_START]),
                    int(row[META_STEP]),
                    int(row[META_TOKENS]),
                )
            )
        trigger = entries[-1] if entries and entries[-1].sequence == sequence else None
        name = f"graph sequence {sequence}"
        if trigger is not None:
            name = f"{trigger.launch.call.target.op} {name} (launch {trigger.launch.launch})"
        logger.error(
            "moereplay: flight recorder triggered by %s (largest |output| = %s): writing %d graph layer call(s)",
            name,
            window[-1][1] if window else math.nan,
            len(entries),
        )
        hosts: list[torch.Tensor] = []
        head = torch.zeros(1, dtype=torch.int64, pin_memory=cuda)
        event = None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for entry in entries:
                copies = entry.launch.call.copies or []
                host = torch.empty(sum(copy.size for copy in copies), dtype=torch.uint8, pin_memory=cuda)
                at = 0
                for copy in copies:
                    host.narrow(0, at, copy.size).copy_(
                        ring.view(entry.start, copy.start, copy.size), non_blocking=cuda
                    )
                    at += copy.size
                hosts.append(host)
            # the head after the entries: an entry it had not lapped then was intact while it was copied
            head.copy_(ring.state.narrow(0, STATE_HEAD, 1), non_blocking=cuda)
            if side is not None:
                event = torch.cuda.Event()
                event.record(side)
        delivery = TriggerDelivery(self.counters, name, len(entries))
        self._copy_outs.append(_CopyOut(watch, entries, sequence, event, hosts, head, delivery))
        self._finish_copy_outs()

    @staticmethod
    def _meta(ring: GraphRing, sequences: list[int], side: Any) -> list[np.ndarray]:
        """The metadata rows of ``sequences``: on CUDA one small copy on the side stream, waited for (it waits for
        nothing on the serving streams)."""
        if not sequences:
            return []
        index = torch.tensor([s % ring.tags for s in sequences], dtype=torch.int64)
        if side is None:
            return list(ring.meta.index_select(0, index).numpy())
        host = torch.empty(len(sequences), META_COLUMNS, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(ring.meta.index_select(0, index.to(ring.device, non_blocking=True)), non_blocking=True)
        side.synchronize()
        return list(host.numpy())

    def _finish_copy_outs(self) -> None:
        while self._copy_outs:
            out = self._copy_outs[0]
            if out.event is not None and not out.event.query():
                return
            self._copy_outs.popleft()
            head = int(out.head[0])
            for entry, host in zip(out.entries, out.hosts, strict=True):
                if not out.watch.ring.intact(entry.start, head):
                    self.counters.lost += 1
                    logger.error(
                        "moereplay: flight recorder: graph sequence %d was overwritten in the graph ring before it "
                        "could be written (raise MOEREPLAY_FLIGHT_GRAPH_BYTES)",
                        entry.sequence,
                    )
                    out.delivery.not_handed_over("overwritten in the graph ring (flight_graph_lost)")
                    continue
                begin, complete = self.layer._messages(
                    self._record(entry), host, entry.sequence == out.trigger
                )
                if complete is not None:
                    complete.timings = {}  # a graph replay runs no host code: no host time to report
                if not self.layer.emit(begin, complete, out.delivery.delivered):
                    out.delivery.not_handed_over("MOEREPLAY_MAX_CALLS reached")

    @staticmethod
    def _record(entry: _Entry) -> LayerCall:
        """A call to write for ``entry``: its launch's description, with this replay's context."""
        template = entry.launch.call
        call = LayerCall(template.target, template.where, SEQUENCE_BASE + entry.sequence, {}, {}, [])
        call.copies = template.copies
        call.input_tree = template.input_tree
        call.output_tree = template.output_tree
        call.outputs = template.outputs
        call.extra_outputs = template.extra_outputs
        context = dict(template.extra_context or {})
        context.update(cudagraph=True, graph_launch=entry.launch.launch, graph_sequence=entry.sequence)
        if template.where.layer is not None:
            context["graph_step"] = entry.step
        batch = entry.launch.batch
        if batch is not None and 0 < entry.tokens <= batch:
            # the rows past the step's tokens are padding (vLLM discards them): a replay judges the real ones
            context.update(graph_tokens=entry.tokens, graph_batch=batch)
        call.extra_context = context
        call.value = entry.magnitude
        call.ended = time.perf_counter()
        return call


def _finished_after(ok: np.ndarray, later: np.ndarray | None, position: int) -> bool:
    """Whether a word at ``position`` or after is finished: in the run read (``ok``), or past it in the words read
    after the array's end (``later``, which continue the run)."""
    if ok[position:].any():
        return True
    return later is not None and bool(later[max(0, position - len(ok)) :].any())
