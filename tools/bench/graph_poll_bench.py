"""The writer thread's poll under CUDA graphs, on the CPU: what each poll costs the serving thread's GIL.

With CUDA graphs on, vLLM replays every decode step from a graph and the host sees no layer call: the flight
recorder's only host work is the writer thread's poll, every ``poll_interval`` (5 ms), which reads the tag words
the graph ring's kernels stored since the last poll (:meth:`LayerFlight.poll` with its graph half,
:meth:`GraphFlight.poll`). The poll holds the GIL, so at decode its time is taken from the serving thread.

This runs exactly that poll, on a :class:`GraphRing` in host memory whose tag words and hint are written here as
the kernels write them on the device (finished sequences of magnitude 1.0), ``--new`` sequences per poll (24
layers x about two batch-1 decode steps per 5 ms: 48), and also with none new (the poll between two steps).
Prints µs per poll (median of rounds), and the graph half's cost against a read of a whole chunk of words (what
every poll did before 2026-12-06) with their ratio, from the same run.

    python tools/bench/graph_poll_bench.py [--new 48] [--polls 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moereplay.capture.flight_graph import GraphFlight
from moereplay.capture.flight_layer import LayerFlight

ONE = struct.unpack("<I", struct.pack("<f", 1.0))[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=48, help="sequences finished between two polls")
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    layer = LayerFlight(max_calls=16, max_bytes=1 << 20, absmax=None, emit=lambda *a: True)
    graph = GraphFlight(layer, 1 << 20)
    layer.graph = graph
    ring = graph.prepare(torch.device("cpu"))
    assert ring is not None
    graph.counters.launches = 24  # graphs hold ring launches: the writer polls every poll_interval
    tags = ring.tags
    sequence = 0

    def finish(count: int) -> None:
        nonlocal sequence
        for _ in range(count):
            ring.words[sequence % tags] = (((sequence // tags) + 1) & 0x7FFFFFFF) << 32 | ONE
            sequence += 1
        ring.host[tags] = sequence

    def timed(new: int, poll=lambda: layer.poll(launch=True)) -> float:
        samples = []
        for _ in range(options.rounds):
            spent = 0
            for _ in range(options.polls):
                finish(new)  # the device's stores: off the clock
                started = time.perf_counter_ns()
                poll()
                spent += time.perf_counter_ns() - started
            samples.append(spent / options.polls / 1e3)
        return statistics.median(samples)

    timed(options.new)  # warm up
    with_new = timed(options.new)
    none_new = timed(0)
    # the graph half alone, as the writer polls it and reading a whole chunk (every poll did, before 2026-12-06)
    graph_half = timed(options.new, lambda: graph.poll(launch=True))
    whole_chunk = timed(options.new, lambda: graph.poll(launch=True, full=True))
    checked = graph.counters.checked
    print(
        f"graph_poll_bench: {with_new:.1f} µs a poll with {options.new} new sequences, {none_new:.1f} µs with "
        f"none new ({options.rounds} rounds of {options.polls} polls; {checked} sequences checked)"
    )
    print(
        f"graph_poll_bench: graph half {graph_half:.1f} µs a poll, {whole_chunk:.1f} µs reading a whole chunk "
        f"(x{whole_chunk / graph_half:.2f} of it, this run)"
    )
    if checked != sequence:
        print(f"graph_poll_bench: checked {checked} of {sequence} sequences: the poll missed some")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
