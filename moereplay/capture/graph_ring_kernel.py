"""The Triton kernel behind :class:`moereplay.capture.graph_ring.GraphRing` (imported only where Triton is).

Captured into a CUDA graph after each recorded layer call, :func:`graph_record` runs on every replay of it with
no host work — one kernel node per layer call (up to :data:`SPANS` spans; a call with more gets one more node per
further :data:`SPANS`, which only copy):

- reserve (the first node of a launch, ``reserve`` 1): one program adds the entry's byte size (fixed at capture)
  to the ring's device ``head`` and 1 to its device ``sequence``, bumps the graph ``step`` when the launch is the
  first MoE layer's, publishes start and sequence in the launch's cells and the row ``(sequence, start, launch,
  step, tokens)`` in the sequence's metadata row (``tokens``: the int32 at ``rows`` — the step's real token count,
  read at this replay — or -1 without one), and stores ``sequence + 1`` into the host's hint word (host-mapped
  memory: how far the device has reserved, read by the writer thread without a CUDA call). A node run by one
  program (a decode-sized entry, ``graph_ring.ALONE_BYTES``) does only that. With several programs, the one
  arriving first (``atomic_add`` on the launch's ``arrive`` cell returns 0) reserves and then releases the launch's
  ``ready`` cell; the others wait for it — only on a program that is already running, so the wait cannot deadlock
  whatever order the programs are scheduled in;
- copy: the node's spans (fixed addresses and sizes, captured; whole 8-byte words — sources and entry offsets
  start on 256-byte boundaries, so a span's last word never leaves the page of its last byte) are one stream of
  words: each lane of a :data:`BLOCK`-word step picks its span by comparing its index with the spans' running
  starts and moves one word, so the decode-sized entry of a gpt-oss layer call (18 spans, ≈ 14 KB) is two
  masked loads and stores, not one dependent load per span; the programs take the steps in turn (entry start
  read through L2: an atomic, never a stale L1 line);
- finish (the last node, ``finish`` 1): fold the largest magnitude of one float output — of its first ``rows``
  rows only, when ``rows`` is the address of the step's real token count (an int32 the model runner rewrites
  before each step it prepares, :mod:`moereplay.capture.padded_rows`; ``row_numel`` elements a row): a graph runs
  a batch padded to its captured size, and the padding rows hold whatever the buffers held, NaN included, which
  must not trigger; a lone program stores
  the finished tag word ``generation << 32 | bits(max |x|)`` of the sequence into the host-mapped tag array after
  one fenced atomic (its copies before the word); with several programs each folds into the launch's device word
  with ``atomic_max`` and the last one to finish (``atomic_add`` on the launch's ``done`` cell, acq_rel) takes the
  word, resets the launch's cells for the next replay and stores the tag word — one aligned 8-byte store, never
  an atomic over PCIe. Every other atomic is relaxed: a fenced (acq_rel, Triton's default) atomic costs ≈ 0.3 µs
  in a dependent chain (``tools/bench/graph_ring_bench.py``, 2026-12-04: 12.70 → 8.81 µs a node relaxed).

Batch (:func:`graph_record_batch`, one node at a graph's end for up to :data:`BATCH` staged entries, see
``graph_ring``): the first program to arrive reserves ``moved`` bytes and ``count`` sequences at once, bumps the
step when the batch starts with the first MoE layer's launch (``first`` 0; -1 none), writes every entry's metadata
row and the hint, and releases ``ready``; each entry's words go from the staging area to ``(head + offset) %
capacity`` and its checked output's real rows are folded into its launch's partial word, both dealt to the
programs step by step across the entries; the last program to finish (the acq_rel ``done`` cell of the node's own
launch id) stores every entry's tag word and resets the cells.

Concurrent launches (graphs replayed on several streams) reserve with atomics, so their entries never overlap;
one launch id is never replayed twice at once (a graph's replays are ordered on its stream).
Every argument is a 64-bit integer (addresses, sizes in bytes — multiples of 8 —, ``moved`` their sum, the
launch id, runtime flags: ``code`` 0 none, 1 float16, 2 bfloat16, 3 float32), so the kernel compiles once per
device (:func:`compile_kernel`) before any capture: nothing is compiled while a graph is being captured. Until
this kernel, a separate one-warp reserve kernel preceded each copy kernel: two graph nodes per layer call, ~16 µs
per replay of a gpt-oss-shaped ``fused_marlin_moe`` layer on the H200 (``tests/gpu/test_flight_graph_gpu.py``
prints the figure).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from moereplay.capture.ring_kernel import compile_launcher

BLOCK = 1024
"""8-byte words a program moves per loop step."""

STAGE_BLOCK = 128
"""The same for the STAGE variant (a staging copy on the graph's path): many programs of one step each, which
look only at the spans that meet their step. On the H200 a one-program node's copy of a gpt-oss decode entry
(18 spans, 1,024-word steps) took 5.8 µs of its 8.4 — compute-bound on the span pick, not memory: 43.6 µs with
one warp, 16.0 with two, 8.4 with four (``tools/bench/graph_ring_ablation.py``, 2026-12-05)."""

FOLD = 8192
"""Output elements a program folds per step: a lone program's whole check (``graph_ring.ALONE_ELEMENTS``) in one
step, whose loads are issued before the reservation and reduced after the copies (their latency overlaps)."""

SPANS = 24
"""Spans one :func:`graph_record` node copies (a gpt-oss layer call keeps 18: one node a layer call)."""

CELL_START, CELL_SEQUENCE, CELL_PARTIAL, CELL_DONE, CELL_ARRIVE, CELL_READY = range(6)
"""Rows of the ring's ``cells`` (one column per launch id); the kernel spells them as literals (a jitted function
reads no Python globals but constexprs)."""

RECORD_INTS = [name for i in range(SPANS) for name in (f"s{i}", f"o{i}", f"n{i}")] + [
    "check", "numel", "code", "moved", "finish", "reserve", "total", "first",
    "state", "meta", "hint", "buffer", "capacity", "launch", "cells", "launches", "words", "tags",
    "rows", "row_numel",
]  # fmt: skip


@triton.jit
def _load_magnitudes(check, index, numel, code):
    """``|x|`` of the checked output's elements ``index`` (0 where masked) as float32, whatever its dtype."""
    mask = index < numel
    x = tl.zeros(index.shape, dtype=tl.float32)
    if code == 1:
        x = tl.load(check.to(tl.pointer_type(tl.float16)) + index, mask=mask, other=0.0).to(tl.float32)
    if code == 2:
        x = tl.load(check.to(tl.pointer_type(tl.bfloat16)) + index, mask=mask, other=0.0).to(tl.float32)
    if code == 3:
        x = tl.load(check.to(tl.pointer_type(tl.float32)) + index, mask=mask, other=0.0)
    return tl.abs(x)


@triton.jit
def _pick(index, step, begin, size, source, target, src, dst, BLOCK: tl.constexpr):
    """Lanes whose word ``index`` is at or past the span's first word take its source and target bases (a later
    span's start is larger: it overwrites). Only a span that meets the step's words ``[step, step + BLOCK)`` is
    looked at (a branch on scalars, the same for every lane): a lane past the span's end belongs to a later span
    or is masked. Returns the bases and the next span's first word."""
    end = begin + size // 8
    if (size > 0) & (begin < step + BLOCK) & (end > step):
        inside = index >= begin
        src = tl.where(inside, source - begin * 8, src)
        dst = tl.where(inside, target - begin * 8, dst)
    return src, dst, end


@triton.jit
def _reserve(state, meta, hint, launch, total, first, tags, start_cell, sequence_cell, real):
    """Take the entry's bytes and sequence; publish them in the launch's cells, the metadata row (with ``real``,
    the replay's token count, -1 unknown) and the hint. Relaxed atomics: the three counters are independent
    (issued back to back, one round trip to L2); what orders the published cells for the launch's other programs
    is the caller's release of ``ready``."""
    state_cells = state.to(tl.pointer_type(tl.int64))
    head = tl.atomic_add(state_cells, total, sem="relaxed")
    sequence = tl.atomic_add(state_cells + 1, 1, sem="relaxed")
    step = tl.atomic_add(state_cells + 2, first, sem="relaxed") + first
    tl.atomic_xchg(start_cell, head, sem="relaxed")
    tl.atomic_xchg(sequence_cell, sequence, sem="relaxed")
    row = meta.to(tl.pointer_type(tl.int64)) + (sequence % tags) * 5
    tl.store(row, sequence)
    tl.store(row + 1, head)
    tl.store(row + 2, launch)
    tl.store(row + 3, step)
    tl.store(row + 4, real)
    tl.store(hint.to(tl.pointer_type(tl.int64)), sequence + 1)
    return head


@triton.jit(do_not_specialize=RECORD_INTS)
def graph_record(
    s0, o0, n0, s1, o1, n1, s2, o2, n2, s3, o3, n3, s4, o4, n4, s5, o5, n5, s6, o6, n6, s7, o7, n7, s8, o8, n8, s9,
    o9, n9, s10, o10, n10, s11, o11, n11, s12, o12, n12, s13, o13, n13, s14, o14, n14, s15, o15, n15, s16, o16, n16,
    s17, o17, n17, s18, o18, n18, s19, o19, n19, s20, o20, n20, s21, o21, n21, s22, o22, n22, s23, o23, n23,
    check, numel, code, moved, finish, reserve, total, first,
    state, meta, hint, buffer, capacity, launch, cells, launches, words, tags,
    rows, row_numel,
    BLOCK: tl.constexpr,
    FOLD: tl.constexpr,
    STAGE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    # the rows this replay really computes: a graph runs a padded batch, and the padding rows hold whatever the
    # buffers held (``rows``: the address of the step's token count, read now, at replay; 0: every row)
    limit = numel
    real = tl.full([], -1, dtype=tl.int64)  # the metadata row's token count: -1, unknown
    if STAGE == 0 and rows != 0:
        real = tl.load(rows.to(tl.pointer_type(tl.int32))).to(tl.int64)
        if finish != 0 and real > 0:
            limit = tl.minimum(numel, real * row_numel)
    # the first step of the fold: loads issued now, reduced after the copies
    first_fold = pid * FOLD + tl.arange(0, FOLD).to(tl.int64)
    magnitudes = tl.zeros([FOLD], dtype=tl.float32)
    if STAGE == 0 and finish != 0:
        magnitudes = _load_magnitudes(check, first_fold, limit, code)
    column = cells.to(tl.pointer_type(tl.int64)) + launch
    start_cell = column + 0 * launches  # CELL_START
    sequence_cell = column + 1 * launches  # CELL_SEQUENCE
    ready_cell = column + 5 * launches  # CELL_READY
    arrive_cell = column + 4 * launches  # CELL_ARRIVE
    start = tl.zeros([], dtype=tl.int64)  # STAGE: the copies go to ``buffer`` itself
    if STAGE:
        pass
    elif reserve != 0:
        if programs == 1:  # alone (a decode-sized entry): no arrive/ready handshake
            start = _reserve(state, meta, hint, launch, total, first, tags, start_cell, sequence_cell, real)
        else:
            if tl.atomic_add(arrive_cell, 1, sem="relaxed") == 0:
                _reserve(state, meta, hint, launch, total, first, tags, start_cell, sequence_cell, real)
                tl.atomic_xchg(ready_cell, 1, sem="release")  # the cells above before "ready"
            ready = tl.atomic_add(ready_cell, 0, sem="acquire")
            while ready == 0:  # only programs that arrived after the reserving one, which runs: no deadlock
                ready = tl.atomic_add(ready_cell, 0, sem="acquire")
            start = tl.atomic_add(start_cell, 0, sem="relaxed")  # through L2: never a stale L1 line
    else:  # a later node of the launch: the reserving node's kernel has ended
        start = tl.atomic_add(start_cell, 0, sem="relaxed")
    target = buffer + start % capacity  # STAGE: start 0, so ``buffer`` itself
    count = moved // 8
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for step in range(pid * BLOCK, count, programs * BLOCK):
        index = step + lanes
        src = tl.zeros([BLOCK], dtype=tl.int64)
        dst = tl.zeros([BLOCK], dtype=tl.int64)
        src, dst, begin = _pick(index, step, 0, n0, s0, target + o0, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n1, s1, target + o1, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n2, s2, target + o2, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n3, s3, target + o3, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n4, s4, target + o4, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n5, s5, target + o5, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n6, s6, target + o6, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n7, s7, target + o7, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n8, s8, target + o8, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n9, s9, target + o9, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n10, s10, target + o10, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n11, s11, target + o11, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n12, s12, target + o12, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n13, s13, target + o13, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n14, s14, target + o14, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n15, s15, target + o15, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n16, s16, target + o16, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n17, s17, target + o17, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n18, s18, target + o18, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n19, s19, target + o19, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n20, s20, target + o20, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n21, s21, target + o21, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n22, s22, target + o22, src, dst, BLOCK)
        src, dst, begin = _pick(index, step, begin, n23, s23, target + o23, src, dst, BLOCK)
        mask = index < count
        word = tl.load((src + index * 8).to(tl.pointer_type(tl.int64)), mask=mask)
        tl.store((dst + index * 8).to(tl.pointer_type(tl.int64)), word, mask=mask)
    if STAGE == 0 and finish != 0:
        # max of |x|'s bits: NaN's are above Inf's, so a NaN anywhere shows
        best = magnitudes.to(tl.int32, bitcast=True)
        for fold_step in range((pid + programs) * FOLD, limit, programs * FOLD):
            more = _load_magnitudes(check, fold_step + tl.arange(0, FOLD).to(tl.int64), limit, code)
            best = tl.maximum(best, more.to(tl.int32, bitcast=True))
        largest = tl.max(best, axis=0).to(tl.int64)
        partial = column + 2 * launches  # CELL_PARTIAL
        counter = column + 3 * launches  # CELL_DONE
        tl.debug_barrier()  # this program's copies (every thread's) before the fenced atomic below
        if programs == 1:
            sequence = tl.atomic_add(sequence_cell, 0)  # acq_rel: the copies before the tag word
            if reserve == 0:  # an earlier node of the launch may have used the handshake
                tl.atomic_xchg(arrive_cell, 0, sem="relaxed")
                tl.atomic_xchg(ready_cell, 0, sem="relaxed")
            generation = ((sequence // tags) + 1) & 0x7FFFFFFF
            slot = words.to(tl.pointer_type(tl.int64)) + sequence % tags
            tl.store(slot, (generation << 32) | largest)
        else:
            tl.atomic_max(partial, largest, sem="relaxed")
            arrived = tl.atomic_add(counter, 1)  # acq_rel: this program's copies and max before its "done"
            if arrived == programs - 1:  # the last program: every other one's max is in the word
                word = tl.atomic_xchg(partial, 0, sem="relaxed")
                tl.atomic_xchg(counter, 0, sem="relaxed")
                tl.atomic_xchg(arrive_cell, 0, sem="relaxed")
                tl.atomic_xchg(ready_cell, 0, sem="relaxed")
                sequence = tl.atomic_add(sequence_cell, 0, sem="relaxed")
                generation = ((sequence // tags) + 1) & 0x7FFFFFFF
                slot = words.to(tl.pointer_type(tl.int64)) + sequence % tags
                tl.store(slot, (generation << 32) | word)


BATCH = 24
"""Entries one :func:`graph_record_batch` node records (a graph with more staged entries gets one more node per
further :data:`BATCH`)."""

BATCH_INTS = [name for i in range(BATCH) for name in (f"l{i}", f"e{i}", f"c{i}", f"k{i}")] + [
    "area", "moved", "count", "first", "code", "own",
    "state", "meta", "hint", "buffer", "capacity", "cells", "launches", "words", "tags",
    "rows", "row_numel",
]  # fmt: skip


@triton.jit
def _batch_row(meta, tags, seq0, head, step, real, launch, entry, ENTRY: tl.constexpr, count):
    """The metadata row of the batch's entry ``ENTRY`` (if the batch has it): sequence, start, launch, step, tokens."""
    if count > ENTRY:
        sequence = seq0 + ENTRY
        row = meta.to(tl.pointer_type(tl.int64)) + (sequence % tags) * 5
        tl.store(row, sequence)
        tl.store(row + 1, head + entry)
        tl.store(row + 2, launch)
        tl.store(row + 3, step)
        tl.store(row + 4, real)


@triton.jit
def _batch_fold(area, check, numel, launch, ENTRY: tl.constexpr, count, limit_rows, code, pid, programs, base, partials,
                FOLD: tl.constexpr):  # fmt: skip
    """Fold entry ``ENTRY``'s checked output (``numel`` elements at ``check`` bytes into the staged area, its first
    ``limit_rows`` elements when that is not negative) into the launch's partial word. The fold steps of all
    the batch's entries are dealt to the programs in turn (``base``: the steps of the entries before this one),
    so every program folds about as many whatever the entries' sizes. Returns ``base`` plus this entry's steps."""
    steps = tl.zeros([], dtype=tl.int64)
    if count > ENTRY:
        limit = numel
        if limit_rows >= 0:
            limit = tl.minimum(numel, limit_rows)
        steps = (limit + FOLD - 1) // FOLD
        first = ((pid - base) % programs + programs) % programs
        if first < steps:
            best = tl.zeros([FOLD], dtype=tl.int32)
            for fold_step in range(first, steps, programs):
                index = fold_step * FOLD + tl.arange(0, FOLD).to(tl.int64)
                more = _load_magnitudes(area + check, index, limit, code)
                best = tl.maximum(best, more.to(tl.int32, bitcast=True))
            tl.atomic_max(partials + launch, tl.max(best, axis=0).to(tl.int64), sem="relaxed")
    return base + steps


@triton.jit
def _batch_copy(area, buffer, capacity, head, entry, following, moved, ENTRY: tl.constexpr, count, pid, programs, base,
                BLOCK: tl.constexpr):  # fmt: skip
    """Copy the batch's entry ``ENTRY`` (from ``entry`` bytes into the staged area up to the next entry's start,
    ``following``, or ``moved`` for the last) to its place in the ring. The copy steps of all the batch's entries are
    dealt to the programs in turn (``base``: the steps of the entries before this one). Returns ``base`` plus this
    entry's steps."""
    steps = tl.zeros([], dtype=tl.int64)
    if count > ENTRY:
        end = moved
        if count > ENTRY + 1:
            end = following
        words = (end - entry) // 8
        steps = (words + BLOCK - 1) // BLOCK
        first = ((pid - base) % programs + programs) % programs
        source = area + entry
        target = buffer + (head + entry) % capacity
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        for copy_step in range(first, steps, programs):
            index = copy_step * BLOCK + lanes
            mask = index < words
            word = tl.load((source + index * 8).to(tl.pointer_type(tl.int64)), mask=mask)
            tl.store((target + index * 8).to(tl.pointer_type(tl.int64)), word, mask=mask)
    return base + steps


@triton.jit
def _batch_tag(words, tags, seq0, partials, launch, ENTRY: tl.constexpr, count):
    """The finished tag word of the batch's entry ``ENTRY`` (the last program, after every fold), its partial reset."""
    if count > ENTRY:
        largest = tl.atomic_xchg(partials + launch, 0, sem="relaxed")
        sequence = seq0 + ENTRY
        generation = ((sequence // tags) + 1) & 0x7FFFFFFF
        tl.store(words.to(tl.pointer_type(tl.int64)) + sequence % tags, (generation << 32) | largest)


@triton.jit
def _batch_limits(rows, row_numel):
    """The replay's token count read at ``rows`` (-1: unknown) and the elements of a checked output's real rows
    (-1: every element)."""
    real = tl.full([], -1, dtype=tl.int64)
    limit_rows = tl.full([], -1, dtype=tl.int64)
    if rows != 0:
        real = tl.load(rows.to(tl.pointer_type(tl.int32))).to(tl.int64)
        if real > 0:
            limit_rows = real * row_numel
    return real, limit_rows


@triton.jit
def _batch_cells(cells, own, launches):
    """The batch node's own cells (launch id ``own``): start, sequence, done, arrive, ready; and the partial words'
    row (an entry's at its launch id)."""
    column = cells.to(tl.pointer_type(tl.int64)) + own
    start_cell = column + 0 * launches  # CELL_START
    sequence_cell = column + 1 * launches  # CELL_SEQUENCE
    counter = column + 3 * launches  # CELL_DONE
    arrive_cell = column + 4 * launches  # CELL_ARRIVE
    ready_cell = column + 5 * launches  # CELL_READY
    partials = cells.to(tl.pointer_type(tl.int64)) + 2 * launches  # CELL_PARTIAL of each entry's launch
    return start_cell, sequence_cell, counter, arrive_cell, ready_cell, partials


@triton.jit
def _batch_reserve(state, moved, count, first, start_cell, sequence_cell):
    """The batch's ``moved`` bytes and ``count`` sequences taken at once (the step bumped when ``first`` is not
    negative), published in the node's cells. Returns head, first sequence and step."""
    state_cells = state.to(tl.pointer_type(tl.int64))
    bump = (first >= 0).to(tl.int64)
    head = tl.atomic_add(state_cells, moved, sem="relaxed")
    seq0 = tl.atomic_add(state_cells + 1, count, sem="relaxed")
    step = tl.atomic_add(state_cells + 2, bump, sem="relaxed") + bump
    tl.atomic_xchg(start_cell, head, sem="relaxed")
    tl.atomic_xchg(sequence_cell, seq0, sem="relaxed")
    return head, seq0, step


@triton.jit
def _batch_await(ready_cell):
    """Spin until the reserving program has released ``ready``: only programs that arrived after it, which runs —
    no deadlock."""
    ready = tl.atomic_add(ready_cell, 0, sem="acquire")
    while ready == 0:
        ready = tl.atomic_add(ready_cell, 0, sem="acquire")


@triton.jit
def _batch_reset(counter, arrive_cell, ready_cell, sequence_cell):
    """The last program: the node's cells reset for the next replay; returns the batch's first sequence."""
    tl.atomic_xchg(counter, 0, sem="relaxed")
    tl.atomic_xchg(arrive_cell, 0, sem="relaxed")
    tl.atomic_xchg(ready_cell, 0, sem="relaxed")
    return tl.atomic_add(sequence_cell, 0, sem="relaxed")


@triton.jit(do_not_specialize=BATCH_INTS)
def graph_record_batch(
    l0, e0, c0, k0, l1, e1, c1, k1, l2, e2, c2, k2, l3, e3, c3, k3, l4, e4, c4, k4, l5, e5, c5, k5, l6, e6, c6, k6,
    l7, e7, c7, k7, l8, e8, c8, k8, l9, e9, c9, k9, l10, e10, c10, k10, l11, e11, c11, k11, l12, e12, c12, k12, l13,
    e13, c13, k13, l14, e14, c14, k14, l15, e15, c15, k15, l16, e16, c16, k16, l17, e17, c17, k17, l18, e18, c18,
    k18, l19, e19, c19, k19, l20, e20, c20, k20, l21, e21, c21, k21, l22, e22, c22, k22, l23, e23, c23, k23,
    area, moved, count, first, code, own,
    state, meta, hint, buffer, capacity, cells, launches, words, tags,
    rows, row_numel,
    BLOCK: tl.constexpr,
    FOLD: tl.constexpr,
):  # fmt: skip
    """Record ``count`` staged entries at once (see the module docstring, Batch)."""
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    real, limit_rows = _batch_limits(rows, row_numel)
    start_cell, sequence_cell, counter, arrive_cell, ready_cell, partials = _batch_cells(cells, own, launches)
    reserving = programs == 1
    if not reserving:
        reserving = tl.atomic_add(arrive_cell, 1, sem="relaxed") == 0
    if reserving:
        head, seq0, step = _batch_reserve(state, moved, count, first, start_cell, sequence_cell)
        _batch_row(meta, tags, seq0, head, step, real, l0, e0, 0, count)
        _batch_row(meta, tags, seq0, head, step, real, l1, e1, 1, count)
        _batch_row(meta, tags, seq0, head, step, real, l2, e2, 2, count)
        _batch_row(meta, tags, seq0, head, step, real, l3, e3, 3, count)
        _batch_row(meta, tags, seq0, head, step, real, l4, e4, 4, count)
        _batch_row(meta, tags, seq0, head, step, real, l5, e5, 5, count)
        _batch_row(meta, tags, seq0, head, step, real, l6, e6, 6, count)
        _batch_row(meta, tags, seq0, head, step, real, l7, e7, 7, count)
        _batch_row(meta, tags, seq0, head, step, real, l8, e8, 8, count)
        _batch_row(meta, tags, seq0, head, step, real, l9, e9, 9, count)
        _batch_row(meta, tags, seq0, head, step, real, l10, e10, 10, count)
        _batch_row(meta, tags, seq0, head, step, real, l11, e11, 11, count)
        _batch_row(meta, tags, seq0, head, step, real, l12, e12, 12, count)
        _batch_row(meta, tags, seq0, head, step, real, l13, e13, 13, count)
        _batch_row(meta, tags, seq0, head, step, real, l14, e14, 14, count)
        _batch_row(meta, tags, seq0, head, step, real, l15, e15, 15, count)
        _batch_row(meta, tags, seq0, head, step, real, l16, e16, 16, count)
        _batch_row(meta, tags, seq0, head, step, real, l17, e17, 17, count)
        _batch_row(meta, tags, seq0, head, step, real, l18, e18, 18, count)
        _batch_row(meta, tags, seq0, head, step, real, l19, e19, 19, count)
        _batch_row(meta, tags, seq0, head, step, real, l20, e20, 20, count)
        _batch_row(meta, tags, seq0, head, step, real, l21, e21, 21, count)
        _batch_row(meta, tags, seq0, head, step, real, l22, e22, 22, count)
        _batch_row(meta, tags, seq0, head, step, real, l23, e23, 23, count)
        tl.store(hint.to(tl.pointer_type(tl.int64)), seq0 + count)
        if programs > 1:
            tl.atomic_xchg(ready_cell, 1, sem="release")  # the cells above before "ready"
    if programs > 1:
        _batch_await(ready_cell)
    head = tl.atomic_add(start_cell, 0, sem="relaxed")  # through L2: never a stale L1 line
    # the staged entries lie one after another from ``area``; each goes where a reservation of its own would have
    # put it (``start % capacity``, running into the tail past ``capacity``), which is where the writer reads it
    base = tl.zeros([], dtype=tl.int64)
    base = _batch_copy(area, buffer, capacity, head, e0, e1, moved, 0, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e1, e2, moved, 1, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e2, e3, moved, 2, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e3, e4, moved, 3, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e4, e5, moved, 4, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e5, e6, moved, 5, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e6, e7, moved, 6, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e7, e8, moved, 7, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e8, e9, moved, 8, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e9, e10, moved, 9, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e10, e11, moved, 10, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e11, e12, moved, 11, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e12, e13, moved, 12, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e13, e14, moved, 13, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e14, e15, moved, 14, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e15, e16, moved, 15, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e16, e17, moved, 16, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e17, e18, moved, 17, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e18, e19, moved, 18, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e19, e20, moved, 19, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e20, e21, moved, 20, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e21, e22, moved, 21, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e22, e23, moved, 22, count, pid, programs, base, BLOCK)
    base = _batch_copy(area, buffer, capacity, head, e23, moved, moved, 23, count, pid, programs, base, BLOCK)
    base = _batch_fold(area, c0, k0, l0, 0, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c1, k1, l1, 1, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c2, k2, l2, 2, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c3, k3, l3, 3, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c4, k4, l4, 4, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c5, k5, l5, 5, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c6, k6, l6, 6, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c7, k7, l7, 7, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c8, k8, l8, 8, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c9, k9, l9, 9, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c10, k10, l10, 10, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c11, k11, l11, 11, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c12, k12, l12, 12, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c13, k13, l13, 13, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c14, k14, l14, 14, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c15, k15, l15, 15, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c16, k16, l16, 16, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c17, k17, l17, 17, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c18, k18, l18, 18, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c19, k19, l19, 19, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c20, k20, l20, 20, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c21, k21, l21, 21, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c22, k22, l22, 22, count, limit_rows, code, pid, programs, base, partials, FOLD)
    base = _batch_fold(area, c23, k23, l23, 23, count, limit_rows, code, pid, programs, base, partials, FOLD)
    tl.debug_barrier()  # this program's copies and folds (every thread's) before the fenced atomic below
    arrived = tl.atomic_add(counter, 1)  # acq_rel: this program's copies and maxima before its "done"
    if arrived == programs - 1:  # the last program: every other one's maxima are in the partial words
        seq0 = _batch_reset(counter, arrive_cell, ready_cell, sequence_cell)
        _batch_tag(words, tags, seq0, partials, l0, 0, count)
        _batch_tag(words, tags, seq0, partials, l1, 1, count)
        _batch_tag(words, tags, seq0, partials, l2, 2, count)
        _batch_tag(words, tags, seq0, partials, l3, 3, count)
        _batch_tag(words, tags, seq0, partials, l4, 4, count)
        _batch_tag(words, tags, seq0, partials, l5, 5, count)
        _batch_tag(words, tags, seq0, partials, l6, 6, count)
        _batch_tag(words, tags, seq0, partials, l7, 7, count)
        _batch_tag(words, tags, seq0, partials, l8, 8, count)
        _batch_tag(words, tags, seq0, partials, l9, 9, count)
        _batch_tag(words, tags, seq0, partials, l10, 10, count)
        _batch_tag(words, tags, seq0, partials, l11, 11, count)
        _batch_tag(words, tags, seq0, partials, l12, 12, count)
        _batch_tag(words, tags, seq0, partials, l13, 13, count)
        _batch_tag(words, tags, seq0, partials, l14, 14, count)
        _batch_tag(words, tags, seq0, partials, l15, 15, count)
        _batch_tag(words, tags, seq0, partials, l16, 16, count)
        _batch_tag(words, tags, seq0, partials, l17, 17, count)
        _batch_tag(words, tags, seq0, partials, l18, 18, count)
        _batch_tag(words, tags, seq0, partials, l19, 19, count)
        _batch_tag(words, tags, seq0, partials, l20, 20, count)
        _batch_tag(words, tags, seq0, partials, l21, 21, count)
        _batch_tag(words, tags, seq0, partials, l22, 22, count)
        _batch_tag(words, tags, seq0, partials, l23, 23, count)


LANES = 128
"""Lanes of :func:`graph_record_batch_compact`'s per-entry vectors: one a thread at its four warps (no lane held
twice), at least :data:`BATCH`."""


@triton.jit
def _lanes(lanes, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
           a21, a22, a23):  # fmt: skip
    """The 24 scalars as one vector: lane ``i`` holds ``a<i>`` (0 past them)."""
    v = tl.zeros(lanes.shape, dtype=tl.int64)
    v = tl.where(lanes == 0, a0, v)
    v = tl.where(lanes == 1, a1, v)
    v = tl.where(lanes == 2, a2, v)
    v = tl.where(lanes == 3, a3, v)
    v = tl.where(lanes == 4, a4, v)
    v = tl.where(lanes == 5, a5, v)
    v = tl.where(lanes == 6, a6, v)
    v = tl.where(lanes == 7, a7, v)
    v = tl.where(lanes == 8, a8, v)
    v = tl.where(lanes == 9, a9, v)
    v = tl.where(lanes == 10, a10, v)
    v = tl.where(lanes == 11, a11, v)
    v = tl.where(lanes == 12, a12, v)
    v = tl.where(lanes == 13, a13, v)
    v = tl.where(lanes == 14, a14, v)
    v = tl.where(lanes == 15, a15, v)
    v = tl.where(lanes == 16, a16, v)
    v = tl.where(lanes == 17, a17, v)
    v = tl.where(lanes == 18, a18, v)
    v = tl.where(lanes == 19, a19, v)
    v = tl.where(lanes == 20, a20, v)
    v = tl.where(lanes == 21, a21, v)
    v = tl.where(lanes == 22, a22, v)
    v = tl.where(lanes == 23, a23, v)
    return v


@triton.jit(do_not_specialize=BATCH_INTS)
def graph_record_batch_compact(
    l0, e0, c0, k0, l1, e1, c1, k1, l2, e2, c2, k2, l3, e3, c3, k3, l4, e4, c4, k4, l5, e5, c5, k5, l6, e6, c6, k6,
    l7, e7, c7, k7, l8, e8, c8, k8, l9, e9, c9, k9, l10, e10, c10, k10, l11, e11, c11, k11, l12, e12, c12, k12, l13,
    e13, c13, k13, l14, e14, c14, k14, l15, e15, c15, k15, l16, e16, c16, k16, l17, e17, c17, k17, l18, e18, c18,
    k18, l19, e19, c19, k19, l20, e20, c20, k20, l21, e21, c21, k21, l22, e22, c22, k22, l23, e23, c23, k23,
    area, moved, count, first, code, own,
    state, meta, hint, buffer, capacity, cells, launches, words, tags,
    rows, row_numel,
    BLOCK: tl.constexpr,
    FOLD: tl.constexpr,
    LANES: tl.constexpr,
):  # fmt: skip
    """:func:`graph_record_batch`'s contract (the same arguments, the same ring bytes, metadata rows, tag words and
    cells) in a kernel one loop long instead of one unrolled copy and fold per entry (a 3.7 MB cubin with Triton
    3.6 for sm_90, its bodies far apart: each program steps over most of them to reach its own). The entries'
    arguments become per-entry vectors (a lane each); the copy is one run of ``moved`` bytes, split where the
    first entry starts at or past ``capacity - head % capacity`` (an entry that starts before it runs into the
    tail; one that starts past it goes to the ring's start: where a reservation of its own would have put it);
    each fold step finds its entry by the vectors' prefix sums; the last program takes every entry's partial word
    and stores every tag word with one vector operation each. Every entry must start before ``capacity`` (the
    split takes ``capacity`` off once; the host's staging area is at most a quarter of the ring)."""
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    lanes = tl.arange(0, LANES).to(tl.int64)
    live = lanes < count
    launch_of = _lanes(lanes, l0, l1, l2, l3, l4, l5, l6, l7, l8, l9, l10, l11, l12, l13, l14, l15, l16, l17, l18,
                       l19, l20, l21, l22, l23)  # fmt: skip
    entry_of = _lanes(lanes, e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15, e16, e17, e18,
                      e19, e20, e21, e22, e23)  # fmt: skip
    real, limit_rows = _batch_limits(rows, row_numel)
    start_cell, sequence_cell, counter, arrive_cell, ready_cell, partials = _batch_cells(cells, own, launches)
    reserving = programs == 1
    if not reserving:
        reserving = tl.atomic_add(arrive_cell, 1, sem="relaxed") == 0
    if reserving:
        head, seq0, step = _batch_reserve(state, moved, count, first, start_cell, sequence_cell)
        sequences = seq0 + lanes
        row = meta.to(tl.pointer_type(tl.int64)) + (sequences % tags) * 5
        tl.store(row, sequences, mask=live)
        tl.store(row + 1, head + entry_of, mask=live)
        tl.store(row + 2, launch_of, mask=live)
        tl.store(row + 3, tl.zeros_like(lanes) + step, mask=live)
        tl.store(row + 4, tl.zeros_like(lanes) + real, mask=live)
        tl.store(hint.to(tl.pointer_type(tl.int64)), seq0 + count)
        if programs > 1:
            tl.debug_barrier()  # every thread's rows before the release below
            tl.atomic_xchg(ready_cell, 1, sem="release")  # the cells above before "ready"
    if programs > 1:
        _batch_await(ready_cell)
    head = tl.atomic_add(start_cell, 0, sem="relaxed")  # through L2: never a stale L1 line
    # the copy: the staged entries lie one after another from ``area``, and go to ``head % capacity`` on, less
    # ``capacity`` from the first entry that starts at or past the ring's end (see the docstring)
    lead = head % capacity
    split = tl.min(tl.where(live & (entry_of >= capacity - lead), entry_of, moved), axis=0)
    total_words = moved // 8
    copy_steps = (total_words + BLOCK - 1) // BLOCK
    block = tl.arange(0, BLOCK).to(tl.int64)
    for copy_step in range(pid, copy_steps, programs):
        offset = (copy_step * BLOCK + block) * 8
        mask = offset < moved
        target = buffer + lead + offset - tl.where(offset >= split, capacity, 0)
        word = tl.load((area + offset).to(tl.pointer_type(tl.int64)), mask=mask)
        tl.store(target.to(tl.pointer_type(tl.int64)), word, mask=mask)
    # the folds: each entry's checked output (its first ``limit_rows`` elements when that is not negative) in
    # steps of FOLD, dealt to the programs after the copy's steps; a step's entry is the lane whose steps hold it
    check_of = _lanes(lanes, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18,
                      c19, c20, c21, c22, c23)  # fmt: skip
    limit_of = _lanes(lanes, k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10, k11, k12, k13, k14, k15, k16, k17, k18,
                      k19, k20, k21, k22, k23)  # fmt: skip
    if limit_rows >= 0:
        limit_of = tl.minimum(limit_of, limit_rows)
    fold_steps = tl.where(live, (limit_of + FOLD - 1) // FOLD, 0)
    fold_from = tl.cumsum(fold_steps, axis=0) - fold_steps
    fold_total = tl.sum(fold_steps, axis=0)
    for fold_step in range(((pid - copy_steps) % programs + programs) % programs, fold_total, programs):
        here = (fold_from <= fold_step) & (fold_step < fold_from + fold_steps)
        within = fold_step - tl.sum(tl.where(here, fold_from, 0), axis=0)
        index = within * FOLD + tl.arange(0, FOLD).to(tl.int64)
        source = area + tl.sum(tl.where(here, check_of, 0), axis=0)
        magnitudes = _load_magnitudes(source, index, tl.sum(tl.where(here, limit_of, 0), axis=0), code)
        largest = tl.max(magnitudes.to(tl.int32, bitcast=True), axis=0).to(tl.int64)
        tl.atomic_max(partials + tl.sum(tl.where(here, launch_of, 0), axis=0), largest, sem="relaxed")
    tl.debug_barrier()  # this program's copies and folds (every thread's) before the fenced atomic below
    arrived = tl.atomic_add(counter, 1)  # acq_rel: this program's copies and maxima before its "done"
    if arrived == programs - 1:  # the last program: every other one's maxima are in the partial words
        seq0 = _batch_reset(counter, arrive_cell, ready_cell, sequence_cell)
        largest_of = tl.atomic_xchg(partials + launch_of, tl.zeros_like(lanes), mask=live, sem="relaxed")
        sequences = seq0 + lanes
        generation = ((sequences // tags) + 1) & 0x7FFFFFFF
        slot = words.to(tl.pointer_type(tl.int64)) + sequences % tags
        tl.store(slot, (generation << 32) | largest_of, mask=live)


def compile_kernel(
    device_index: int, *, stage: bool = False, batch: bool = False, compact: bool = False
) -> Any:
    """:func:`graph_record` as ``launch(programs, stream, args)`` (see ``ring_kernel.compile_launcher``);
    ``stage``: the staging variant (``STAGE`` 1); ``batch``: :func:`graph_record_batch` instead (``compact``: its
    one-loop form, :func:`graph_record_batch_compact`, the same arguments)."""
    if batch and compact:
        constants = {"BLOCK": BLOCK, "FOLD": FOLD, "LANES": LANES}
        return compile_launcher(
            graph_record_batch_compact,
            len(BATCH_INTS),
            constants,
            device_index,
            name="graph record batch (compact)",
            num_warps=LANES // 32,
        )
    if batch:
        constants = {"BLOCK": BLOCK, "FOLD": FOLD}
        return compile_launcher(
            graph_record_batch, len(BATCH_INTS), constants, device_index, name="graph record batch"
        )
    constants = {"BLOCK": STAGE_BLOCK if stage else BLOCK, "FOLD": FOLD, "STAGE": int(stage)}
    return compile_launcher(graph_record, len(RECORD_INTS), constants, device_index, name="graph record")
