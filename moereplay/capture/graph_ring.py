"""The device side of graph-replayed layer calls: a circular device buffer whose position lives on the device.

A layer call captured into a CUDA graph runs again on every replay with no Python, so nothing on the host can
hand it a ring position, a sequence number or a tag generation. Here all three are device state, advanced by the
kernel (:mod:`moereplay.capture.graph_ring_kernel`) captured right after the call:

- ``state`` (device, int64): ``head`` (absolute bytes ever reserved), ``sequence`` (graph layer calls ever run on
  this device) and ``step`` (graph replays of a first MoE layer's call);
- per captured launch (a *launch id*, given at capture): the start and sequence of its current entry, its running
  largest magnitude and its count of finished programs;
- ``meta`` (device, ``tags`` rows): per ``sequence % tags`` the row ``(sequence, start, launch, step, tokens)``
  (``tokens``: the replay's real token count where the launch knows where to read it, ``Spans.rows``; else -1);
- ``words`` (pinned host memory mapped into the device's address space): per ``sequence % tags`` the tag word
  ``generation << 32 | bits(max |output|)`` (generation ``sequence // tags + 1``, the eager ring's encoding,
  :func:`~moereplay.capture.device_ring.decode_word`), stored by the kernel's last program, and one *hint*
  word: the last sequence reserved + 1. The writer thread reads them with plain memory reads (a NumPy view): no
  CUDA call, so also while another thread captures a graph.

Positions: every entry starts on a 256-byte boundary at ``head % capacity`` and may run past ``capacity`` into a
tail of ``max_entry`` bytes (the buffer is ``capacity + max_entry`` long) instead of wrapping, so one
``atomic_add`` reserves it; an entry ``[start, start + size)`` is intact while ``head <= start + capacity`` (the
eager ring's rule, which the tail keeps true: checked after copying it out). All device memory is allocated by
:class:`GraphRing` itself, before any capture begins (``GraphGate``'s prepare hook), never from a graph's
private pool, and it is never freed: a graph captured with its addresses may be replayed for as long as the
process lives (:data:`_KEEP` holds every ring).

Staging (lone entries, and entries up to ``stage_bytes`` — ``MOEREPLAY_FLIGHT_GRAPH_STAGE`` — in a graph the graph
gate opened: :meth:`GraphRing.open_capture` / :meth:`GraphRing.close_capture`): a node on the graph's own path costs
its whole latency at every replay — at decode, ≈ 8 µs of the ≈ 109 µs a gpt-oss layer takes on the H200. So a
staged launch puts on the graph's path only the STAGE variant of the kernel, which copies the spans into the
launch's slot of ``stage`` (no atomic, no fence), and its record node — the reservation, the copy from the slot
into the ring, the check and the tag word — goes on a side stream forked right after that copy: it runs beside the
layers that follow, and the capture's end joins it (a graph does not finish before it).
A staged entry that is not lone has a record node of many programs (the handshake, off the path).
Slots: a capture's staged launches take consecutive slots from the area's start, and every graph reuses the area
from its start: a graph's replay, its side branch included, ends before the next graph replayed on the same stream
begins, so no two replays use a slot at once. The area a graph needs is its own staged entries (a full gpt-oss
decode graph at batch 32: 24 × 370 KB), not the sum over every graph vLLM captures; a recaptured graph takes no
new room. When a graph's staged entries fill the area, its later launches take the one-node path.
Batch (``batch``, ``MOEREPLAY_FLIGHT_GRAPH_BATCH``, the recorder's default since 2026-12-07 with a 384K stage
limit; the ring's own default is off): a staged launch gets no record node of its own; the graph's
staged entries are recorded by one node of :func:`~moereplay.capture.graph_ring_kernel.graph_record_batch` on the
capturing stream — queued when the capture ends, when :data:`BATCH` have gathered, before a launch that is not
staged (it reserves after them), or before an entry that cannot share the node (another real-row count or
checked dtype, or a launch that bumps the step). It reserves once for all of them, with consecutive sequences, and
puts each entry where a reservation of its own would have (``start % capacity``, into the tail past
``capacity``), so the writer and a trigger's copy-out read them as any other; one handshake among its programs
instead of one per layer call. Measured under L2 thrash at 32 tokens a layer call: 7.75 µs a layer call against
11.2 for the one-node path (``tools/bench/graph_ring_bench.py --thrash 64``, H100). Its node needs a launch id
for its own cells (without one, each entry gets its record node). ``compact`` (``MOEREPLAY_FLIGHT_GRAPH_COMPACT``)
runs that node as :func:`~moereplay.capture.graph_ring_kernel.graph_record_batch_compact`: the same arguments and
results from a kernel one loop long (the recorder's default; this class's is the unrolled kernel, for the benches
that compare the two): 3.22 µs a layer call against 5.94 at one token, 5.04 against 7.68 at 32 (same bench, H100,
2026-12-07). A batched capture still takes a side stream in
:meth:`open_capture` and leaves it unused.
Known limits: graphs replayed at the same time on different streams would share slots (vLLM replays its graphs
one after another on its one stream: piecewise and full graphs, breakable graphs' segments, and dual batch
overlap's one graph holding both micro-batches, whose threads launch on the capture stream); a one-node launch
joins the side branch of its own stream only, so a layer call captured on another stream of the same graph could
reserve before earlier staged ones (its sequence and step then count from there; vLLM captures its MoE layers on
one stream).

Without Triton (CPU, tests) the same contract is kept by :meth:`GraphRing.replay`, which does what the
kernels do with torch operations on the same state tensors; there is no capture to put it in, so a test replays
a "graph" by re-running the call and then ``replay`` of each launch id it captured.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from moereplay.capture.device_ring import ALIGNMENT, _raw_at
from moereplay.capture.device_ring import host_words as _host_words

STATE_HEAD, STATE_SEQUENCE, STATE_STEP = 0, 1, 2
META_SEQUENCE, META_START, META_LAUNCH, META_STEP, META_TOKENS = 0, 1, 2, 3, 4
META_COLUMNS = 5
DEFAULT_TAGS = 1 << 14
"""Tag words and metadata rows: a sequence's word and row are reused ``tags`` graph layer calls later."""
DEFAULT_LAUNCHES = 1 << 14
"""Launch ids a ring hands out: one per captured layer call, and with batch recording one more per batch node (its
own cells). vLLM captures ~67 batch sizes × the MoE layers, in full graphs and in piecewise ones that hold a layer
each: ~1,600 layer calls for gpt-oss, about as many batch nodes more."""

ALONE_BYTES = 32 << 10
ALONE_ELEMENTS = 8192
"""A node moving at most this many bytes and checking at most this many output elements runs as one program: the
arrive/ready/done handshake that lets several programs share an entry is a chain of dependent atomics, which costs
more than one SM copying 32 KiB (``tools/bench/graph_ring_bench.py`` measures both: ``ring-12`` vs
``ring-12-shared``). A gpt-oss decode layer call at batch 1 (two 5.6 KB activations, routing metadata, 2,880 output
elements) fits."""

STAGE_SHARE = 16
"""The staging area of a ring (entries staged off the graph's critical path, see :meth:`GraphRing.capture`) is
``capacity // STAGE_SHARE`` bytes, reused by every graph; a graph's launches past it take the one-node path."""


def staging_area(capacity: int) -> int:
    """The staging area's bytes in a ring of ``capacity`` bytes (:data:`STAGE_SHARE`): the most one graph's staged
    entries may take."""
    return max(ALIGNMENT, (capacity - capacity % ALIGNMENT) // STAGE_SHARE // ALIGNMENT * ALIGNMENT)


SIDE_STREAMS = 4
"""Graphs one ring can stage for while they are being captured at once (one side stream each)."""

_BLOCK_BYTES = 8 * 1024  # graph_ring_kernel.BLOCK words of 8 bytes
_STAGE_BLOCK_BYTES = 8 * 128  # graph_ring_kernel.STAGE_BLOCK words of 8 bytes
_CODE_BYTES = {1: 2, 2: 2, 3: 4}  # the check's dtype code: bytes an element
_FOLD = 8192  # graph_ring_kernel.FOLD output elements a program folds per step
SPANS = 24
"""Spans one kernel node copies (graph_ring_kernel.SPANS, checked when the kernel is imported)."""
STAGE_WAVES = 1
"""A staging copy runs up to this many times a record node's programs (two an SM), each one :data:`_STAGE_BLOCK_BYTES`
step: with 1, a gpt-oss decode entry of 32 tokens (≈ 370 KB, 361 steps) takes two waves of loads."""

_BATCH_SLOTS = 24  # graph_ring_kernel.BATCH: the batch kernel's entry arguments (checked when it is imported)
BATCH = _BATCH_SLOTS
"""Staged entries one batch node records (at most the kernel's entry arguments)."""
_KEEP: list[GraphRing] = []
_KEEP_LOCK = threading.Lock()


@dataclass(frozen=True)
class Spans:
    """What one captured launch copies: per span its source address, its offset in the entry and its size; the
    checked output as ``(address, numel, dtype code)`` or None; the entry's ring bytes; ``rows``: where the check
    learns at replay how many rows are real, as ``(address of an int32 token count, elements a row)``, or None
    (every row is checked)."""

    sources: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    check: tuple[int, int, int] | None
    total: int
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not len(self.sources) == len(self.offsets) == len(self.sizes):
            raise ValueError("one offset and one size per source")
        if self.total % ALIGNMENT or any(offset % ALIGNMENT for offset in self.offsets):
            raise ValueError("entries and spans start on 256-byte boundaries")


@dataclass(eq=False)
class _Open:
    """A graph being captured on ``stream`` (a torch CUDA stream): its staged launches' record nodes go on
    ``side``; ``pending`` while some are not joined back yet."""

    stream: Any
    side: Any
    pending: bool = False
    closing: bool = False  # the capture is ending: nothing more is staged in it
    used: int = 0  # staging bytes its launches took, from the area's start
    batch: list[_Batched] = field(default_factory=list)  # staged entries not recorded yet (a ring with batch)


@dataclass(frozen=True)
class _Batched:
    """A staged entry left to the graph's batch node: its launch, slot address and bytes, check (address in the
    slot, elements, dtype code) or None, whether it bumps the step, and where its real row count is read."""

    launch: int
    slot: int
    total: int
    check: tuple[int, int, int] | None
    first: bool
    rows: tuple[int, int] | None


@dataclass(eq=False)
class _Fallback:
    """A captured launch without the kernels: the spans' bytes as views (read again on every replay)."""

    spans: Spans
    views: list[torch.Tensor]
    check: torch.Tensor | None
    first: int
    rows: torch.Tensor | None = None  # the step's token count, read at every replay (``Spans.rows``)


class GraphRing:
    """See the module docstring. ``capacity``: ring bytes; ``tags``: tag words and metadata rows; ``launches``:
    launch ids. ``use_kernel`` None: the Triton kernels on CUDA (compiled here, before any capture)."""

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        *,
        tags: int = DEFAULT_TAGS,
        launches: int = DEFAULT_LAUNCHES,
        use_kernel: bool | None = None,
        stage_bytes: int = ALONE_BYTES,
        batch: bool = False,
        compact: bool = False,
    ) -> None:
        capacity -= capacity % ALIGNMENT
        if capacity < 4 * ALIGNMENT:
            raise ValueError("a graph ring needs at least 1 KiB")
        cuda = device.type == "cuda"
        self.device = device
        self.index = (
            (device.index if device.index is not None else torch.cuda.current_device()) if cuda else -1
        )
        self.capacity = capacity
        self.max_entry = max(ALIGNMENT, capacity // 4 - (capacity // 4) % ALIGNMENT)
        self.tags = tags
        self.launches = launches
        self._issued = 0  # launch ids handed out
        self._lock = threading.Lock()
        if use_kernel is None:
            use_kernel = cuda and kernels_available()
        if use_kernel and not cuda:
            raise ValueError("the graph ring kernels run on CUDA devices only")
        guard = torch.cuda.device(self.index) if cuda else _NoDevice()
        with guard:
            self.buffer = torch.empty(capacity + self.max_entry, dtype=torch.uint8, device=device)
            self.state = torch.zeros(4, dtype=torch.int64, device=device)
            self.meta = torch.full((tags, META_COLUMNS), -1, dtype=torch.int64, device=device)
            # per launch id (graph_ring_kernel.CELL_*): entry start, entry sequence, running largest magnitude,
            # programs done, programs arrived, reservation published
            self.cells = torch.zeros(6, launches, dtype=torch.int64, device=device)
            host, self._host_address = _host_words(tags + 1, cuda)
            self.kernels = _compile(self.index) if use_kernel else None
            self.stage_kernel = _compile(self.index, stage=True) if use_kernel else None
            self.batch_kernel = (
                _compile(self.index, batch=True, compact=compact) if use_kernel and batch else None
            )
            area = staging_area(capacity)
            self.stage = torch.empty(area, dtype=torch.uint8, device=device) if use_kernel else None
            self._sides = [torch.cuda.Stream(device) for _ in range(SIDE_STREAMS)] if use_kernel else []
            if use_kernel:
                _programs(self.index)  # device properties read now, not while a graph is being captured
        self.stage_bytes = stage_bytes  # entries up to this size may be staged (lone ones always may)
        self.stage_waves = STAGE_WAVES
        self._open: dict[int, _Open] = {}
        self.staged: set[int] = set()  # launch ids whose record node is off the critical path
        self.host = host  # NumPy int64 view: tags words, then the hint
        self.words = host[:tags]
        self._fallbacks: dict[int, _Fallback] = {}
        with _KEEP_LOCK:
            _KEEP.append(self)  # graphs hold these addresses for the life of the process

    # --- capture (serving thread) -----------------------------------------------------------------------------

    def new_launch(self) -> int | None:
        """A new launch id, or None when all are taken."""
        with self._lock:
            if self._issued >= self.launches:
                return None
            launch = self._issued
            self._issued += 1
            return launch

    def open_capture(self) -> int | None:
        """A graph capture begins on the current stream (``GraphGate``, right after ``capture_begin``): from now on
        its lone launches (and those up to ``stage_bytes``) may be staged (see :meth:`capture`). Returns the
        stream's handle for :meth:`close_capture` and :meth:`release_capture`, or None (no kernels, or every side
        stream taken: the one-node path)."""
        if self.stage_kernel is None:
            return None
        stream = torch.cuda.current_stream(self.index)
        handle = int(stream.cuda_stream)
        with self._lock:
            # a capture left open (its end never reported) on this stream is over
            self._open.pop(handle, None)
            # a side stream is never a capturing stream: torch hands out its streams from a small pool, round
            # robin, so one of ours may be the very stream a capture runs on (vLLM's, or another open one's)
            taken = {opened.side.cuda_stream for opened in self._open.values()} | set(self._open) | {handle}
            side = next((side for side in self._sides if side.cuda_stream not in taken), None)
            if side is None:
                return None
            self._open[handle] = _Open(stream, side)
        return handle

    def close_capture(self, handle: int | None) -> None:
        """The graph captured on ``handle`` is about to end (right before ``capture_end``): nothing more is staged
        in it and its side branch is joined back — a capture must not end with a forked stream. The side stream
        stays taken until :meth:`release_capture` (CUDA counts it in the capture until the capture has ended)."""
        if handle is None:
            return
        with self._lock:
            opened = self._open.get(handle)
            if opened is None or opened.closing:
                return
            opened.closing = True
        if opened.batch:
            self._flush(opened)
        if opened.pending:
            self._join(opened)

    def release_capture(self, handle: int | None) -> None:
        """The capture on ``handle`` has ended (after ``capture_end``): its side stream may serve another."""
        if handle is None:
            return
        with self._lock:
            opened = self._open.get(handle)
            if opened is not None and opened.closing:
                del self._open[handle]

    def capture(
        self,
        launch: int,
        spans: Spans,
        *,
        first: bool,
        views: list[torch.Tensor] | None = None,
        check: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> int:
        """Queue the record kernel node(s) of ``launch`` on the current stream — while it captures a graph,
        into the graph. ``first``: the launch bumps the graph step. Without the kernels, ``views`` (the spans'
        bytes), ``check`` (the output to reduce) and ``rows`` (the token count ``spans.rows`` points at) are kept
        for :meth:`replay`. Returns the most programs a record node of the launch runs (1: every record node
        alone, without the handshake; 0 without the kernels, or when the graph's batch node records it); a staged
        launch's staging copy, which needs no handshake, may run more.

        Staged (a lone entry or one of at most ``stage_bytes``, in a graph opened with :meth:`open_capture`, while
        the graph's staged entries fit the staging area): on the graph's path only a copy of the spans into this
        launch's staging slot (no atomics, no fence);
        the record node — reservation, copy into the ring, check, tag word — reads that slot on a side stream
        forked there and joined when the capture ends, so it runs beside the layers that follow. The slot is
        rewritten by the next graph replayed on the stream, which starts after this one's side branch ended."""
        if spans.total > self.max_entry:
            raise ValueError(f"an entry of {spans.total} bytes exceeds the graph ring's {self.max_entry}")
        if self.kernels is not None and any(source & 7 for source in spans.sources):
            # the kernel moves whole 8-byte words: a misaligned source would fault inside a served graph
            raise ValueError("the graph ring kernel needs 8-byte aligned span sources")
        if self.kernels is None:
            if views is None or len(views) != len(spans.sources):
                raise ValueError("without the kernels a capture needs a view per span")
            self._fallbacks[launch] = _Fallback(spans, views, check, int(first), rows)
            return 0
        stream = _current_stream(self.index)
        common = self._common(launch)
        with self._lock:
            opened = self._open.get(stream)
        if opened is not None and opened.closing:
            opened = None
        staged = self._stage(spans, opened) if opened is not None else None
        if opened is not None and staged is None:
            # a one-node launch reserves after the staged ones before it
            if opened.batch:
                self._flush(opened)
            if opened.pending:
                self._join(opened)
        if opened is None or staged is None:
            return self._nodes(spans, first, stream, common)
        address, slot = staged
        assert self.stage_kernel is not None
        stage_common = list(common)
        stage_common[3] = address  # ``buffer``: the STAGE variant copies to it as is
        self._nodes(spans, first, stream, stage_common, launcher=self.stage_kernel, record=False)
        if self.batch_kernel is not None:
            entry = _Batched(launch, address, slot.total, slot.check, first, slot.rows)
            with self._lock:
                batch = list(opened.batch)
            if batch and not _batchable(batch, entry):
                self._flush(opened)
            with self._lock:
                opened.batch.append(entry)
                full = len(opened.batch) >= BATCH
            self.staged.add(launch)
            if full:
                self._flush(opened)
            return 0  # recorded by the graph's batch node
        opened.pending = True  # before the fork: whatever happens after it, the capture's end joins the side
        self._fork(opened)
        programs = self._nodes(slot, first, int(opened.side.cuda_stream), common)
        self.staged.add(launch)
        return programs

    def _nodes(
        self,
        spans: Spans,
        first: bool,
        stream: int,
        common: list[int],
        *,
        launcher: Any = None,
        record: bool = True,
    ) -> int:
        """Launch the nodes copying ``spans`` on ``stream`` (:data:`SPANS` a node); ``record`` False: copies
        only, as many programs as the words need (the STAGE variant: no handshake). Returns the most programs."""
        launch_kernel = self.kernels if launcher is None else launcher
        assert launch_kernel is not None
        count = len(spans.sources)
        most = 0
        for first_span in range(0, max(count, 1), SPANS):
            chunk = range(first_span, min(first_span + SPANS, count))
            last = first_span + SPANS >= count
            args: list[int] = []
            moved = 0
            for i in chunk:
                # whole words: sources and offsets start on 256-byte boundaries, so a span's last word stays in
                # its last byte's page, and the entry's 256-byte slot has room for it (a size that breaks words —
                # 33 int32 token offsets — must not make the node copy byte by byte)
                words = (spans.sizes[i] + 7) & ~7
                args += (spans.sources[i], spans.offsets[i], words)
                moved += words
            args += (0, 0, 0) * (SPANS - len(chunk))
            address, numel, code = spans.check if last and record and spans.check is not None else (0, 0, 0)
            finish, reserve = (int(last), int(first_span == 0)) if record else (0, 0)
            args += (address, numel, code, moved, finish, reserve, spans.total, int(first))
            work = max(-(-moved // (_BLOCK_BYTES if record else _STAGE_BLOCK_BYTES)), -(-numel // _FOLD))
            if record and moved <= ALONE_BYTES and numel <= ALONE_ELEMENTS:
                work = 1  # one program: no handshake among programs (see graph_ring_kernel)
            programs = max(1, min(_programs(self.index) if record else self.stage_programs(), work))
            # every record node reads the count (the reserving one stores it in the metadata row), the last one
            # also limits its check to the real rows
            limit = spans.rows if record and spans.rows is not None else (0, 0)
            launch_kernel(programs, stream, args + common + list(limit))
            most = max(most, programs)
        return most

    def stage_programs(self) -> int:
        """The most programs a staging copy runs: :attr:`stage_waves` × the programs of a record node."""
        return _programs(self.index) * self.stage_waves

    def _stage(self, spans: Spans, opened: _Open) -> tuple[int, Spans] | None:
        """The next staging slot of the graph ``opened`` for a lone entry, or one of at most ``stage_bytes``: its
        address and the record node's spans (the whole slot as one span, the check moved into it), or None (too
        large, the check outside the spans, or the graph's staged entries fill the area)."""
        numel = spans.check[1] if spans.check is not None else 0
        lone = spans.total <= ALONE_BYTES and numel <= ALONE_ELEMENTS
        # a limit at the lone size (this class's default) stages lone entries only, also one of few bytes but many
        # elements
        larger = self.stage_bytes > ALONE_BYTES and spans.total <= self.stage_bytes
        if self.stage is None or not (lone or larger):
            return None
        check = None
        if spans.check is not None:
            address, numel, code = spans.check
            end = address + numel * _CODE_BYTES.get(code, 0)
            inside = [
                i
                for i, (source, size) in enumerate(zip(spans.sources, spans.sizes, strict=True))
                if source <= address and end <= source + size
            ]
            if not inside or code not in _CODE_BYTES:
                return None
            check = (inside[0], address - spans.sources[inside[0]], numel, code)
        with self._lock:
            if opened.used + spans.total > self.stage.numel():
                return None
            slot = self.stage.data_ptr() + opened.used
            opened.used += spans.total
        moved = None
        if check is not None:
            span, lead, numel, code = check
            moved = (slot + spans.offsets[span] + lead, numel, code)
        return slot, Spans((slot,), (0,), (spans.total,), moved, spans.total, spans.rows)

    def _flush(self, opened: _Open) -> None:
        """Queue the batch node recording ``opened``'s staged entries not recorded yet, on its capturing stream:
        one reservation for all of them (their sequences consecutive, each entry where a reservation of its own
        would have put it), their copies from the staging area into the ring, their checks and tag words. Without
        a launch id left for the node's own cells, each entry gets its record node instead."""
        with self._lock:
            entries, opened.batch = opened.batch, []
        if not entries:
            return
        stream = int(opened.stream.cuda_stream)
        # the kernel reads entry i's bytes as the span up to entry i + 1's slot: consecutive slots only (a staged
        # launch takes the next slot of its capture; anything else gets a record node per entry)
        consecutive = all(a.slot + a.total == b.slot for a, b in itertools.pairwise(entries))
        own = self.new_launch() if consecutive else None
        if own is None:
            for entry in entries:
                spans = Spans((entry.slot,), (0,), (entry.total,), entry.check, entry.total, entry.rows)
                self._nodes(spans, entry.first, stream, self._common(entry.launch))
            return
        area = entries[0].slot
        args: list[int] = []
        codes = {entry.check[2] for entry in entries if entry.check is not None}
        work = checked = 0
        for entry in entries:
            address, numel, _ = entry.check if entry.check is not None else (area, 0, 0)
            args += (entry.launch, entry.slot - area, address - area, numel)
            work += -(-entry.total // _BLOCK_BYTES) + -(-numel // _FOLD)
            checked += numel
        args += (0, 0, 0, 0) * (_BATCH_SLOTS - len(entries))
        moved = entries[-1].slot + entries[-1].total - area
        # every entry starts before ``capacity`` (the compact kernel's copy takes ``capacity`` off at most once):
        # the staging area is a quarter of the ring at most
        assert moved <= self.capacity, (moved, self.capacity)
        if moved <= ALONE_BYTES and checked <= ALONE_ELEMENTS:
            work = 1  # one program: no arrive/ready/done handshake (as a lone record node)
        first = 0 if entries[0].first else -1  # a launch that bumps the step starts its batch (_batchable)
        args += (area, moved, len(entries), first, codes.pop() if codes else 0, own)
        before, after = self._ring_args()
        args += (*before, *after)  # the batch node's own launch id is ``own``, above
        args += entries[0].rows if entries[0].rows is not None else (0, 0)
        assert self.batch_kernel is not None
        self.batch_kernel(max(1, min(_programs(self.index), work)), stream, args)

    def _common(self, launch: int) -> list[int]:
        """The record kernel's arguments after the spans' and flags' (see :meth:`capture`)."""
        before, after = self._ring_args()
        return [*before, launch, *after]

    def _ring_args(self) -> tuple[list[int], list[int]]:
        """The ring's addresses and sizes both kernels take, as the record kernel's two runs of them around its
        ``launch`` argument: ``state, meta, hint, buffer, capacity`` and ``cells, launches, words, tags`` (the batch
        kernel takes them back to back)."""
        before = [self.state.data_ptr(), self.meta.data_ptr(), self._host_address + 8 * self.tags]
        before += [self.buffer.data_ptr(), self.capacity]
        return before, [self.cells.data_ptr(), self.launches, self._host_address, self.tags]

    @staticmethod
    def _fork(opened: _Open) -> None:
        """The side stream waits for what the capturing stream queued so far (an edge in the graph)."""
        opened.side.wait_stream(opened.stream)

    @staticmethod
    def _join(opened: _Open) -> None:
        """The capturing stream waits for the side stream's record nodes (their edges join the graph)."""
        opened.stream.wait_stream(opened.side)
        opened.pending = False

    def replay(self, launch: int) -> None:
        """Run ``launch`` once as a graph replay would: reserve, copy, check, finish (see the kernel module)."""
        fallback = self._fallbacks[launch]
        spans = fallback.spans
        state, cells, meta = self.state, self.cells, self.meta
        head = int(state[STATE_HEAD])
        sequence = int(state[STATE_SEQUENCE])
        state[STATE_HEAD] += spans.total
        state[STATE_SEQUENCE] += 1
        state[STATE_STEP] += fallback.first
        step = int(state[STATE_STEP])
        cells[0, launch] = head
        cells[1, launch] = sequence
        real = -1 if fallback.rows is None or spans.rows is None else int(fallback.rows.reshape(-1)[0])
        meta[sequence % self.tags] = torch.tensor([sequence, head, launch, step, real], dtype=torch.int64)
        self.host[self.tags] = sequence + 1
        start = int(cells[0, launch]) % self.capacity
        for view, offset, size in zip(fallback.views, spans.offsets, spans.sizes, strict=True):
            if size:
                self.buffer.narrow(0, start + offset, size).copy_(view)
        largest = 0
        check = fallback.check
        if check is not None and spans.rows is not None and real > 0:
            check = check.detach().reshape(-1)[: real * spans.rows[1]]
        if check is not None and check.numel():
            magnitude = torch.linalg.vector_norm(check.detach(), ord=math.inf, dtype=torch.float32).reshape(1)
            largest = int(magnitude.view(torch.int32).item()) & 0xFFFFFFFF
        cells[2, launch] = max(int(cells[2, launch]), largest)
        word = int(cells[2, launch])
        cells[2, launch] = 0
        cells[3, launch] = 0
        generation = (sequence // self.tags + 1) & 0x7FFFFFFF
        self.words[sequence % self.tags] = (generation << 32) | word

    # --- the writer thread --------------------------------------------------------------------------------------

    @property
    def hint(self) -> int:
        """The last sequence the device reserved + 1 (a plain read of host memory; may lag)."""
        return int(self.host[self.tags])

    def view(self, start: int, offset: int, size: int) -> torch.Tensor:
        """``size`` bytes at ``offset`` in the entry at absolute ``start``, as a uint8 tensor (no copy)."""
        return self.buffer.narrow(0, start % self.capacity + offset, size)

    def intact(self, start: int, head: int) -> bool:
        """Whether an entry at absolute ``start`` still held its bytes when the device's head was ``head``."""
        return head <= start + self.capacity


class _NoDevice:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def fallback_views(tensors: list[torch.Tensor], leads: list[int], sizes: list[int]) -> list[torch.Tensor]:
    """The spans' bytes as uint8 views (what :meth:`GraphRing.replay` reads on each replay)."""
    return [_raw_at(tensor, lead, size) for tensor, lead, size in zip(tensors, leads, sizes, strict=True)]


def _current_stream(index: int) -> int:
    """The raw handle of ``index``'s current stream (the capturing one, during a capture)."""
    return int(torch._C._cuda_getCurrentRawStream(index))


_PROGRAMS: dict[int, int] = {}


def _programs(index: int) -> int:
    programs = _PROGRAMS.get(index)
    if programs is None:
        programs = _PROGRAMS[index] = torch.cuda.get_device_properties(index).multi_processor_count * 2
    return programs


_COMPILED: dict[tuple[int, bool, bool, bool], Any] = {}
_KERNEL_ERROR: list[str] = []


def kernels_available() -> bool:
    """Whether the Triton kernels can be imported (the reason is :func:`kernel_error` otherwise)."""
    if _KERNEL_ERROR:
        return False
    try:
        from moereplay.capture import graph_ring_kernel

        kernel = graph_ring_kernel
        if (
            (_BLOCK_BYTES, _STAGE_BLOCK_BYTES, _FOLD, SPANS, _BATCH_SLOTS)
            != (
                8 * kernel.BLOCK,
                8 * kernel.STAGE_BLOCK,
                kernel.FOLD,
                kernel.SPANS,
                kernel.BATCH,
            )
            or ALONE_ELEMENTS > _FOLD
            or kernel.LANES < kernel.BATCH
            or kernel.LANES % 32
        ):
            # (a lone node folds its whole check in the fold's first step: ALONE_ELEMENTS <= FOLD; the compact
            # batch kernel holds an entry a lane, one lane a thread of its LANES // 32 warps)
            raise ImportError(
                "graph_ring_kernel's BLOCK, FOLD, SPANS, BATCH or LANES does not match the launcher's"
            )
    except Exception as error:  # no triton, or one whose language differs
        _KERNEL_ERROR.append(f"{type(error).__name__}: {error}")
        return False
    return True


def kernel_error() -> str | None:
    """Why the kernels are not available (None: they are, or nobody asked yet)."""
    return _KERNEL_ERROR[0] if _KERNEL_ERROR else None


def _compile(index: int, *, stage: bool = False, batch: bool = False, compact: bool = False) -> Any:
    compiled = _COMPILED.get((index, stage, batch, compact))
    if compiled is None:
        from moereplay.capture import graph_ring_kernel

        compiled = graph_ring_kernel.compile_kernel(index, stage=stage, batch=batch, compact=compact)
        _COMPILED[index, stage, batch, compact] = compiled
    return compiled


def _batchable(batch: list[_Batched], entry: _Batched) -> bool:
    """Whether ``entry`` may join ``batch``'s node: the same real-row count (one read for all), the same dtype of
    checked output, and not a launch that bumps the step — that one starts a batch of its own, so the entries
    recorded before it keep the step they ran in and every such launch bumps it once (the node bumps before
    its metadata rows, for all of its entries)."""
    if entry.first or entry.rows != batch[0].rows:
        return False
    codes = {item.check[2] for item in batch if item.check is not None}
    return entry.check is None or not codes or entry.check[2] in codes
