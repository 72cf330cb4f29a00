"""Sustained rate of the capture writer on this machine's CPU alone: host tensors through ``WriterThread`` →
``FormatSink`` → ``CaptureWriter``, shaped like full capture of gpt-oss prefill (M = 2048).

Each call is a Begin with blobs of ``--begin-mib`` sizes (activations, intermediate caches, pre-call output
buffers) and a Complete with blobs of ``--complete-mib`` sizes (outputs), random bf16 values (what activations
look like to zstd), every blob distinct (so deduplication cannot flatter the rate). The producer offers calls as
fast as the queue admits them (``--queue-mib`` of host memory, like ``MOEREPLAY_QUEUE_BYTES``) and the rate is
copied bytes ÷ wall time from the first offer until the writer has drained its queue; "process CPU s" is the
user + system CPU time of the whole process meanwhile (the producer's copies included). No GPU is used: on the
GPU machine this isolates the host side (hash, zstd, file writes) of ``capture_bench``'s full-capture rate.

Usage::

    python tools/bench/writer_bench.py [--calls 24] [--level 1] [--zstd-threads 0] [--workers 0,4,8]
        [--begin-mib 12,96,48] [--complete-mib 96,12] [--out DIR]

``--workers``: comma-separated ``MOEREPLAY_WRITER_THREADS`` values to compare (0: the writer thread hashes and
compresses alone; -1: the default for this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moereplay.capture.settings import CaptureSettings
from moereplay.capture.sink import FormatSink
from moereplay.capture.snapshot import snapshot
from moereplay.capture.writer_thread import Begin, Complete, WriterThread
from moereplay.format import CaptureReader, CaptureWriter


def sources(sizes_mib: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size * 2**19, dtype=torch.bfloat16, generator=generator) / 20 for size in sizes_mib]


def stamped(values: list[torch.Tensor], call: int) -> Any:
    """A CPU snapshot of ``values`` whose copies are made distinct by writing the call number into them."""
    taken = snapshot({f"t{i}": value for i, value in enumerate(values)})
    for copy in taken.tree.values():
        copy.data[:8] = torch.tensor([call], dtype=torch.int64).view(torch.uint8)
    return taken


def run(options: argparse.Namespace, workers: int, out_dir: Path) -> dict[str, Any]:
    begin_values = sources([int(x) for x in options.begin_mib.split(",")], 1)
    complete_values = sources([int(x) for x in options.complete_mib.split(",")], 2)
    settings = CaptureSettings(
        compression_level=options.level, compression_threads=options.zstd_threads, writer_threads=workers
    )
    path = out_dir / f"writer-bench-w{workers}.zst"
    writer = CaptureWriter(
        path,
        {},
        compression_level=settings.compression_level,
        compression_threads=settings.compression_threads,
        workers=settings.resolved_writer_threads(),
    )
    thread = WriterThread(
        FormatSink(writer), max_calls_queued=100_000, max_bytes_queued=options.queue_mib * 2**20
    )
    offered = 0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    for call in range(options.calls):
        for message_kind in ("begin", "complete"):
            values = begin_values if message_kind == "begin" else complete_values
            taken = stamped(values, call)
            while not thread.has_room(taken.copied):
                time.sleep(0.001)
            if message_kind == "begin":
                message: Begin | Complete = Begin(call, "bench", "bench", taken, {}, None)
            else:
                message = Complete(call, taken, {}, "completed")
            assert thread.offer(message)
            offered += taken.copied
    assert thread.flush(timeout=3600)
    drained = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    phases = dict(thread.seconds)
    phases.update(writer.phase_seconds)
    thread.close()
    counters = thread.counters
    assert counters.copied_bytes == offered and not thread.failed, (counters, thread.failed)
    size = path.stat().st_size
    with CaptureReader(path) as reader:
        assert len(reader) == options.calls
    path.unlink()
    return {
        "workers": settings.resolved_writer_threads(),
        "level": options.level,
        "zstd_threads": options.zstd_threads,
        "copied MB": round(offered / 1e6, 1),
        "file MB": round(size / 1e6, 1),
        "drain s": round(drained, 3),
        "MB/s copied": round(offered / 1e6 / drained, 1),
        "process CPU s": round(cpu, 2),
        "writer s": {key: round(value, 3) for key, value in phases.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--zstd-threads", type=int, default=0)
    parser.add_argument("--workers", default="0,-1")
    parser.add_argument("--begin-mib", default="12,96,48")
    parser.add_argument("--complete-mib", default="96,12")
    parser.add_argument("--queue-mib", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    out_dir = options.out or Path(tempfile.mkdtemp(prefix="writer-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"writer_bench: {os.cpu_count()} CPUs, {options.calls} calls of begin {options.begin_mib} MiB + "
        f"complete {options.complete_mib} MiB, zstd level {options.level}, zstd threads {options.zstd_threads}, "
        f"files under {out_dir}",
        flush=True,
    )
    for workers in (int(x) for x in options.workers.split(",")):
        print(json.dumps(run(options, workers, out_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
