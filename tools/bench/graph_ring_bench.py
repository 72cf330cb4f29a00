"""What one graph-ring node costs per layer call inside a CUDA graph (the layer-scope flight recorder under graphs).

A graph of ``--layers`` stand-in layer calls (one small in-place kernel each, decode-sized: 1 × 2880 bf16) is
captured bare and with :class:`~moereplay.capture.graph_ring.GraphRing` record nodes after each call, in variants
that isolate where a node's time goes:

- ``ring-2``: two spans (input and output, 5.6 KB each) — the smallest real entry;
- ``ring-12``: those and ten 64-byte spans (routing metadata of a gpt-oss layer call at batch 1);
- ``ring-12-devwords``: as ``ring-12`` with the tag and hint words in device memory instead of host-mapped memory
  (what the stores over PCIe cost; not a usable recorder: the writer thread could not read them);
- ``ring-12-nocheck``: as ``ring-12`` without the output's magnitude fold;
- ``ring-12-relaxed``: as ``ring-12`` with a copy of the kernel whose atomics are relaxed except the ``ready``
  handshake (release/acquire) and the ``done`` counter (Triton's default is acq_rel, a fence each).

Interleaved rounds, CUDA-event time per replay, medians; prints µs per layer call over the bare graph.

    python3 tools/bench/graph_ring_bench.py [--layers 24] [--rounds 7] [--replays 300]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from moereplay.capture.graph_ring import ALIGNMENT, GraphRing, Spans
from moereplay.capture.graph_ring_kernel import BLOCK, RECORD_INTS, _copy, _fold
from moereplay.capture.ring_kernel import compile_launcher


# experiment: graph_ring_kernel.graph_record with relaxed atomics except the ready handshake and the done counter
@triton.jit(do_not_specialize=RECORD_INTS)
def graph_record_relaxed(
    s0, o0, n0, s1, o1, n1, s2, o2, n2, s3, o3, n3, s4, o4, n4, s5, o5, n5, s6, o6, n6, s7, o7, n7,
    s8, o8, n8, s9, o9, n9, s10, o10, n10, s11, o11, n11, s12, o12, n12, s13, o13, n13, s14, o14, n14,
    s15, o15, n15,
    check, numel, code, aligned, finish, reserve, total, first,
    state, meta, hint, buffer, capacity, launch, cells, launches, words, tags,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    column = cells.to(tl.pointer_type(tl.int64)) + launch
    start_cell = column + 0 * launches  # CELL_START
    sequence_cell = column + 1 * launches  # CELL_SEQUENCE
    ready_cell = column + 5 * launches  # CELL_READY
    arrive_cell = column + 4 * launches  # CELL_ARRIVE
    if reserve != 0:
        if tl.atomic_add(arrive_cell, 1, sem="relaxed") == 0:
            state_cells = state.to(tl.pointer_type(tl.int64))
            head = tl.atomic_add(state_cells, total, sem="relaxed")
            sequence = tl.atomic_add(state_cells + 1, 1, sem="relaxed")
            step = tl.atomic_add(state_cells + 2, first, sem="relaxed") + first
            tl.atomic_xchg(start_cell, head, sem="relaxed")
            tl.atomic_xchg(sequence_cell, sequence, sem="relaxed")
            row = meta.to(tl.pointer_type(tl.int64)) + (sequence % tags) * 4
            tl.store(row, sequence)
            tl.store(row + 1, head)
            tl.store(row + 2, launch)
            tl.store(row + 3, step)
            tl.store(hint.to(tl.pointer_type(tl.int64)), sequence + 1)
            tl.atomic_xchg(ready_cell, 1, sem="release")  # release: the cells above before "ready"
        ready = tl.atomic_add(ready_cell, 0, sem="acquire")
        while ready == 0:  # only programs that arrived after the reserving one, which is running: no deadlock
            ready = tl.atomic_add(ready_cell, 0, sem="acquire")
    start = tl.atomic_add(
        start_cell, 0, sem="relaxed"
    )  # through L2: never a stale L1 line of an earlier replay
    target = buffer + start % capacity
    _copy(s0, target + o0, n0, aligned, pid, programs, BLOCK)
    _copy(s1, target + o1, n1, aligned, pid, programs, BLOCK)
    _copy(s2, target + o2, n2, aligned, pid, programs, BLOCK)
    _copy(s3, target + o3, n3, aligned, pid, programs, BLOCK)
    _copy(s4, target + o4, n4, aligned, pid, programs, BLOCK)
    _copy(s5, target + o5, n5, aligned, pid, programs, BLOCK)
    _copy(s6, target + o6, n6, aligned, pid, programs, BLOCK)
    _copy(s7, target + o7, n7, aligned, pid, programs, BLOCK)
    _copy(s8, target + o8, n8, aligned, pid, programs, BLOCK)
    _copy(s9, target + o9, n9, aligned, pid, programs, BLOCK)
    _copy(s10, target + o10, n10, aligned, pid, programs, BLOCK)
    _copy(s11, target + o11, n11, aligned, pid, programs, BLOCK)
    _copy(s12, target + o12, n12, aligned, pid, programs, BLOCK)
    _copy(s13, target + o13, n13, aligned, pid, programs, BLOCK)
    _copy(s14, target + o14, n14, aligned, pid, programs, BLOCK)
    _copy(s15, target + o15, n15, aligned, pid, programs, BLOCK)
    if finish != 0:
        best = tl.zeros([BLOCK], dtype=tl.int32)
        if code == 1:
            best = _fold(best, check, numel, pid, programs, tl.float16, BLOCK)
        if code == 2:
            best = _fold(best, check, numel, pid, programs, tl.bfloat16, BLOCK)
        if code == 3:
            best = _fold(best, check, numel, pid, programs, tl.float32, BLOCK)
        largest = tl.max(best, axis=0).to(tl.int64)
        partial = column + 2 * launches  # CELL_PARTIAL
        counter = column + 3 * launches  # CELL_DONE
        tl.atomic_max(partial, largest, sem="relaxed")
        tl.debug_barrier()  # this program's copies and its max before its "done" (acq_rel below)
        arrived = tl.atomic_add(counter, 1)
        if arrived == programs - 1:  # the last program: every other one's max is in the word
            word = tl.atomic_xchg(partial, 0, sem="relaxed")
            tl.atomic_xchg(counter, 0, sem="relaxed")
            tl.atomic_xchg(arrive_cell, 0, sem="relaxed")
            tl.atomic_xchg(ready_cell, 0, sem="relaxed")
            sequence = tl.atomic_add(sequence_cell, 0, sem="relaxed")
            generation = ((sequence // tags) + 1) & 0x7FFFFFFF
            slot = words.to(tl.pointer_type(tl.int64)) + sequence % tags
            tl.store(slot, (generation << 32) | word)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--replays", type=int, default=300)
    options = parser.parse_args()
    device = torch.device("cuda", 0)
    layers = options.layers
    inputs = [torch.randn(1, 2880, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    outputs = [torch.randn(1, 2880, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    small = [[torch.zeros(16, device=device, dtype=torch.int32) for _ in range(10)] for _ in range(layers)]
    keep: list[torch.Tensor] = []

    def spans(i: int, extra: int, check: bool) -> Spans:
        tensors = [inputs[i], outputs[i], *small[i][:extra]]
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += -(-size // ALIGNMENT) * ALIGNMENT
        probe = (outputs[i].data_ptr(), outputs[i].numel(), 2) if check else None
        return Spans(tuple(t.data_ptr() for t in tensors), tuple(offsets), tuple(sizes), probe, at)

    def build(variant: str) -> torch.cuda.CUDAGraph:
        ring = None
        if variant != "bare":
            ring = GraphRing(64 << 20, device, launches=layers + 8)
            if variant.endswith("relaxed"):
                ring.kernels = compile_launcher(
                    graph_record_relaxed, len(RECORD_INTS), {"BLOCK": BLOCK}, 0, name="relaxed"
                )
            if variant.endswith("devwords"):
                words = torch.zeros(ring.tags + 1, dtype=torch.int64, device=device)
                keep.append(words)
                ring._host_address = words.data_ptr()
        extra = 0 if variant == "ring-2" else 10
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for i in range(layers):
                torch.add(inputs[i], 1.0, out=outputs[i])  # the "layer call"
                if ring is not None:
                    launch = ring.new_launch()
                    assert launch is not None
                    ring.capture(launch, spans(i, extra, not variant.endswith("nocheck")), first=i == 0)
        return graph

    variants = ["bare", "ring-2", "ring-12", "ring-12-devwords", "ring-12-nocheck", "ring-12-relaxed"]
    graphs = {variant: build(variant) for variant in variants}
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for graph in graphs.values():
        graph.replay()
    for round_ in range(options.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for variant in order:
            torch.cuda.synchronize()
            start.record()
            for _ in range(options.replays):
                graphs[variant].replay()
            end.record()
            end.synchronize()
            times[variant].append(start.elapsed_time(end) * 1e3 / options.replays)
    bare = statistics.median(times["bare"])
    print(
        f"graph_ring_bench: {layers} layer calls a graph, median of {options.rounds} rounds × {options.replays} replays"
    )
    for variant in variants:
        median = statistics.median(times[variant])
        per_call = (median - bare) / layers
        print(f"{variant:18s} {median:9.1f} µs a replay   {per_call:6.2f} µs a layer call over bare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
