"""Host-side costs of writing a capture: hash and zstd rates on activation-like bytes, on this machine's CPU.

Full capture writes every copied tensor as a blob: it is hashed (sha256, deduplication) and compressed into one
zstd frame per blob. This prints MB/s of each piece for ``--mib`` MiB of random bf16 values (what activations
look like to a compressor):

- hashes on one thread, and sha256 of independent blobs on ``--threads`` Python threads;
- zstd on one thread; one frame with zstd's own worker threads (one-shot ``compress``, and streamed through a
  ``compressobj`` in 8 MiB steps or in one piece, as the capture writer does); the same with explicit
  ``job_size`` / ``overlap_log`` (zstd's multi-threading parameters);
- whole blobs (one frame each) compressed concurrently on 2, 4, … ``--threads`` Python threads, optionally with
  zstd worker threads inside each frame, and "hash then compress" per blob the same way: the capture writer's
  worker pool (``MOEREPLAY_WRITER_THREADS``) runs exactly that;
- independent 4 MiB frames on ``--threads`` Python threads (not the file format — an upper bound).

Usage: python tools/bench/host_codec_bench.py [--mib 64] [--threads 8] [--levels 1,-1] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zstandard


# Callable[..., ...], called with no argument: mypy rejects the callers' lambdas, whose defaults bind loop
# variables, as Callable[[], ...] (python/mypy#15459)
def rate(label: str, nbytes: int, action: Callable[..., Any], repeats: int = 3) -> float:
    action()  # warm
    started = time.perf_counter()
    for _ in range(repeats):
        action()
    seconds = (time.perf_counter() - started) / repeats
    mbps = nbytes / seconds / 1e6
    print(f"  {label:<64} {mbps:9.0f} MB/s", flush=True)
    return mbps


def compressor(level: int, threads: int = 0, job_mib: int = 0, overlap_log: int = -1) -> Any:
    if job_mib or overlap_log >= 0:
        parameters = zstandard.ZstdCompressionParameters.from_level(
            level,
            threads=threads,
            job_size=job_mib * 2**20,
            overlap_log=max(overlap_log, 0),
            write_checksum=True,
            write_content_size=True,
        )
        return zstandard.ZstdCompressor(compression_params=parameters)
    return zstandard.ZstdCompressor(
        level=level, write_checksum=True, write_content_size=True, threads=threads
    )


def streamed(engine: Any, view: memoryview, step: int) -> int:
    stream = engine.compressobj(size=view.nbytes)
    pieces = [stream.compress(view[start : start + step]) for start in range(0, view.nbytes, step)]
    pieces.append(stream.flush())
    return sum(len(piece) for piece in pieces)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--levels", default="1,-1")
    parser.add_argument("--quick", action="store_true", help="skip the job_size / overlap_log sweep")
    options = parser.parse_args()
    threads = options.threads
    levels = [int(level) for level in options.levels.split(",")]
    blobs = [
        torch.randn(options.mib * 2**19, dtype=torch.bfloat16).view(torch.uint8).numpy()
        for _ in range(max(threads, 2))
    ]
    views = [blob.data.cast("B") for blob in blobs]
    view = views[0]
    nbytes = view.nbytes
    chunk = 4 * 2**20
    pieces = [view[start : start + chunk] for start in range(0, nbytes, chunk)]
    fan = sorted({count for count in (2, 4, threads // 2, threads) if 2 <= count <= threads})
    print(
        f"host_codec_bench: {options.mib} MiB blobs of random bf16, {os.cpu_count()} CPUs, "
        f"zstandard {zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION}), --threads {threads}",
        flush=True,
    )
    print("hashes")
    for name in ("sha256", "blake2b", "md5"):
        rate(f"{name} (one thread)", nbytes, lambda name=name: hashlib.new(name, view).digest())
    with ThreadPoolExecutor(threads) as pool:
        rate(
            f"sha256 of 4 MiB chunks ({threads} threads; not the format)",
            nbytes,
            lambda: list(pool.map(lambda p: hashlib.sha256(p).digest(), pieces)),
        )
        for count in fan:
            rate(
                f"sha256 of {count} whole blobs on {count} threads",
                nbytes * count,
                lambda count=count: list(pool.map(lambda v: hashlib.sha256(v).digest(), views[:count])),
            )
        for level in levels:
            print(f"zstd level {level}, one frame per blob")
            single = compressor(level)
            rate("one thread, one-shot", nbytes, lambda single=single: single.compress(view))
            rate("one thread, compressobj 8 MiB steps", nbytes, lambda e=single: streamed(e, view, 8 * 2**20))
            for workers in sorted({2, 4, threads // 2, threads, os.cpu_count() or threads}):
                if workers < 2:
                    continue
                multi = compressor(level, workers)
                rate(f"{workers} zstd threads, one-shot", nbytes, lambda e=multi: e.compress(view))
                rate(
                    f"{workers} zstd threads, compressobj 8 MiB steps",
                    nbytes,
                    lambda e=multi: streamed(e, view, 8 * 2**20),
                )
                rate(
                    f"{workers} zstd threads, compressobj one piece",
                    nbytes,
                    lambda e=multi: streamed(e, view, nbytes),
                )
            if not options.quick:
                for job_mib in (1, 2, 4, 8, 16):
                    for overlap_log in (0, 1):
                        engine = compressor(level, threads, job_mib, overlap_log)
                        rate(
                            f"{threads} zstd threads, job {job_mib} MiB, overlap_log {overlap_log}, one piece",
                            nbytes,
                            lambda e=engine: streamed(e, view, nbytes),
                        )
            print(f"zstd level {level}, whole blobs on Python threads (one frame each)")
            for count in fan:
                for inner in (0, 2, 4):
                    if inner and inner * count > 2 * threads:
                        continue
                    engines = [compressor(level, inner) for _ in range(count)]

                    def concurrent(engines: list[Any] = engines, count: int = count) -> None:
                        list(
                            pool.map(
                                lambda pair: streamed(pair[0], pair[1], 2**40),
                                zip(engines, views[:count], strict=True),
                            )
                        )

                    rate(f"{count} blobs at once, {inner} zstd threads each", nbytes * count, concurrent)

                    def hashed(engines: list[Any] = engines, count: int = count) -> None:
                        def one(pair: tuple[Any, memoryview]) -> int:
                            hashlib.sha256(pair[1]).digest()
                            return streamed(pair[0], pair[1], 2**40)

                        list(pool.map(one, zip(engines, views[:count], strict=True)))

                    rate(
                        f"{count} blobs at once, {inner} zstd threads each, sha256 first",
                        nbytes * count,
                        hashed,
                    )
            rate(
                f"independent 4 MiB frames on {threads} threads (not the format)",
                nbytes,
                lambda level=level: list(
                    pool.map(lambda p, level=level: zstandard.ZstdCompressor(level=level).compress(p), pieces)
                ),
            )
    for level in sorted({*levels, 1, -1, -5}, reverse=True):
        ratio = len(zstandard.ZstdCompressor(level=level).compress(view)) / nbytes
        print(f"  compressed size at level {level}: {ratio:.3f} of the input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
