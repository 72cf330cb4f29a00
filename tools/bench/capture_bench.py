"""Capture overhead on the GPU: vLLM's real ``fused_marlin_moe`` (NVFP4, gpt-oss shapes: E = 32, top-k 4,
hidden = 2880, intermediate 2880 padded to 2944) at decode M = 1, 8, 64 and prefill M = 2048, measured in one run with capture off,
the flight recorder armed, and full capture (once per compression setting asked for).

Per M and mode it prints the serving-side time per layer call and its ratio to "off", and for full capture the
sustained rate: bytes of tensor copies written (inputs before, outputs after each call; weights are stored once
per file and not counted) ÷ wall time from the first call until the writer has drained its queue, and the same
for the bytes of the compressed file. Every iteration uses its own activations and routing, so the file's
content deduplication cannot flatter the rate; drops (full queue) are printed and should be 0.

``--family ogs``: the same measurements on vLLM's gpt-oss MXFP4 entry point as a served gpt-oss model runs it
(``triton_kernel_moe_forward``: triton_kernels routing, then ``triton_kernel_fused_experts`` with its two
``matmul_ogs`` calls; gpt-oss-20b shapes, fp32 biases, swizzled by vLLM's own ``_swizzle_mxfp4``). Its patch points
for the floors are ``triton_kernel_fused_experts`` and ``matmul_ogs`` of that module; since 2026-12-06 the layer
flight recorder keeps ``triton_kernel_moe_forward`` itself (a third patch point the floors do not wrap).

Usage (GPU machine, vLLM 0.25.1 importable, e.g. ``source tools/gpu/device_setup.sh``)::

    python tools/bench/capture_bench.py [--iterations 200] [--prefill-iterations 20]
        [--compression 1:0,1:8] [--out DIR]

Decode ratios are medians over ``--rounds`` rounds; each round times off, the two floors and both flight scopes
back to back (each against that round's own "off"), so drift over the run (clocks, other tenants) cannot pass for
overhead; the spread (min..max over rounds) is printed with the JSON rows. ``flight-layer×`` is the default flight
recorder (``MOEREPLAY_FLIGHT_SCOPE=layer``: one ring launch per layer call), ``flight-kernel×`` the exact per-kernel
ring (``MOEREPLAY_FLIGHT_SCOPE=kernel``).

Floor, in the same run: ``bare×`` is the ratio with a plain Python pass-through wrapper on the same three patch
points (``fused_marlin_moe`` and its two ``moe_wna16_marlin_gemm`` calls) and ``+launch×`` with that wrapper
launching one tiny kernel per wrapped call (``scratch.add_(1)``): what any capture that launches even one copy
per call cannot beat at CPU-launch-bound decode (the layer scope launches one per *layer* call, so its floor is
about a third of that).

``--compression LEVEL:THREADS[:WRITER_THREADS],...``: zstd level, zstd threads per frame and writer pool threads
(``MOEREPLAY_COMPRESSION_LEVEL`` / ``MOEREPLAY_COMPRESSION_THREADS`` / ``MOEREPLAY_WRITER_THREADS``) of each
full-capture run. Targets (issue 4): armed ≤ 1.05×, full capture
≥ 1 GB/s sustained.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from moereplay.capture import phase_timers

# intermediate 2880 padded to 2944 as vLLM pads it for its Marlin MoE backends (no Marlin tile fits N = K = 2880)
EXPERTS, TOP_K, HIDDEN, INNER = 32, 4, 2880, 2944
QUEUE = {"MOEREPLAY_QUEUE_BYTES": "12G", "MOEREPLAY_QUEUE_CALLS": "100000"}


def build_weights():
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like

    def stack(n: int, k: int):
        q, s, g = [], [], []
        for _ in range(EXPERTS):
            _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20, 16
            )
            q.append(qweight)
            s.append(scale)
            g.append(global_scale)
        return torch.stack(q), torch.stack(s), torch.stack(g).reshape(EXPERTS)

    return stack(2 * INNER, HIDDEN), stack(HIDDEN, INNER)


def make_inputs(m: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``count`` distinct (hidden states, top-k weights, top-k ids) for M = ``m``."""
    out = []
    for _ in range(count):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(m, EXPERTS, device="cuda"), -1).topk(TOP_K)
        out.append((x, weights.contiguous(), ids.to(torch.int32).contiguous()))
    return out


def timed(call: Callable[[int], object], iterations: int, warmup: int = 3) -> float:
    """Seconds per call (``call(i)`` for i in range), after ``warmup`` calls, synchronised at both ends."""
    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(iterations):
        call(warmup + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


GPT_OSS_MODULE = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"


def marlin_family(sizes_and_counts: dict[int, int]) -> tuple[dict[int, Callable[[int], object]], list, str]:
    """Per M a call ``call(i)`` of ``fused_marlin_moe`` (NVFP4), the patch points of the floors, and a title."""
    from vllm.scalar_type import scalar_types

    marlin = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    ops = importlib.import_module("vllm._custom_ops")
    (w1, s1, g1), (w2, s2, g2) = build_weights()
    calls: dict[int, Callable[[int], object]] = {}
    for m, count in sizes_and_counts.items():
        inputs = make_inputs(m, count)

        def call(i: int, inputs=inputs) -> torch.Tensor:
            x, weights, ids = inputs[i % len(inputs)]
            return marlin.fused_marlin_moe(
                x, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
                global_scale1=g1, global_scale2=g2,
            )  # fmt: skip

        calls[m] = call
    title = f"fused_marlin_moe NVFP4 E={EXPERTS} top-{TOP_K} hidden={HIDDEN} inner={INNER}"
    return calls, [(marlin, "fused_marlin_moe"), (ops, "moe_wna16_marlin_gemm")], title


def ogs_family(sizes_and_counts: dict[int, int]) -> tuple[dict[int, Callable[[int], object]], list, str]:
    """Per M a call of vLLM's gpt-oss entry point ``triton_kernel_moe_forward`` (routing by triton_kernels, then
    ``triton_kernel_fused_experts``), gpt-oss-20b shapes (hidden = intermediate = 2880), MXFP4 weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
    from ogs_inputs import gpt_oss_mxfp4_layer

    moe = importlib.import_module(GPT_OSS_MODULE)
    activation = importlib.import_module("vllm.model_executor.layers.fused_moe.activation")
    generator = torch.Generator(device="cuda").manual_seed(2880)
    weights = gpt_oss_mxfp4_layer(importlib.import_module, EXPERTS, HIDDEN, HIDDEN, generator)
    calls: dict[int, Callable[[int], object]] = {}
    for m, count in sizes_and_counts.items():
        inputs = [
            (
                (torch.randn(m, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16),
                torch.randn(m, EXPERTS, device="cuda"),
            )
            for _ in range(count)
        ]

        def call(i: int, inputs=inputs) -> torch.Tensor:
            x, logits = inputs[i % len(inputs)]
            return moe.triton_kernel_moe_forward(
                x, weights.w13, weights.w2, logits, TOP_K, True,
                activation=activation.MoEActivation.SWIGLUOAI, quant_config=weights.quant_config,
            )  # fmt: skip

        calls[m] = call
    title = f"gpt-oss triton_kernel_moe_forward MXFP4 E={EXPERTS} top-{TOP_K} hidden=intermediate={HIDDEN}"
    return calls, [(moe, "triton_kernel_fused_experts"), (moe, "matmul_ogs")], title


def plain_wrappers(points: list, launch: torch.Tensor | None) -> Callable[[], None]:
    """Wrap the patch points with a pass-through (plus one tiny kernel per call when ``launch``); returns the
    undo."""
    originals = points
    saved = [(owner, name, getattr(owner, name)) for owner, name in originals]
    for owner, name, original in saved:

        def wrapper(*args, __original=original, **kwargs):
            if launch is not None:
                launch.add_(1)
            return __original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def undo() -> None:
        for owner, name, original in saved:
            setattr(owner, name, original)

    return undo


def parse_compression(text: str) -> list[tuple[int, int, int | None]]:
    """``LEVEL:THREADS[:WORKERS]`` items: zstd level, zstd threads per frame, writer pool threads (default: the
    setting's default)."""
    settings: list[tuple[int, int, int | None]] = []
    if text.strip().lower() == "none":  # the ratio columns only
        return settings
    for item in text.split(","):
        parts = item.strip().split(":")
        level, threads = int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1] else 0
        workers = int(parts[2]) if len(parts) > 2 and parts[2] else None
        settings.append((level, threads, workers))
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200, help="timed calls per decode M")
    parser.add_argument("--prefill-iterations", type=int, default=20, help="timed calls at M = 2048")
    parser.add_argument(
        "--compression",
        default="1:0,1:8",
        help="LEVEL:THREADS[:WRITER_THREADS] of each full-capture run, or none",
    )
    parser.add_argument("--sizes", default="1,8,64,2048")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the ratio measurements")
    parser.add_argument(
        "--diagnose", action="store_true", help="also time armed-none and layer-nopoll (see code)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--family",
        choices=("marlin", "ogs"),
        default="marlin",
        help="marlin: fused_marlin_moe NVFP4; ogs: vLLM's gpt-oss MXFP4 entry point (triton_kernels matmul_ogs)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the flight-layer loop of --profile-m's last round; print the recorder's footer timers",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="time the layer recorder's pieces (serving thread, no polls) in each M's last round",
    )
    parser.add_argument(
        "--profile-m", type=int, default=None, help="the M --profile profiles (default: the first)"
    )
    options = parser.parse_args()
    compression = parse_compression(options.compression)
    sizes = [int(m) for m in options.sizes.split(",")]
    if options.profile_m is None:
        options.profile_m = sizes[0]

    from moereplay.capture import session as session_module
    from moereplay.capture.sink import FormatSink
    from moereplay.cli.inspect_cmds import recorder_cost

    torch.manual_seed(0)
    counts = {m: (options.iterations if m < 2048 else options.prefill_iterations) + 3 for m in sizes}
    family = marlin_family if options.family == "marlin" else ogs_family
    calls, points, title = family(counts)
    out_dir = options.out or Path(tempfile.mkdtemp(prefix="capture-bench-"))
    print(
        f"capture_bench: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"{title}; "
        f"full capture at zstd level:threads {options.compression}; queue {QUEUE}; files under {out_dir}",
        flush=True,
    )
    flights = {
        "flight-layer": {"MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_FLIGHT_SCOPE": "layer"},
        "flight-kernel": {"MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_FLIGHT_SCOPE": "kernel"},
    }
    if options.diagnose:
        # where the layer scope's time goes: the recorder's bookkeeping with nothing selected, and the layer
        # scope with the writer thread's polls switched off (its Python holds the GIL the serving thread needs)
        flights["armed-none"] = {"MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_OPS_EXCLUDE": "*"}
        flights["layer-nopoll"] = {"MOEREPLAY_TRIGGER": "flight", "MOEREPLAY_FLIGHT_SCOPE": "layer"}
    modes: list[tuple[str, dict[str, str]]] = []
    for level, threads, workers in compression:
        extra = {"MOEREPLAY_COMPRESSION_LEVEL": str(level), "MOEREPLAY_COMPRESSION_THREADS": str(threads)}
        label = f"full z{level}t{threads}"
        if workers is not None:
            extra["MOEREPLAY_WRITER_THREADS"] = str(workers)
            label += f"w{workers}"
        taken = sum(1 for name, _ in modes if name == label or name.startswith(label + "#"))
        # the same setting again (e.g. once cold, once with the pinned host pool warm) gets its own column
        if taken:
            label += f"#{taken + 1}"
        modes.append((label, extra))
    rows = []
    for m in sizes:
        iterations = options.iterations if m < 2048 else options.prefill_iterations
        call = calls[m]
        # the first launch of this M (and the Marlin PTX JIT on a fresh machine) stays outside the timing
        timed(call, 3)
        result: dict[str, object] = {"M": m, "iterations": iterations}
        samples: dict[str, list[float]] = {"bare": [], "+launch": [], **{name: [] for name in flights}}
        offs: list[float] = []
        rounds = options.rounds if m < 2048 else max(1, options.rounds // 2)
        for round_index in range(rounds):
            off = timed(call, iterations)
            offs.append(off)
            for floor, launch in (("bare", None), ("+launch", torch.zeros(1, device="cuda"))):
                undo = plain_wrappers(points, launch)
                try:
                    samples[floor].append(timed(call, iterations) / off)
                finally:
                    undo()
            for name, extra in flights.items():
                env = {
                    "MOEREPLAY_CAPTURE": "1",
                    "MOEREPLAY_DIR": str(out_dir / f"m{m}-{name}-r{round_index}"),
                    **QUEUE,
                    **extra,
                }
                session = session_module.arm(env)
                assert session is not None
                if name == "layer-nopoll":
                    session.writer._poll = None
                timers = None
                if options.phases and name == "layer-nopoll" and round_index == rounds - 1:
                    timers, undo_timers = phase_timers.install()
                profiler = None
                if (
                    options.profile
                    and m == options.profile_m
                    and round_index == rounds - 1
                    and name == "flight-layer"
                ):
                    import cProfile

                    profiler = cProfile.Profile()
                    profiler.enable()
                samples[name].append(timed(call, iterations) / off)
                if timers is not None:
                    undo_timers()
                    pieces = ", ".join(
                        f"{piece} {ns / max(count, 1) / 1e3:.1f} µs ×{count / (iterations + 3):.1f}"
                        for piece, (ns, count, _cpu) in timers.items()
                    )
                    print(
                        f"--- M={m} layer-nopoll, per call of each piece (× calls per layer call): {pieces}"
                    )
                if profiler is not None:
                    import pstats

                    profiler.disable()
                    print(f"--- cProfile of the serving thread, {name}, M={m}, {iterations} calls")
                    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
                    print("--- the same, moereplay's functions by cumulative time")
                    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(
                        "moereplay", 25
                    )
                    print(f"--- the footer's timers: {recorder_cost(session.recorder.counter_values())}")
                assert session.flush(timeout=60)
                disabled = session.recorder.disabled_reason
                counters = session.recorder.counter_values()
                session_module.disarm()
                if disabled:
                    result[f"{name} disabled"] = disabled
                result[f"{name} counters"] = {k: v for k, v in counters.items() if v}
        result["off_ms"] = statistics.median(offs) * 1e3
        for name, values in samples.items():
            result[f"{name} ratio"] = statistics.median(values)
            result[f"{name} spread"] = [round(min(values), 3), round(max(values), 3)]
        for mode, extra in modes:
            env = {
                "MOEREPLAY_CAPTURE": "1",
                "MOEREPLAY_DIR": str(out_dir / f"m{m}-{mode.replace(' ', '-')}"),
                **QUEUE,
                **extra,
            }
            session = session_module.arm(env)
            assert session is not None
            started = time.perf_counter()
            per_call = timed(call, iterations)
            assert session.flush(timeout=900)
            drained = time.perf_counter() - started
            if mode.startswith("full"):
                phases = dict(session.writer.seconds)
                sink = cast(FormatSink, session.writer.sink)  # arm's default sink: the capture file
                phases.update(sink.writer.phase_seconds)
                result[f"{mode} writer s"] = {key: round(value, 3) for key, value in phases.items()}
            writer = session.writer.counters
            recorder = session.recorder.counters
            disabled = session.recorder.disabled_reason
            session_module.disarm()
            size = session.path.stat().st_size
            result[f"{mode} ms"] = per_call * 1e3
            result[f"{mode} ratio"] = per_call * 1e3 / float(result["off_ms"])  # type: ignore[arg-type]
            if mode.startswith("full"):
                result[f"{mode} calls"] = writer.recorded
                drops = writer.dropped_queue_full + writer.outputs_dropped + recorder.dropped_queue_full
                result[f"{mode} drops"] = drops
                result[f"{mode} copied MB"] = writer.copied_bytes / 1e6
                result[f"{mode} file MB"] = size / 1e6
                result[f"{mode} MB/s copied"] = writer.copied_bytes / 1e6 / drained
                result[f"{mode} MB/s file"] = size / 1e6 / drained
                result[f"{mode} drain s"] = drained
            if disabled:
                result[f"{mode} disabled"] = disabled
        rows.append(result)
        print(json.dumps(result), flush=True)

    full_modes = [mode for mode, _ in modes if mode.startswith("full")]
    header = (
        f"{'M':>5} {'off ms':>8} {'bare×':>7} {'+launch×':>8} {'flight-layer×':>13} {'flight-kernel×':>14}"
    )
    for mode in full_modes:
        header += f" | {mode + ' ×':>13} {'MB/s copied':>11} {'MB/s file':>9} {'drops':>5}"
    print("\n" + header)
    for row in rows:
        line = (
            f"{row['M']:>5} {row['off_ms']:8.3f} {row['bare ratio']:7.3f} {row['+launch ratio']:8.3f} "
            f"{row['flight-layer ratio']:13.3f} {row['flight-kernel ratio']:14.3f}"
        )
        for name in ("armed-none", "layer-nopoll"):
            if f"{name} ratio" in row:
                line += f" {name}× {row[f'{name} ratio']:.3f}"
        for mode in full_modes:
            line += (
                f" | {row[f'{mode} ratio']:13.3f} {row[f'{mode} MB/s copied']:11.1f} "
                f"{row[f'{mode} MB/s file']:9.1f} {row[f'{mode} drops']:5d}"
            )
        print(line)
    print(
        "targets: flight-layer× ≤ 1.05 (the default flight recorder); full capture ≥ 1000 MB/s copied (sustained, prefill M = 2048)"
    )
    print(
        "floor: bare× = a pass-through wrapper per wrapped call; +launch× = that plus one tiny kernel launch each"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
