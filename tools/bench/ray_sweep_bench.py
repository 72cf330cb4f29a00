"""Replay sweep throughput on Ray: variants per second with 1, 2, 4, 8 workers, and the scaling efficiency.

A sweep of ``--variants`` units (default 1,000) over the calls of a capture — a served model's file (e.g. the
worker file of ``tools/gpu/serve_session.sh``) with ``--capture``, else a small synthetic Marlin capture — is run by
:func:`moereplay.replay.ray_sweep.sweep` on a local Ray cluster limited to W workers, for each W of ``--workers``.
Units are (call, variant) pairs from ``--mutation`` (default: the four guard fills) cycled until there are
``--variants`` of them. Each W starts its own cluster sized for W workers and runs a pool of W actors
(``sweep(workers=W)``). A sweep of W units runs untimed first (the backend's first load in a machine: the kernel
JIT's disk cache, pack files in the page cache); then the clock runs from submitting the sweep to the last result.
Each sweep starts its own W actors and kills them at its end, so the timed sweep includes W actor start-ups (in
parallel, once per worker, not once per unit: seconds against a sweep of minutes).

Prints per W: wall seconds, variants/s, speed-up over W = 1 and efficiency = speed-up ÷ W; ``--json`` prints the
rows as one JSON document.

GPU workers (one GPU per worker, ``--gpus-per-task`` for a fraction): run on a machine with 8 GPUs and a kernel
backend (``--backend pack:DIR`` or ``vllm``); W ≤ the GPUs present. CPU workers (``--cpu``): the ``reference``
backend on W CPU workers — it measures the fan-out machinery (unit dispatch to the actors, per-unit capture
reads, merge), not kernel time. Numbers from this script on CPU say nothing about GPU scaling; GPU numbers belong
to a session with a multi-GPU machine.

    python tools/bench/ray_sweep_bench.py --cpu --workers 1,2,4 --variants 200
    python tools/bench/ray_sweep_bench.py --capture rank0-pid123.zst --backend pack:.kernelpack --workers 1,2,4,8
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path


def _default_capture(directory: Path) -> Path:
    from moereplay.synth.build import synthesize

    path = directory / "bench.moe.zst"
    synthesize("fp8-marlin", path, overrides=["hidden=256", "intermediate=128"])
    return path


def _units(capture: Path, mutations: list[str], count: int, options: dict[str, object]) -> list:
    from moereplay.format.reader import CaptureReader
    from moereplay.ops import known_op_names
    from moereplay.replay.ray_sweep import plan_units

    with CaptureReader(capture) as reader:
        calls = [record.index for record in reader.calls() if record.op in known_op_names()]
    if not calls:
        raise SystemExit(f"{capture}: no replayable kernel call")
    planned = [unit for unit in plan_units(capture, calls, mutations, options) if unit.variant is not None]
    return list(itertools.islice(itertools.cycle(planned), count))


def _measure(units: list, workers: int, gpu: bool, gpus_per_task: float) -> float:
    import ray

    from moereplay.replay.ray_sweep import sweep

    ray.shutdown()
    if gpu:
        ray.init(num_gpus=workers, num_cpus=workers * 2, include_dashboard=False, logging_level="ERROR")
    else:
        ray.init(num_cpus=workers, num_gpus=0, include_dashboard=False, logging_level="ERROR")
    gpus = gpus_per_task if gpu else 0.0
    # untimed: the backend's first load on this machine
    sweep(units[:workers], workers=workers, gpus_per_task=gpus, cpus_per_task=1.0)
    started = time.perf_counter()
    sweep(units, workers=workers, gpus_per_task=gpus, cpus_per_task=1.0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--capture", type=Path, help="a capture file (default: a small synthetic Marlin capture)"
    )
    parser.add_argument("--variants", type=int, default=1000)
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts, comma-separated")
    parser.add_argument("--mutation", action="append", help="e.g. 'fill 0xff' (repeatable; default: 4 fills)")
    parser.add_argument("--backend", default=None, help="default: reference with --cpu, else auto")
    parser.add_argument("--cpu", action="store_true", help="CPU workers and the reference backend")
    parser.add_argument("--gpus-per-task", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    mutations = arguments.mutation or ["fill 0xff", "fill 0x00", "fill 0xfe", "fill nan"]
    backend = arguments.backend or ("reference" if arguments.cpu else "auto")
    if backend == "auto":
        from moereplay.replay.backends import auto_backend

        backend = auto_backend().text
    options = {"backend": backend, "device": "cpu" if arguments.cpu else None}
    workers = [int(text) for text in arguments.workers.split(",") if text]
    with tempfile.TemporaryDirectory() as scratch:
        capture = arguments.capture or _default_capture(Path(scratch))
        units = _units(capture, mutations, arguments.variants, options)
        rows = []
        for count in workers:
            seconds = _measure(units, count, not arguments.cpu, arguments.gpus_per_task)
            rows.append({"workers": count, "seconds": seconds, "variants_per_s": len(units) / seconds})
            print(
                f"  {count} worker(s): {seconds:.1f} s, {len(units) / seconds:.1f} variants/s",
                file=sys.stderr,
            )
    base = next((row["variants_per_s"] for row in rows if row["workers"] == 1), rows[0]["variants_per_s"])
    for row in rows:
        row["speedup"] = row["variants_per_s"] / base
        row["efficiency"] = row["speedup"] / row["workers"]
    if arguments.json:
        print(json.dumps({"backend": backend, "units": len(units), "cpu": arguments.cpu, "rows": rows}))
        return
    kind = "CPU workers, reference backend" if arguments.cpu else f"GPU workers, {backend}"
    print(f"{len(units)} variants, {kind}")
    print(f"{'workers':>7}  {'seconds':>8}  {'variants/s':>10}  {'speed-up':>8}  {'efficiency':>10}")
    for row in rows:
        print(
            f"{row['workers']:>7}  {row['seconds']:>8.1f}  {row['variants_per_s']:>10.1f}  "
            f"{row['speedup']:>8.2f}  {row['efficiency']:>10.0%}"
        )


if __name__ == "__main__":
    main()
