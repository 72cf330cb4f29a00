"""``graph_record`` run by Triton's interpreter on host memory (``TRITON_INTERPRET=1``), through the arguments
:meth:`GraphRing.capture` builds: a decode-sized gpt-oss layer call (one token, 18 spans of sizes that break 8-byte
words — 33+ int32 token offsets behind 4- and 8-byte leads — one node, alone), eight tokens (the node's three
programs share the entry through the arrive/ready handshake), forty tokens (three spans, three programs) and 26
spans (two nodes sharing one entry); the first and the last again staged (the STAGE variant's copy into a
staging slot, then one record node reading the slot), and eight tokens staged under a stage limit above the lone
size (the record node's three programs read the slot). Three replays each: every span's bytes in its entry, the tag word's magnitude, the metadata row, the
launch's cells reset. Prints one line per case; run by ``test_ring_kernels_triton.py``."""

from __future__ import annotations

import torch
from aligned_pool import AlignedPool

from moereplay.capture import graph_ring, graph_ring_kernel
from moereplay.capture.device_ring import ALIGNMENT
from moereplay.capture.graph_ring import GraphRing, Spans

placed = AlignedPool(1 << 24).take  # (count, dtype, lead): as a view into a CUDA storage, a slot apart


GRAPH: list[tuple[int, list[int], int]] = []
COMPACT = [False]  # the batch nodes run graph_record_batch_compact (MOEREPLAY_FLIGHT_GRAPH_COMPACT)


def capture_launch(programs: int, stream: int, args: list[int]) -> None:
    GRAPH.append((programs, list(args), 0))


def capture_stage(programs: int, stream: int, args: list[int]) -> None:
    GRAPH.append((programs, list(args), 1))


def capture_batch(programs: int, stream: int, args: list[int]) -> None:
    GRAPH.append((programs, list(args), 2))


class Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle

    def wait_stream(self, other: Stream) -> None:
        pass  # the interpreter runs the nodes in capture order, which the fork and join edges allow


def replay() -> None:
    for programs, args, stage in GRAPH:
        if stage == 2 and COMPACT[0]:
            graph_ring_kernel.graph_record_batch_compact[(programs,)](
                *args,
                BLOCK=graph_ring_kernel.BLOCK,
                FOLD=graph_ring_kernel.FOLD,
                LANES=graph_ring_kernel.LANES,
            )
            continue
        if stage == 2:
            graph_ring_kernel.graph_record_batch[(programs,)](
                *args, BLOCK=graph_ring_kernel.BLOCK, FOLD=graph_ring_kernel.FOLD
            )
            continue
        block = graph_ring_kernel.STAGE_BLOCK if stage else graph_ring_kernel.BLOCK
        graph_ring_kernel.graph_record[(programs,)](
            *args, BLOCK=block, FOLD=graph_ring_kernel.FOLD, STAGE=stage
        )


def case(
    tokens: int,
    span_count: int,
    staged: bool = False,
    real: int | None = None,
    stage_bytes: int | None = None,
) -> None:
    """``real``: the step's token count, read at replay (rows past it are padding: NaN here, not checked);
    ``stage_bytes``: the ring's stage limit (entries larger than lone ones staged too)."""
    GRAPH.clear()
    ring = GraphRing(1 << 21, torch.device("cpu"), tags=8, launches=4, use_kernel=False)
    if stage_bytes is not None:
        ring.stage_bytes = stage_bytes
    ring.kernels = capture_launch
    if (
        staged
    ):  # a graph opened for staging: the STAGE variant's copy, then the record node on the side stream
        ring.stage_kernel = capture_stage
        ring.stage = placed(1 << 18, torch.uint8)
        ring._open[0] = graph_ring._Open(Stream(0), Stream(1))
    tensors = [placed(tokens * 2880, torch.bfloat16)]
    tensors += [placed(33 + i, torch.int32, 4 * (i % 3)) for i in range(span_count - 2)]
    out = placed(tokens * 2880, torch.bfloat16)
    tensors.append(out)
    leads = [tensor.data_ptr() & 255 for tensor in tensors]
    sources = [tensor.data_ptr() - lead for tensor, lead in zip(tensors, leads, strict=True)]
    sizes = [tensor.nbytes + lead for tensor, lead in zip(tensors, leads, strict=True)]
    offsets = [sum(-(-size // ALIGNMENT) * ALIGNMENT for size in sizes[:i]) for i in range(len(sizes))]
    total = offsets[-1] + -(-sizes[-1] // ALIGNMENT) * ALIGNMENT
    count = placed(1, torch.int32)
    count.fill_(real if real is not None else 0)
    limit = (count.data_ptr(), 2880) if real is not None else None
    spans = Spans(
        tuple(sources), tuple(offsets), tuple(sizes), (out.data_ptr(), out.numel(), 2), total, limit
    )
    programs = ring.capture(0, spans, first=True)
    ring.buffer.fill_(0xA5)
    right = True
    for replay_index in range(3):
        for i, tensor in enumerate(tensors):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.numel()) * (replay_index + 1))
            else:
                tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype) * (replay_index + 7) + i)
        if replay_index == 2:
            out[-1] = float("inf")  # the last element: the last program's block
        if real is not None:
            out[real * 2880 :] = float(
                "nan"
            )  # padding rows (2,880 elements a row): whatever the buffers held
        replay()
        start = int(ring.meta[replay_index][1])
        for tensor, offset, lead, size in zip(tensors, offsets, leads, sizes, strict=True):
            right &= torch.equal(
                ring.view(start, offset + lead, size - lead), tensor.view(torch.uint8).flatten()
            )
        word = int(ring.words[replay_index])
        checked = out if real is None else out[: real * 2880]
        largest = int(torch.tensor(float(checked.float().abs().max())).view(torch.int32))
        right &= word >> 32 == 1 and (word & 0xFFFFFFFF) == largest
        tokens_seen = -1 if real is None else real
        right &= ring.meta[replay_index].tolist() == [replay_index, start, 0, replay_index + 1, tokens_seen]
        right &= ring.cells[2:6, 0].tolist() == [0, 0, 0, 0]
    nodes = f"{len(GRAPH)} nodes ({sum(stage for _, _, stage in GRAPH)} staging)"
    counted = "" if real is None else f", {real} real"
    print(
        f"tokens {tokens}{counted}, {span_count} spans: {nodes}, {programs} programs; entries right: {right}"
    )


def batch_case(
    tokens: int,
    layers: int,
    capacity: int,
    real: int | None = None,
    chunk: int | None = None,
    firsts: tuple[int, ...] = (0,),
    unchecked: int | None = None,
    stage: int = 1 << 18,
) -> None:
    """``layers`` layer calls of three spans each (hidden states, router logits, output) staged in one graph whose
    batch node records them all (``MOEREPLAY_FLIGHT_GRAPH_BATCH``); ``chunk``: entries a batch node takes (the
    kernel's BATCH, lowered: more nodes). Five replays in a ring of ``capacity`` bytes (entries past its end go
    where their own reservations would have put them); checks each entry's bytes, tag word and metadata row.
    ``firsts``: the layers whose launches bump the step (each starts a batch node); ``unchecked``: a layer whose
    output is not checked (its tag word's magnitude 0); ``stage``: the staging area's bytes."""
    GRAPH.clear()
    # (launch ids and tag slots for every layer and batch node; the ring's own defaults are far larger)
    ring = GraphRing(
        capacity, torch.device("cpu"), tags=max(16, 2 * layers), launches=8 + layers, use_kernel=False
    )
    ring.stage_bytes = 1 << 20
    ring.kernels = capture_launch
    ring.stage_kernel = capture_stage
    ring.batch_kernel = capture_batch
    ring.stage = placed(stage, torch.uint8)
    ring._open[0] = graph_ring._Open(Stream(0), Stream(1))
    batch_size = graph_ring.BATCH
    if chunk is not None:
        graph_ring.BATCH = chunk
    count = placed(1, torch.int32)
    count.fill_(real if real is not None else 0)
    calls = []
    for layer in range(layers):
        hidden = placed(tokens * 2880, torch.bfloat16)
        logits = placed(tokens * 32, torch.bfloat16, 2 * (layer % 2))  # a lead of 2 bytes: not on a word
        out = placed(tokens * 2880, torch.bfloat16)
        tensors = [hidden, logits, out]
        leads = [tensor.data_ptr() & 255 for tensor in tensors]
        sizes = [tensor.nbytes + lead for tensor, lead in zip(tensors, leads, strict=True)]
        offsets = [sum(-(-size // ALIGNMENT) * ALIGNMENT for size in sizes[:i]) for i in range(3)]
        total = offsets[-1] + -(-sizes[-1] // ALIGNMENT) * ALIGNMENT
        sources = [tensor.data_ptr() - lead for tensor, lead in zip(tensors, leads, strict=True)]
        limit = (count.data_ptr(), 2880) if real is not None else None
        probe = None if layer == unchecked else (out.data_ptr(), out.numel(), 2)
        spans = Spans(tuple(sources), tuple(offsets), tuple(sizes), probe, total, limit)
        launch = ring.new_launch()
        assert launch is not None
        ring.capture(launch, spans, first=layer in firsts)
        calls.append((launch, tensors, leads, sizes, offsets))
    ring.close_capture(0)
    graph_ring.BATCH = batch_size
    ring.buffer.fill_(0xA5)
    right = True
    for replay_index in range(5):
        for layer, (_, tensors, _, _, _) in enumerate(calls):
            for tensor in tensors:
                tensor.copy_(torch.randn(tensor.numel()) * (replay_index + layer + 1))
            if (replay_index + layer) % 3 == 0:
                tensors[2][-1] = float("inf")
            if real is not None:
                tensors[2][real * 2880 :] = float("nan")  # padding rows: not checked
        replay()
        for layer, (launch, tensors, leads, sizes, offsets) in enumerate(calls):
            sequence = replay_index * layers + layer
            row = ring.meta[sequence % ring.tags].tolist()
            start = row[1]
            step = replay_index * len(firsts) + sum(first <= layer for first in firsts)
            right &= row == [sequence, start, launch, step, -1 if real is None else real]
            for tensor, offset, lead, size in zip(tensors, offsets, leads, sizes, strict=True):
                right &= torch.equal(
                    ring.view(start, offset + lead, size - lead), tensor.view(torch.uint8).flatten()
                )
            checked = tensors[2] if real is None else tensors[2][: real * 2880]
            largest = int(torch.tensor(float(checked.float().abs().max())).view(torch.int32))
            if layer == unchecked:
                largest = 0
            word = int(ring.words[sequence % ring.tags])
            right &= word >> 32 == sequence // ring.tags + 1 and (word & 0xFFFFFFFF) == largest
        right &= int(ring.host[ring.tags]) == (replay_index + 1) * layers  # the hint
        right &= not ring.cells[2:6].any().item()  # every partial, counter and handshake cell reset
    wrapped = int(ring.state[0]) > ring.capacity
    kinds = [stage for _, _, stage in GRAPH]
    counted = "" if real is None else f", {real} real"
    counted += " (compact)" if COMPACT[0] else ""
    print(
        f"batch: {layers} layers of {tokens} tokens{counted}: {kinds.count(1)} staging nodes, {kinds.count(2)} "
        f"batch node(s), {kinds.count(0)} record nodes, wrapped {wrapped}; entries right: {right}"
    )


def main() -> None:
    graph_ring._current_stream = lambda index: 0  # type: ignore[assignment]
    graph_ring._programs = lambda index: 3  # type: ignore[assignment]
    for tokens, span_count in ((1, 18), (8, 18), (40, 3), (1, 26)):
        case(tokens, span_count)
    case(1, 18, staged=True)  # the served gpt-oss decode call, staged off the graph's path
    case(1, 26, staged=True)  # two staging nodes, one record node
    case(
        8, 18, real=6
    )  # a padded batch: the count in the metadata row, padding rows unchecked (shared entry)
    case(2, 18, staged=True, real=1)  # the same through the staged record node
    case(8, 26, real=5)  # two nodes: the reserving one stores the count, the last one limits its check
    # an entry larger than a lone one, staged (MOEREPLAY_FLIGHT_GRAPH_STAGE): the record node on the side stream
    # runs three programs through the handshake, reading the slot and the count
    case(8, 18, staged=True, real=6, stage_bytes=1 << 20)
    # MOEREPLAY_FLIGHT_GRAPH_BATCH: the staged entries of a graph recorded by one node at its end, by either kernel
    for compact in (False, True):
        COMPACT[0] = compact
        batch_case(4, 3, 1 << 18)  # three programs share the batch; the ring wraps within five replays
        batch_case(4, 5, 1 << 18, real=3, chunk=2)  # padded rows; three batch nodes of 2, 2 and 1 entries
        batch_case(1, 2, 1 << 20)  # lone entries (decode batch 1): one program, no handshake
        # two launches that bump the step (dual batch overlap's two micro-batches): a batch node each, every entry
        # with the step it ran in; the second layer's output unchecked
        batch_case(4, 4, 1 << 18, firsts=(0, 2), unchecked=1)
        # one-token entries of 47 × 256 bytes (S): at the third replay an entry starts exactly at the ring's end
        # (the ring's start: the copy's split on the boundary) — three programs in a ring of 8 S, and one program
        # (two lone entries) in a ring of 5 S
        batch_case(1, 3, 8 * 12032, stage=1 << 20)
        batch_case(1, 2, 5 * 12032, stage=1 << 20)
    # a full batch: 24 layers of a decode token, every lane of the compact kernel's vectors, the ring wrapping
    batch_case(1, 24, 1 << 19, stage=1 << 20)


if __name__ == "__main__":
    main()
