"""What one graph-ring node costs per layer call inside a CUDA graph (the layer-scope flight recorder under graphs).

A graph of ``--layers`` stand-in layer calls (one small in-place kernel each, decode-sized: 1 × 2880 bf16) is
captured bare and with :class:`~moereplay.capture.graph_ring.GraphRing` record nodes after each call, in variants
that isolate where a node's time goes:

- ``ring-2``: two spans (input and output, 5.6 KB each) — the smallest real entry;
- ``ring-12``: those and ten 64-byte spans (routing metadata of a gpt-oss layer call at batch 1);
- ``ring-12-devwords``: as ``ring-12`` with the tag and hint words in device memory instead of host-mapped memory
  (what the stores over PCIe cost; not a usable recorder: the writer thread could not read them);
- ``ring-12-nocheck``: as ``ring-12`` without the output's magnitude fold;
- ``ring-12-shared``: as ``ring-12`` but run by three programs (2,880 output elements to fold) sharing the entry through the arrive/ready/done
  handshake (what entries over ``graph_ring.ALONE_BYTES`` do), so the lone-program path's saving shows;
- ``ring-18-oss``: what a served gpt-oss decode layer call at batch 1 keeps — input, output and 16 routing spans
  (``triton_kernel_fused_experts``' RoutingData / ExptData / gather / scatter tensors at one token, top-4, 32
  experts), most of whose sizes (33 int32 token offsets: 132 bytes) break 8-byte words. Until 2026-12-05 such a
  call took two nodes (16 spans a node) that copied byte by byte; the served cost (≈ 15 µs a layer call) was twice
  ``ring-12``'s;
- ``ring-18-staged``: the same entries staged (2026-12-05, tenth session; the ring's stage limit lifted, so
  they are staged at ``--tokens`` above 1 too, where they outgrow the lone size): on the graph's path only the
  STAGE variant's copy into each launch's staging slot; the record nodes on a side stream, forked after each copy
  and joined at the capture's end (what the graph gate's hooks do for a served capture). Its record nodes run one
  after another on the side stream, and with these ≈ 1.4 µs stand-in layers that chain outlasts the graph's path:
  the figure is bounded by it (``graph_ring_ablation``'s ``staged-path`` measures the path alone);
- ``ring-3-forward``: what a served gpt-oss layer call keeps since 2026-12-06, ``triton_kernel_moe_forward`` —
  hidden states, router logits (``--experts`` bf16 a token) and output, the output checked; with ``--tokens 32``
  (a decode batch of 32: ≈ 370 KB, 92,160 elements to fold) a node of many programs sharing the entry through the
  handshake, where batch 1 runs alone;
- ``ring-3-forward-nocheck``: the same without the fold (what folding 32 rows costs);
- ``ring-3-forward-alone``: the same entry run by one program whatever its size (``graph_ring.ALONE_BYTES`` and
  ``ALONE_ELEMENTS`` lifted while it is captured): at 32 tokens, one SM's copy and fold against the handshake of
  many programs;
- ``ring-3-forward-staged``: the same entry staged (the ring's stage limit lifted, as
  ``MOEREPLAY_FLIGHT_GRAPH_STAGE`` does): on the graph's path only the many-program staging copy, the record node
  (many programs at 32 tokens) on the side stream; the replay's time includes the side chain, joined at the
  capture's end;
- ``ring-3-forward-batch``: the same entries staged and recorded by one batch node at the graph's end
  (``MOEREPLAY_FLIGHT_GRAPH_BATCH``): on the path a copy per layer call, then one node for all 24;
  ``ring-3-forward-batch-x4``: the same with each staging copy allowed four times the programs
  (``GraphRing.stage_waves``); ``ring-3-forward-batch-compact``: the batch node's one-loop kernel
  (``MOEREPLAY_FLIGHT_GRAPH_COMPACT``; 205 KiB of sm_90 code against the unrolled one's 3.7 MB).

``--tokens`` sets the rows of every variant's input and output (the stand-in layer's too); the routing spans keep
their batch-1 sizes.

Interleaved rounds, CUDA-event time per replay, medians; prints µs per layer call over the bare graph.

    python3 tools/bench/graph_ring_bench.py [--layers 24] [--rounds 7] [--replays 300] [--tokens 1] [--thrash 0]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from moereplay.capture import graph_ring
from moereplay.capture.graph_ring import ALIGNMENT, GraphRing, Spans

ROUTING_BYTES = (16, 128, 128, 132, 132, 132, 132, 132, 160, 144, 136, 132, 16, 16, 16, 16)
"""The routing spans of a served gpt-oss decode layer call at batch 1 (``triton_kernel_fused_experts``' RoutingData /
ExptData / gather / scatter tensors at one token, top-4, 32 experts)."""


def entry_spans(tensors: list[torch.Tensor], check: torch.Tensor | None) -> Spans:
    """One entry of ``tensors`` (each in its own 256-byte-aligned span), checking bfloat16 ``check`` if given."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // ALIGNMENT) * ALIGNMENT
    probe = (check.data_ptr(), check.numel(), 2) if check is not None else None
    return Spans(tuple(t.data_ptr() for t in tensors), tuple(offsets), tuple(sizes), probe, at)


def capture_layers(
    ring: GraphRing | None,
    inputs: list[torch.Tensor],
    outputs: list[torch.Tensor],
    spans_of: Callable[[int], Spans],
    *,
    staged: bool,
    other: Callable[[int], object] | None = None,
    before: Callable[[int], object] | None = None,
) -> torch.cuda.CUDAGraph:
    """One graph of ``len(inputs)`` stand-in layer calls (an add each), captured on a stream of its own; after each,
    the ring's record node(s) of ``spans_of(i)``, or ``other(i)`` without a ring. ``staged``: the capture is opened
    for staging and joined at its end, as the graph gate's hooks do around a served capture. ``before(i)`` runs
    before each layer call (:class:`Thrash`)."""
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        handle = ring.open_capture() if ring is not None and staged else None
        for i in range(len(inputs)):
            if before is not None:
                before(i)
            torch.add(inputs[i], 1.0, out=outputs[i])  # the "layer call"
            if ring is not None:
                launch = ring.new_launch()
                assert launch is not None
                ring.capture(launch, spans_of(i), first=i == 0)
            elif other is not None:
                other(i)
        if ring is not None:
            ring.close_capture(handle)
    return graph


class Thrash:
    """``--thrash MB``: before each stand-in layer call, a reduction reading that layer's own ``MB`` megabytes (a
    served MoE layer streams its experts' weights: ≈ 400 MB a gpt-oss layer at a decode batch of 32), so the L2
    cache no longer holds what the previous replay left there — the ring's state, cells and metadata rows, which a
    node's dependent atomics read — as it does when the stand-in layers touch a few kilobytes."""

    def __init__(self, megabytes: int, layers: int, device: torch.device) -> None:
        elements = megabytes * (1 << 20) // 4
        self.chunks = [torch.ones(elements, device=device) for _ in range(layers)] if megabytes else []
        self.sinks = torch.zeros(layers, device=device)

    def __call__(self, i: int) -> None:
        torch.sum(self.chunks[i], dim=0, out=self.sinks[i])

    @property
    def before(self) -> Callable[[int], object] | None:
        return self if self.chunks else None


def time_and_report(
    name: str, graphs: dict[str, torch.cuda.CUDAGraph], layers: int, rounds: int, replays: int
) -> None:
    """Replay every graph ``replays`` times a round, the order rotating between rounds (CUDA-event time), and print
    each one's median µs a replay and µs a layer call over the ``bare`` graph."""
    times: dict[str, list[float]] = {variant: [] for variant in graphs}
    variants = list(graphs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for graph in graphs.values():
        graph.replay()
    for round_ in range(rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for variant in order:
            torch.cuda.synchronize()
            start.record()
            for _ in range(replays):
                graphs[variant].replay()
            end.record()
            end.synchronize()
            times[variant].append(start.elapsed_time(end) * 1e3 / replays)
    bare = statistics.median(times["bare"])
    print(f"{name}: {layers} layer calls a graph, median of {rounds} rounds × {replays} replays")
    for variant in variants:
        median = statistics.median(times[variant])
        per_call = (median - bare) / layers
        print(f"{variant:28s} {median:9.1f} µs a replay   {per_call:6.2f} µs a layer call over bare")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--replays", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=1, help="rows of each layer call's input and output")
    parser.add_argument("--experts", type=int, default=32, help="router logits a token (ring-3-forward)")
    parser.add_argument("--thrash", type=int, default=0, help="MB each layer reads before its call (Thrash)")
    options = parser.parse_args()
    device = torch.device("cuda", 0)
    layers = options.layers
    rows = options.tokens
    thrash = Thrash(options.thrash, layers, device)
    inputs = [torch.randn(rows, 2880, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    outputs = [torch.randn(rows, 2880, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    logits = [torch.randn(rows, options.experts, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    small = [[torch.zeros(16, device=device, dtype=torch.int32) for _ in range(10)] for _ in range(layers)]
    routing = [
        [torch.zeros(size, device=device, dtype=torch.uint8) for size in ROUTING_BYTES] for _ in range(layers)
    ]
    keep: list[torch.Tensor] = []

    def spans(i: int, extra: int, check: bool) -> Spans:
        if extra == -2:  # triton_kernel_moe_forward: hidden states, router logits, output
            return entry_spans([inputs[i], logits[i], outputs[i]], outputs[i] if check else None)
        tensors = [inputs[i], outputs[i], *(routing[i] if extra < 0 else small[i][:extra])]
        return entry_spans(tensors, outputs[i] if check else None)

    def build(variant: str) -> torch.cuda.CUDAGraph:
        ring = None
        batched = variant.endswith(("batch", "batch-x4", "batch-compact"))
        staged = batched or variant.endswith("staged")
        if variant != "bare":
            # a staged variant lifts the ring's stage limit (as MOEREPLAY_FLIGHT_GRAPH_STAGE does): entries over
            # the lone size (every one at --tokens 32) are staged too. Their slots come from the staging area,
            # capacity // STAGE_SHARE: 32 MB here, room for larger --tokens than the default ring's 16 MB
            ring = GraphRing(
                (512 if staged else 64) << 20,
                device,
                launches=layers + 8,
                stage_bytes=1 << 30 if staged else graph_ring.ALONE_BYTES,
                batch=batched,
                compact=variant.endswith("compact"),
            )
            if variant.endswith("x4"):
                ring.stage_waves = 4
            if variant.endswith("devwords"):
                words = torch.zeros(ring.tags + 1, dtype=torch.int64, device=device)
                keep.append(words)
                ring._host_address = words.data_ptr()
        extra = {"ring-2": 0, "ring-18-oss": -1, "ring-18-staged": -1}.get(variant, 10)
        if variant.startswith("ring-3-forward"):
            extra = -2
        alone, alone_elements = graph_ring.ALONE_BYTES, graph_ring.ALONE_ELEMENTS
        if variant.endswith("shared"):
            graph_ring.ALONE_BYTES = -1  # never alone: the work per program decides (three programs here)
        elif variant.endswith("alone"):
            graph_ring.ALONE_BYTES = graph_ring.ALONE_ELEMENTS = 1 << 62  # one program whatever the entry
        check = not variant.endswith("nocheck")
        try:
            graph = capture_layers(
                ring, inputs, outputs, lambda i: spans(i, extra, check), staged=staged, before=thrash.before
            )
        finally:
            graph_ring.ALONE_BYTES, graph_ring.ALONE_ELEMENTS = alone, alone_elements
        if ring is not None:
            # a staged variant whose entries do not all fit the staging area, or that got no side stream, would
            # time a mix of both paths or the one-node path under a staged name
            expected = layers if staged else 0
            if len(ring.staged) != expected:
                raise SystemExit(
                    f"graph_ring_bench: {variant} staged {len(ring.staged)} of its {layers} layer calls, not "
                    f"{expected} (a {graph_ring.staging_area(ring.capacity)}-byte staging area; lower --tokens)"
                )
        return graph

    variants = [
        "bare",
        "ring-2",
        "ring-12",
        "ring-12-devwords",
        "ring-12-nocheck",
        "ring-12-shared",
        "ring-18-oss",
        "ring-18-staged",
        "ring-3-forward",
        "ring-3-forward-nocheck",
        "ring-3-forward-alone",
        "ring-3-forward-staged",
        "ring-3-forward-batch",
        "ring-3-forward-batch-x4",
        "ring-3-forward-batch-compact",
    ]
    graphs = {variant: build(variant) for variant in variants}
    time_and_report(
        f"graph_ring_bench ({rows} token(s), {options.thrash} MB read a layer)",
        graphs,
        layers,
        options.rounds,
        options.replays,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
