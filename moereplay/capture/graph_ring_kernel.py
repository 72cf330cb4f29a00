"""The two Triton kernels behind :class:`moereplay.capture.graph_ring.GraphRing` (imported only where Triton is).

Captured into a CUDA graph after each recorded layer call, they run on every replay of it with no host work:

- :func:`graph_reserve` (one program, one warp): ``atomic_add`` the entry's byte size (fixed at capture) to the
  ring's device ``head`` and 1 to its device ``sequence``, bump the graph ``step`` when the launch is the first
  MoE layer's, note start and sequence in the launch's own cells (read by the copy kernel next in the stream) and
  in the sequence's metadata row ``(sequence, start, launch, step)``, and store ``sequence + 1`` into the host's
  hint word (host-mapped memory: how far the device has reserved, read by the writer thread without a CUDA call);
- :func:`graph_copy` (many programs): copy up to eight byte spans (fixed addresses and sizes, captured) to the
  entry's place in the ring, fold the largest magnitude of one float output into the launch's device word with
  ``atomic_max``; the last program to finish (``atomic_add`` on the launch's ``done`` counter) takes that word
  (resetting it and ``done`` for the next replay) and stores the finished tag word
  ``generation << 32 | bits(max |x|)`` of the sequence into the host-mapped tag array — one aligned 8-byte store,
  never an atomic over PCIe.

Every argument is a 64-bit integer (addresses, sizes, the launch id, runtime flags: ``code`` 0 none, 1 float16,
2 bfloat16, 3 float32; ``aligned`` 8-byte words; ``finish`` the last copy kernel of a launch), so each kernel
compiles once per device (:func:`compile_kernels`) before any capture: nothing is compiled while a graph is
being captured.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from moereplay.capture.ring_kernel import _copy_span, compile_launcher

BLOCK = 1024
"""Elements per program and loop step (bytes, or 8-byte words when aligned) — as the eager ring kernel's."""

RESERVE_INTS = ["state", "meta", "launch", "starts", "sequences", "total", "first", "tags", "hint"]
COPY_INTS = [
    "s0", "o0", "n0", "s1", "o1", "n1", "s2", "o2", "n2", "s3", "o3", "n3",
    "s4", "o4", "n4", "s5", "o5", "n5", "s6", "o6", "n6", "s7", "o7", "n7",
    "check", "numel", "code", "aligned", "finish",
    "buffer", "capacity", "launch", "starts", "sequences", "partials", "done", "words", "tags",
]  # fmt: skip


@triton.jit(do_not_specialize=RESERVE_INTS)
def graph_reserve(state, meta, launch, starts, sequences, total, first, tags, hint):
    cells = state.to(tl.pointer_type(tl.int64))
    head = tl.atomic_add(cells, total)
    sequence = tl.atomic_add(cells + 1, 1)
    step = tl.atomic_add(cells + 2, first) + first
    tl.store(starts.to(tl.pointer_type(tl.int64)) + launch, head)
    tl.store(sequences.to(tl.pointer_type(tl.int64)) + launch, sequence)
    row = meta.to(tl.pointer_type(tl.int64)) + (sequence % tags) * 4
    tl.store(row, sequence)
    tl.store(row + 1, head)
    tl.store(row + 2, launch)
    tl.store(row + 3, step)
    tl.store(hint.to(tl.pointer_type(tl.int64)), sequence + 1)


@triton.jit
def _fold(best, check, numel, pid, programs, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    values = check.to(tl.pointer_type(DTYPE))
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(pid * BLOCK, numel, programs * BLOCK):
        index = start + offsets
        x = tl.load(values + index, mask=index < numel, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.abs(x).to(tl.int32, bitcast=True))
    return best


@triton.jit
def _copy(source, target, size, aligned, pid, programs, BLOCK: tl.constexpr):
    if aligned != 0:
        _copy_span(source, target, size, pid, programs, True, BLOCK)
    else:
        _copy_span(source, target, size, pid, programs, False, BLOCK)


@triton.jit(do_not_specialize=COPY_INTS)
def graph_copy(
    s0, o0, n0, s1, o1, n1, s2, o2, n2, s3, o3, n3,
    s4, o4, n4, s5, o5, n5, s6, o6, n6, s7, o7, n7,
    check, numel, code, aligned, finish,
    buffer, capacity, launch, starts, sequences, partials, done, words, tags,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    start = tl.load(starts.to(tl.pointer_type(tl.int64)) + launch)
    target = buffer + start % capacity
    _copy(s0, target + o0, n0, aligned, pid, programs, BLOCK)
    _copy(s1, target + o1, n1, aligned, pid, programs, BLOCK)
    _copy(s2, target + o2, n2, aligned, pid, programs, BLOCK)
    _copy(s3, target + o3, n3, aligned, pid, programs, BLOCK)
    _copy(s4, target + o4, n4, aligned, pid, programs, BLOCK)
    _copy(s5, target + o5, n5, aligned, pid, programs, BLOCK)
    _copy(s6, target + o6, n6, aligned, pid, programs, BLOCK)
    _copy(s7, target + o7, n7, aligned, pid, programs, BLOCK)
    if finish != 0:
        best = tl.zeros([BLOCK], dtype=tl.int32)
        if code == 1:
            best = _fold(best, check, numel, pid, programs, tl.float16, BLOCK)
        if code == 2:
            best = _fold(best, check, numel, pid, programs, tl.bfloat16, BLOCK)
        if code == 3:
            best = _fold(best, check, numel, pid, programs, tl.float32, BLOCK)
        largest = tl.max(best, axis=0).to(tl.int64)
        partial = partials.to(tl.pointer_type(tl.int64)) + launch
        counter = done.to(tl.pointer_type(tl.int64)) + launch
        tl.atomic_max(partial, largest)
        tl.debug_barrier()  # this program's copies and its max before its "done" (acq_rel below)
        arrived = tl.atomic_add(counter, 1)
        if arrived == programs - 1:  # the last program: every other one's max is in the word
            word = tl.atomic_xchg(partial, 0)
            tl.atomic_xchg(counter, 0)
            sequence = tl.load(sequences.to(tl.pointer_type(tl.int64)) + launch)
            generation = ((sequence // tags) + 1) & 0x7FFFFFFF
            slot = words.to(tl.pointer_type(tl.int64)) + sequence % tags
            tl.store(slot, (generation << 32) | word)


def compile_kernels(device_index: int) -> tuple[Any, Any]:
    """``(reserve, copy)``: each ``launch(programs, stream, args)`` (see ``ring_kernel.compile_launcher``)."""
    reserve = compile_launcher(
        graph_reserve, len(RESERVE_INTS), {}, device_index, name="graph reserve", num_warps=1
    )
    copy = compile_launcher(graph_copy, len(COPY_INTS), {"BLOCK": BLOCK}, device_index, name="graph copy")
    return reserve, copy
