"""Host-side costs of writing a capture: hash and zstd rates on activation-like bytes, on this machine's CPU.

Full capture writes every copied tensor as a blob: it is hashed (deduplication) and zstd-compressed on the
writer thread. This prints MB/s of each piece, single-threaded and spread over worker threads, for 64 MiB of
random bf16 values (what activations look like to a compressor), so a capture_bench result can be read against
what the CPU can do.

Usage: python tools/bench/host_codec_bench.py [--mib 64] [--threads 8]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zstandard


def rate(label: str, nbytes: int, action) -> None:
    action()  # warm
    started = time.perf_counter()
    repeats = 3
    for _ in range(repeats):
        action()
    seconds = (time.perf_counter() - started) / repeats
    print(f"  {label:<44} {nbytes / seconds / 1e6:9.0f} MB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8)
    options = parser.parse_args()
    data = torch.randn(options.mib * 2**19, dtype=torch.bfloat16).view(torch.uint8).numpy()
    view = memoryview(data).cast("B")
    nbytes = view.nbytes
    chunk = 4 * 2**20
    pieces = [view[start : start + chunk] for start in range(0, nbytes, chunk)]
    print(
        f"host_codec_bench: {options.mib} MiB of random bf16, {os.cpu_count()} CPUs, zstandard {zstandard.__version__}"
    )
    for name in ("sha256", "blake2b", "md5"):
        rate(f"{name} (one thread)", nbytes, lambda name=name: hashlib.new(name, view).digest())
    with ThreadPoolExecutor(options.threads) as pool:
        rate(
            f"sha256 of 4 MiB chunks ({options.threads} threads)",
            nbytes,
            lambda: list(pool.map(lambda p: hashlib.sha256(p).digest(), pieces)),
        )
        for level in (1, -1, -5):
            single = zstandard.ZstdCompressor(level=level, write_checksum=True)
            rate(f"zstd level {level} (one thread)", nbytes, lambda single=single: single.compress(view))
            multi = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=options.threads)
            rate(
                f"zstd level {level} ({options.threads} zstd threads)",
                nbytes,
                lambda multi=multi: multi.compress(view),
            )
            rate(
                f"zstd level {level} (4 MiB frames, {options.threads} py threads)",
                nbytes,
                lambda level=level: list(
                    pool.map(lambda p, level=level: zstandard.ZstdCompressor(level=level).compress(p), pieces)
                ),
            )
    for level in (1, -1, -5):
        ratio = len(zstandard.ZstdCompressor(level=level).compress(view)) / nbytes
        print(f"  compressed size at level {level}: {ratio:.3f} of the input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
