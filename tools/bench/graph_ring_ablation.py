"""Where a graph-ring node's time goes: the served gpt-oss decode entry (``graph_ring_bench``'s ``ring-18-oss``)
with parts of :func:`~moereplay.capture.graph_ring_kernel.graph_record` switched off by its runtime flags, next to
the floors of any node (a one-argument Triton kernel that does nothing; a captured device-to-device copy).

- ``trivial``: a Triton kernel node that does nothing (what any extra kernel node costs in a graph);
- ``memcpy``: one captured ``copy_`` of the layer's 5.6 KB output (a copy node);
- ``floor``: ``graph_record`` with nothing to do (reads the launch's start cell, 90 arguments);
- ``reserve``: only the reservation (three counters, cells, metadata row, hint over PCIe);
- ``copy``: only the copies (18 spans, 14 KB), start read from the cell;
- ``finish``: only the fold of the output and the fenced tag word; ``finish-nocheck`` without the fold;
- ``full``: the node as captured (``ring-18-oss``), and ``full-wN`` compiled with N warps instead of Triton's 4;
- ``staged``: the staged path (the STAGE variant's copy on the graph's path, the record node on a side stream).
  With these stand-in layers (≈ 1.4 µs each) the side stream's chain of record nodes is longer than the graph's
  path, so a replay waits for it at the join: this figure is the side chain's, not the path's (a served layer
  takes ≈ 100 µs, which hides its node); ``staged-path``: the same without the record nodes — the cost on the
  graph's path. Staged variants lift the ring's stage limit, so at ``--tokens 32`` they stage too;
  ``staged-path-x2`` / ``-x4``: the path with the staging copy allowed twice / four times the programs
  (``GraphRing.stage_waves``: one wave of loads where the default takes two at 32 tokens); ``memcpy-path``: the
  staging done by two captured copies (copy nodes) of the layer call's input and output instead.

Interleaved rounds, CUDA-event time per replay, medians; µs per layer call over the bare graph. ``--tokens``
sets the rows of each layer call's input and output (the routing spans keep their decode sizes, as in
``graph_ring_bench``): at 32 tokens the entry (≈ 370 KB) outgrows the lone size, so its node runs many programs
and the ``reserve`` variant includes their arrive/ready handshake. A served decode batch of 32 paid ≈ 21 µs a
layer call for the recorder in all (2026-12-07, H100: 1.072× over 7.06 ms steps of 24 layers), where
``graph_ring_bench`` times the node alone at ≈ 9.

    python3 tools/bench/graph_ring_ablation.py [--layers 24] [--rounds 5] [--replays 200] [--tokens 1]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from moereplay.capture import graph_ring, graph_ring_kernel
from moereplay.capture.graph_ring import GraphRing, Spans
from moereplay.capture.ring_kernel import compile_launcher

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_ring_bench import ROUTING_BYTES, Thrash, capture_layers, entry_spans, time_and_report

# index of ``check`` in graph_record's arguments; then numel, code, moved, finish, reserve, total, first
FLAGS = 3 * graph_ring_kernel.SPANS


@triton.jit(do_not_specialize=["x"])
def _nothing(x):
    if x == 12345:  # never: the kernel must take its argument
        tl.store(x.to(tl.pointer_type(tl.int64)), 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1, help="rows of each layer call's input and output")
    parser.add_argument("--thrash", type=int, default=0, help="MB each layer reads before its call")
    options = parser.parse_args()
    device = torch.device("cuda", 0)
    layers, rows = options.layers, options.tokens
    thrash = Thrash(options.thrash, layers, device)
    inputs = [torch.randn(rows, 2880, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    outputs = [torch.randn(rows, 2880, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    copies = [torch.empty_like(output) for output in outputs]
    routing = [
        [torch.zeros(n, device=device, dtype=torch.uint8) for n in ROUTING_BYTES] for _ in range(layers)
    ]
    nothing = compile_launcher(_nothing, 1, {}, 0, name="nothing")

    def spans(i: int) -> Spans:
        return entry_spans([inputs[i], outputs[i], *routing[i]], outputs[i])

    def patched(base: Callable, overrides: dict[int, int]) -> Callable:
        def launch(programs: int, stream: int, args: list[int]) -> None:
            args = list(args)
            for index, value in overrides.items():
                args[index] = value
            base(programs, stream, args)

        return launch

    numel, code, moved, finish, reserve = range(FLAGS + 1, FLAGS + 6)
    ablations = {
        "floor": {moved: 0, reserve: 0, finish: 0, code: 0, numel: 0},
        "reserve": {moved: 0, finish: 0, code: 0, numel: 0},
        "copy": {reserve: 0, finish: 0, code: 0, numel: 0},
        "finish": {moved: 0, reserve: 0},
        "finish-nocheck": {moved: 0, reserve: 0, code: 0, numel: 0},
    }
    warps = {"full-w1": 1, "full-w2": 2, "full-w8": 8}
    stage_waves = {"staged-path-x2": 2, "staged-path-x4": 4}
    staging = [torch.empty_like(output) for output in outputs] + [torch.empty_like(i) for i in inputs]

    def build(variant: str) -> torch.cuda.CUDAGraph:
        ring = None
        staged = variant.startswith("staged")
        if variant in ablations or variant.startswith("full") or staged:
            # staged variants lift the stage limit (as graph_ring_bench's do): entries over the lone size (every
            # one at --tokens 32) are staged too
            ring = GraphRing(
                (512 if staged else 64) << 20,
                device,
                launches=layers + 8,
                stage_bytes=1 << 30 if staged else graph_ring.ALONE_BYTES,
            )
            assert ring.kernels is not None, graph_ring.kernel_error()
            if variant in ablations:
                ring.kernels = patched(ring.kernels, ablations[variant])
            if variant.startswith("staged-path"):  # the record nodes (side stream) left out: the path alone
                ring.kernels = lambda programs, stream, args: None
            if variant in stage_waves:
                ring.stage_waves = stage_waves[variant]
            if variant in warps:
                ring.kernels = compile_launcher(
                    graph_ring_kernel.graph_record,
                    len(graph_ring_kernel.RECORD_INTS),
                    {"BLOCK": graph_ring_kernel.BLOCK, "FOLD": graph_ring_kernel.FOLD, "STAGE": 0},
                    0,
                    name="graph record",
                    num_warps=warps[variant],
                )
        others: dict[str, Callable[[int], object]] = {
            "trivial": lambda i: nothing(1, graph_ring._current_stream(0), [0]),
            "memcpy": lambda i: copies[i].copy_(outputs[i]),
            # the staging path as captured copies (copy nodes) of the layer call's input and output instead
            "memcpy-path": lambda i: (staging[i].copy_(outputs[i]), staging[layers + i].copy_(inputs[i])),
        }
        graph = capture_layers(
            ring,
            inputs,
            outputs,
            spans,
            staged=staged,
            other=others.get(variant),
            before=thrash.before,
        )
        if staged and ring is not None and len(ring.staged) != layers:
            raise SystemExit(
                f"graph_ring_ablation: {variant} staged {len(ring.staged)} of its {layers} layer calls"
            )
        return graph

    variants = [
        "bare",
        "trivial",
        "memcpy",
        *ablations,
        "full",
        *warps,
        "staged",
        "staged-path",
        *stage_waves,
        "memcpy-path",
    ]
    graphs = {variant: build(variant) for variant in variants}
    print(f"graph_ring_ablation: {rows} token(s) a layer call, {options.thrash} MB read before each")
    time_and_report("graph_ring_ablation", graphs, layers, options.rounds, options.replays)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
