"""The exact references against the kernels they check, at model shapes: GPU time, cached-weights time, CPU time.

Cases:

- Marlin (``moe_wna16_marlin_gemm``): gpt-oss (E=32 experts, top_k=4, 32 tokens, hidden 2880, intermediate 2880
  padded to 2944) in NVFP4 and MXFP4, gemm1 (``[32, 2880] x [2880, 5888]``, top_k=4) and gemm2
  (``[128, 2944] x [2944, 2880]``, top_k=1 with the routing weights multiplied in), ``moe_block_size`` 8 as
  ``fused_marlin_moe`` picks it, bfloat16 activations; weights packed by moereplay (bit-identical to vLLM's
  preparation, see tests/gpu/test_marlin_reference.py);
- ``triton-qwen3-bf16``: vLLM's Triton ``fused_moe_kernel`` at Qwen3-30B-A3B gemm1 shapes (E=128, top-8, 64 tokens,
  K=2048, N=2·768, bf16, ``BLOCK_SIZE_M`` 16) — issue 18's budget is 10× the kernel; the reference is also timed
  with other :data:`moereplay.reference.fused_moe_triton.DENSE_ELEMENTS_AT_ONCE` run sizes (``--runs``) and with
  one product per expert instead of the GPU's bucketed batched products;
- ``triton-qwen3-int4`` and ``triton-deepseek-fp8``: the synth presets ``qwen3-30b-a3b-int4-w13`` (GPTQ int4 group
  128 through ``fused_moe_kernel_gptq_awq``) and ``deepseek-v3-fp8-w13`` (fp8 block-128, 32 local of 256 experts
  through an expert map) at 64 tokens, synthesized with the kernel at the start of the run (GPU only);
- ``ogs-mxfp4-w13``: triton_kernels ``matmul_ogs`` on the bundled ``captures/ogs-mxfp4-w13-k2880.moe.zst``
  (gpt-oss-20b w13: 64 tokens, E=32, top-4, K=2880, N=5760, Hopper-swizzled MXFP4, gather, bias, swiglu).

One run prints, per case: the kernel's time, the reference's time on the GPU from scratch (dequantisation +
matmuls) and — Marlin — with an ``ExpertWeightCache`` already holding the dense weights, the reference on the CPU
(same call, tensors on the CPU), each as a ratio to the kernel, and a sanity check: Marlin, the kernel's max/RMS
relative error against the reference; the other cases, the GPU reference's against the CPU reference (they differ
only by summation order). Marlin times are medians of CUDA-event timings; the other cases' are medians of
wall-clock times with a device sync (as ``tests/gpu/test_fused_moe_triton_gpu.py`` times them: the launchers'
host work counts). Without a GPU (or without an importable vLLM or kernel pack) the GPU columns are skipped —
said so on stdout — and the CPU reference runs on a locally built call.

Usage (GPU machine, repository root)::

    source tools/gpu/device_setup.sh && python3 tools/bench/reference_bench.py
    python3 tools/bench/reference_bench.py --no-cpu           # GPU columns only
    python3 tools/bench/reference_bench.py --cases nvfp4-gemm1,triton-qwen3-bf16 --cpu-repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moereplay.ops.base import positional
from moereplay.ops.marlin_moe import MARLIN_MOE
from moereplay.reference import marlin_rows
from moereplay.reference.marlin_formats import MarlinWeightFormat, random_logical_experts
from moereplay.reference.marlin_moe import ExpertWeightCache, reference_moe_wna16_marlin_gemm
from moereplay.reference.moe_align import moe_align_block_size

E, TOKENS, TOP_K, HIDDEN, INTERMEDIATE = 32, 32, 4, 2880, 2944
BLOCK = 8  # fused_marlin_moe: the first of 8, 16, 32, 48, 64 with tokens * top_k / E / block < 0.9


@dataclass(frozen=True)
class Case:
    name: str
    fmt: MarlinWeightFormat
    gemm: str  # "gemm1" or "gemm2"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows of input, K, N)."""
        if self.gemm == "gemm1":
            return TOKENS, HIDDEN, 2 * INTERMEDIATE
        return TOKENS * TOP_K, INTERMEDIATE, HIDDEN


CASES = [
    Case("nvfp4-gemm1", MarlinWeightFormat.NVFP4, "gemm1"),
    Case("nvfp4-gemm2", MarlinWeightFormat.NVFP4, "gemm2"),
    Case("mxfp4-gemm1", MarlinWeightFormat.MXFP4, "gemm1"),
    Case("mxfp4-gemm2", MarlinWeightFormat.MXFP4, "gemm2"),
]


def build_call(case: Case, device: torch.device) -> dict[str, Any]:
    """The kernel's arguments (moereplay's packing; K zero-padded past the logical 2880 like vLLM pads it)."""
    rows, size_k, size_n = case.shape
    gen = torch.Generator(device).manual_seed(2024)
    logical = random_logical_experts(
        case.fmt,
        E,
        size_k,
        size_n,
        with_bias=case.fmt is MarlinWeightFormat.MXFP4,
        generator=gen,
        device=device,
    )
    if size_k > HIDDEN:  # the padded rows of K hold code 0 (= 0.0)
        logical.codes[:, HIDDEN:, :] = 0
    packed = logical.pack(torch.bfloat16, with_dense=False)
    cpu_gen = torch.Generator().manual_seed(77)
    weights, ids = torch.topk(torch.softmax(torch.randn(TOKENS, E, generator=cpu_gen), -1), TOP_K)
    sorted_ids, expert_ids, padded = moe_align_block_size(ids.to(device=device, dtype=torch.int32), BLOCK, E)
    x = torch.randn(rows, size_k, generator=cpu_gen).to(device=device, dtype=torch.bfloat16)
    x[:, HIDDEN:] = 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    args: dict[str, Any] = {
        "input": x,
        "output": torch.empty(
            (rows * (TOP_K if case.gemm == "gemm1" else 1), size_n), dtype=x.dtype, device=device
        ),
        "b_qweight": packed.b_qweight,
        "b_bias": packed.b_bias,
        "b_scales": packed.b_scales,
        "a_scales": None,
        "global_scale": packed.global_scale,
        "b_qzeros": None,
        "g_idx": None,
        "perm": None,
        "workspace": torch.zeros(sms * 4, dtype=torch.int32, device=device),
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_past_padded": padded,
        "topk_weights": weights.to(device=device, dtype=torch.float32),
        "moe_block_size": BLOCK,
        "top_k": TOP_K if case.gemm == "gemm1" else 1,
        "mul_topk_weights": case.gemm == "gemm2",
        "b_q_type": case.fmt.scalar_type.id,
        "size_m": rows,
        "size_n": size_n,
        "size_k": size_k,
        "is_k_full": True,
        "use_atomic_add": False,
        "use_fp32_reduce": True,
        "is_zp_float": False,
    }
    return args


@dataclass(frozen=True)
class CallCase:
    """A case replayed through its OpSpec: ``build(device)`` returns ``(op, args)``; ``op.run`` is the kernel."""

    name: str
    shape: str
    build: Callable[[torch.device], tuple[Any, dict[str, Any]]]
    gpu_only: bool = False  # built with the kernel (synth presets): skipped without a GPU


def triton_qwen3(device: torch.device) -> tuple[Any, dict[str, Any]]:
    """Qwen3-30B-A3B's gemm1 launch of ``fused_moe_kernel`` as ``fused_experts_impl`` makes it (64 tokens); drawn
    on the CPU (the same values whichever the device), then moved."""
    from moereplay.ops import get_op
    from moereplay.ops.fused_moe_triton_surface import CONFIG_DEFAULTS
    from moereplay.synth.routing import softmax_topk
    from moereplay.synth.triton_presets import triton_args

    experts, top_k, tokens, hidden, intermediate = 128, 8, 64, 2048, 768
    gen = torch.Generator().manual_seed(2024)
    weight = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(torch.bfloat16)
    topk = softmax_topk(tokens, experts, top_k, 3, renormalize=True)
    config = {
        "BLOCK_SIZE_M": 16,
        "BLOCK_SIZE_N": 64,
        "BLOCK_SIZE_K": 128,
        "GROUP_SIZE_M": 1,
        **CONFIG_DEFAULTS,
    }
    config.update(num_warps=4, num_stages=3)
    args = triton_args(
        A=x, weights={"B": weight}, topk_weights=topk.weights, topk_ids=topk.ids, experts=experts,
        config=config, compute="bfloat16",
    )  # fmt: skip
    op = get_op("fused_moe_kernel")
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return op, op.recorded_args(moved)  # type: ignore[attr-defined]


def ogs_w13(device: torch.device) -> tuple[Any, dict[str, Any]]:
    """The bundled gpt-oss-20b w13 ``matmul_ogs`` capture (its weights expand from recipes once per machine)."""
    from moereplay.replay.source import load_call

    call = load_call(
        Path(__file__).resolve().parents[2] / "captures" / "ogs-mxfp4-w13-k2880.moe.zst", 0, device
    )
    return call.op, call.args


_SYNTHESIZED: dict[str, Path] = {}


def synth_case(preset: str, overrides: list[str]) -> Callable[[torch.device], tuple[Any, dict[str, Any]]]:
    """A synth preset's first call: synthesized once per run with the kernel (its outputs are the kernel's) into a
    temporary file, then loaded on the asked device (the CPU column reads the same file)."""

    def build(device: torch.device) -> tuple[Any, dict[str, Any]]:
        import tempfile

        from moereplay.replay.source import load_call
        from moereplay.synth.build import synthesize

        if preset not in _SYNTHESIZED:
            pack = os.environ.get("MOEREPLAY_PACK")
            path = Path(tempfile.mkdtemp(prefix="reference-bench-")) / f"{preset}.moe.zst"
            synthesize(
                preset, path, overrides=overrides, store="bytes",
                backend=f"pack:{pack}" if pack else "vllm", device="cuda",
            )  # fmt: skip
            _SYNTHESIZED[preset] = path
        call = load_call(_SYNTHESIZED[preset], 0, device)
        return call.op, call.args

    return build


CALL_CASES = [
    CallCase("triton-qwen3-bf16", "[512 rows,2048]x128 x[2048,1536]", triton_qwen3),
    CallCase(
        "triton-qwen3-int4",
        "[512 rows,2048]x128 x[2048,1536] g128",
        synth_case("qwen3-30b-a3b-int4-w13", ["tokens=64"]),
        gpu_only=True,
    ),
    CallCase(
        "triton-deepseek-fp8",
        "[512 rows,7168]x32/256 x[7168,4096]",
        synth_case("deepseek-v3-fp8-w13", ["tokens=64"]),
        gpu_only=True,
    ),
    CallCase(
        "triton-qwen3-int4-p",
        "[8192 rows,2048]x128 x[2048,1536] g128",
        synth_case("qwen3-30b-a3b-int4-w13", ["tokens=1024"]),
        gpu_only=True,
    ),
    CallCase(
        "triton-deepseek-fp8-p",
        "[4096 rows,7168]x32/256 x[7168,4096]",
        synth_case("deepseek-v3-fp8-w13", ["tokens=512"]),
        gpu_only=True,
    ),
    CallCase("ogs-mxfp4-w13", "[256 rows,2880]x32 x[2880,5760]", ogs_w13),
]
"""The ``-p`` cases are prefill-shaped (about 64 and 128 rows per used expert): the reference's products are
compute-bound there, its dequantisation as at decode."""


def kernel_backend(device: torch.device) -> Any:
    """vLLM's kernels: the kernel pack in ``MOEREPLAY_PACK`` (the device prelude sets it), else the installed vLLM."""
    from moereplay.replay.backends import load_backend, parse_backend

    pack = os.environ.get("MOEREPLAY_PACK")
    if pack:
        from moereplay.pack import load_pack

        load_pack(pack)
        return load_backend(parse_backend(f"pack:{pack}"), device)
    return load_backend(parse_backend("vllm"), device)


def wall_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time (ms) of ``repeats`` calls, each ended by a device sync, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Max-per-row and RMS relative error of ``actual`` against ``expected`` (float64, finite elements)."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    finite = torch.isfinite(a) & torch.isfinite(e)
    a, e = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)
    row_max = (a - e).abs().amax(1) / e.abs().amax(1).clamp_min(1e-30)
    rms = float(((a - e) ** 2).sum() / (e**2).sum().clamp_min(1e-30)) ** 0.5
    return f"max_rel={float(row_max.max()):.2e} rms_rel={rms:.2e}"


def measure_call(
    case: CallCase,
    device: torch.device,
    *,
    gpu: bool,
    cpu: bool,
    repeats: int,
    cpu_repeats: int,
    runs: list[int],
    profile: bool = False,
) -> tuple[Row, list[str]]:
    """One :class:`CallCase`: kernel and reference wall times on the GPU (the Triton reference also at each run
    size of ``runs``), the reference on the CPU, the GPU reference against the CPU one."""
    kernel = reference = cpu_time = None
    notes: list[str] = []
    gpu_output = cpu_output = None
    if gpu:
        op, args = case.build(device)
        backend = kernel_backend(device)
        run_args = {**args, **op.make_scratch(args, device)}  # outputs and workspaces, as a replay makes them
        kernel = wall_ms(lambda: op.run(run_args, backend), repeats)
        reference = wall_ms(lambda: op.reference(args), max(3, repeats // 4))
        gpu_output = op.reference(args).output
        if profile:
            profile_call(case.name, lambda: op.reference(args), device)
        if case.name.startswith("triton"):
            notes += triton_variants(op, args, kernel, gpu_output, repeats, runs)
        del op, args, run_args
        torch.cuda.empty_cache()
    if cpu:
        op, args = case.build(torch.device("cpu"))
        cpu_time = cpu_ms(lambda: op.reference(args), cpu_repeats)
        cpu_output = op.reference(args).output
    error = (
        f"gpu ref vs cpu ref {relative_error(gpu_output, cpu_output)}"
        if gpu_output is not None and cpu_output is not None
        else ""
    )
    return Row(kernel, reference, None, cpu_time, error), notes


def triton_variants(
    op: Any, args: dict[str, Any], kernel: float, output: torch.Tensor, repeats: int, runs: list[int]
) -> list[str]:
    """The Triton reference timed again at each run size of ``runs``, with torch's dequantisation passes instead of
    the one-pass kernel (:mod:`moereplay.reference.dequant_dense`), and with one product per expert (the CPU's way) instead of the GPU's batched products, as
    notes; the modules' settings are restored afterwards."""
    from moereplay.reference import dequant_dense, fused_moe_triton

    notes = []
    default = fused_moe_triton.DENSE_ELEMENTS_AT_ONCE["cuda"]
    batched = fused_moe_triton.BATCHED_DEVICE_TYPES
    fused = dequant_dense.FUSED_DEVICE_TYPES
    try:
        dequant_dense.FUSED_DEVICE_TYPES = frozenset()
        timed = wall_ms(lambda: op.reference(args), max(3, repeats // 4))
        dense_output = op.reference(args).output
        dequant_dense.FUSED_DEVICE_TYPES = fused
        notes.append(
            f"torch dequantisation: ref {timed:.2f} ms = {timed / kernel:.1f}x kernel; "
            f"one-pass kernel vs torch {relative_error(output, dense_output)}"
        )
        for elements in runs:
            fused_moe_triton.DENSE_ELEMENTS_AT_ONCE["cuda"] = elements
            timed = wall_ms(lambda: op.reference(args), max(3, repeats // 4))
            notes.append(f"run of {elements} elements: ref {timed:.2f} ms = {timed / kernel:.1f}x kernel")
        fused_moe_triton.DENSE_ELEMENTS_AT_ONCE["cuda"] = default
        fused_moe_triton.BATCHED_DEVICE_TYPES = frozenset()
        timed = wall_ms(lambda: op.reference(args), max(3, repeats // 4))
        loop_output = op.reference(args).output
    finally:
        fused_moe_triton.DENSE_ELEMENTS_AT_ONCE["cuda"] = default
        fused_moe_triton.BATCHED_DEVICE_TYPES = batched
        dequant_dense.FUSED_DEVICE_TYPES = fused
    notes.append(
        f"one product per expert (the CPU's way): ref {timed:.2f} ms = {timed / kernel:.1f}x kernel; "
        f"batched vs per-expert {relative_error(output, loop_output)}"
    )
    return notes


def run_kernel(args: dict[str, Any]) -> torch.Tensor:
    """``torch.ops._moe_C.moe_wna16_marlin_gemm`` as vLLM's wrapper calls it (b_q_type as its id)."""
    return torch.ops._moe_C.moe_wna16_marlin_gemm(*positional(MARLIN_MOE, args))


def gpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median of CUDA-event timings (ms) after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time (ms) of ``repeats`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def kernel_error(out: torch.Tensor, expected: torch.Tensor, written: torch.Tensor) -> tuple[float, float]:
    """(max per-row, RMS) relative error of the kernel output against the reference, written rows only."""
    kernel = out.to(torch.float64)[written]
    ref = expected.to(torch.float64)[written]
    row_max = (kernel - ref).abs().amax(1) / ref.abs().amax(1).clamp_min(1e-30)
    rms = float(((kernel - ref) ** 2).sum() / (ref**2).sum().clamp_min(1e-30)) ** 0.5
    return float(row_max.max()), rms


def gpu_unavailable() -> str | None:
    """Why the GPU part cannot run, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        pack = os.environ.get("MOEREPLAY_PACK")
        if pack:
            from moereplay.pack import load_pack

            load_pack(pack)
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._moe_C)
    except Exception as e:  # any import failure means: no kernel to time
        return f"vLLM's kernels do not import ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


@dataclass(frozen=True)
class Row:
    """One case's measurements (ms; None = not measured)."""

    kernel: float | None
    reference: float | None
    cached: float | None
    cpu: float | None
    error: str


ROWS_VARIANT = re.compile(r"(\d+)x(\d+)(?:s(\d+))?(t?)")
"""``WARPSxCOLUMNS[sSPLITS][t]`` of ``--rows-variants``."""


def interleaved_paths(
    args: dict[str, Any],
    repeats: int,
    rounds: int,
    paths: dict[str, Callable[[], None]],
    reset: Callable[[], None],
) -> tuple[dict[str, float], dict[str, Any]]:
    """The GPU reference on each of ``paths`` (name → what switches to it), interleaved over ``rounds`` rounds:
    each path's median of its round medians (ms) and one result per path; ``reset`` restores the default after."""
    medians: dict[str, list[float]] = {name: [] for name in paths}
    results = {}
    try:
        for name, switch in paths.items():
            switch()
            results[name] = reference_moe_wna16_marlin_gemm(**args)
        for _ in range(rounds):
            for name, switch in paths.items():
                switch()
                medians[name].append(gpu_ms(lambda: reference_moe_wna16_marlin_gemm(**args), repeats))
    finally:
        reset()
    return {name: statistics.median(times) for name, times in medians.items()}, results


def time_launch_paths(args: dict[str, Any], kernel_ms: float, repeats: int, rounds: int = 5) -> None:
    """The GPU reference with every Triton launch through ``kernel[grid]`` and through
    :func:`moereplay.reference.launch.launch`'s direct path, interleaved over ``rounds`` rounds (median of each
    path's round medians), with their ratio, and whether both paths give the same output bits."""
    from moereplay.reference import launch as launches

    paths = {"triton": lambda: launches.set_direct(False), "direct": lambda: launches.set_direct(True)}
    ms, results = interleaved_paths(args, repeats, rounds, paths, lambda: launches.set_direct(None))
    same = torch.equal(results["triton"].output.view(torch.int32), results["direct"].output.view(torch.int32))
    print(
        f"  launch paths ({rounds} rounds): kernel[grid] {ms['triton']:.3f} ms ({ms['triton'] / kernel_ms:.1f}x), "
        f"direct {ms['direct']:.3f} ms ({ms['direct'] / kernel_ms:.1f}x), direct/kernel[grid] "
        f"{ms['direct'] / ms['triton']:.3f}; same output bits: {same}",
        flush=True,
    )


def time_routing_paths(args: dict[str, Any], kernel_ms: float, repeats: int, rounds: int = 5) -> None:
    """The GPU reference with the call routed on the host (numpy, one read of the routing arrays before the first
    launch) and on the device (:func:`marlin_rows.route_on_device`), interleaved over ``rounds`` rounds (median of
    each path's round medians), with their ratio, and whether both give the same output bits and notes."""

    def route_on(on_device: bool) -> Callable[[], None]:
        return lambda: setattr(marlin_rows, "ROUTE_ON_DEVICE", on_device)

    paths = {"host": route_on(False), "device": route_on(True)}
    ms, results = interleaved_paths(args, repeats, rounds, paths, route_on(True))
    host, device = results["host"], results["device"]
    same = (
        torch.equal(host.output.view(torch.int32), device.output.view(torch.int32))
        and host.notes == device.notes
    )
    print(
        f"  routing ({rounds} rounds): on the host {ms['host']:.3f} ms ({ms['host'] / kernel_ms:.1f}x), "
        f"on the device {ms['device']:.3f} ms ({ms['device'] / kernel_ms:.1f}x), device/host "
        f"{ms['device'] / ms['host']:.3f}; same output bits and notes: {same}",
        flush=True,
    )


def time_rows_variants(args: dict[str, Any], kernel_ms: float, variants: list[str], repeats: int) -> None:
    """The GPU reference again with other launch shapes of the packed-code kernel, one line each: ``WARPSxCOLUMNS``
    (:data:`marlin_rows.NUM_WARPS`, :data:`marlin_rows.BLOCK_N`), ``sSPLITS`` for at most that many K splits
    (:data:`marlin_rows.MAX_SPLITS`), a trailing ``t`` for table lookups of the 4-bit codes
    (:data:`marlin_rows.ARITHMETIC_DECODE` off); with the device time of the call's ``marlin_rows`` launches."""
    saved = marlin_rows.NUM_WARPS, marlin_rows.BLOCK_N, marlin_rows.ARITHMETIC_DECODE, marlin_rows.MAX_SPLITS
    try:
        for variant in variants:
            match = ROWS_VARIANT.fullmatch(variant.strip().lower())
            if match is None:
                print(f"  marlin_rows variant {variant!r}: not WARPSxCOLUMNS[sSPLITS][t]")
                continue
            warps, columns = int(match[1]), int(match[2])
            splits = int(match[3]) if match[3] else saved[3]
            table = bool(match[4])
            marlin_rows.NUM_WARPS, marlin_rows.BLOCK_N = warps, columns
            marlin_rows.ARITHMETIC_DECODE, marlin_rows.MAX_SPLITS = not table, splits
            ms = gpu_ms(lambda: reference_moe_wna16_marlin_gemm(**args), max(3, repeats // 4))
            device_us = kernel_device_us(lambda: reference_moe_wna16_marlin_gemm(**args), "marlin_rows")
            decode = "table" if table else "arithmetic"
            print(
                f"  marlin_rows {warps} warps x {columns} columns, at most {splits} K splits, {decode} decode: "
                f"reference {ms:.3f} ms = {ms / kernel_ms:.1f}x kernel; marlin_rows {device_us:.0f} µs on the device"
            )
    finally:
        marlin_rows.NUM_WARPS, marlin_rows.BLOCK_N, marlin_rows.ARITHMETIC_DECODE, marlin_rows.MAX_SPLITS = (
            saved
        )


def kernel_device_us(fn: Callable[[], object], name: str, calls: int = 5) -> float:
    """Device µs per call of ``fn`` spent in kernels called ``name`` (torch.profiler, mean of ``calls`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages() if e.key == name)
    return total / calls


def measure(
    case: Case,
    device: torch.device,
    *,
    gpu: bool,
    cpu: bool,
    repeats: int,
    cpu_repeats: int,
    rows_variants: list[str] | None = None,
    launch_paths: bool = False,
    routing_paths: bool = False,
) -> Row:
    args = build_call(case, device)
    kernel = reference = cached = cpu_time = None
    error = ""
    if gpu:
        ref = reference_moe_wna16_marlin_gemm(**args)
        out = run_kernel(args)
        torch.cuda.synchronize()
        max_rel, rms = kernel_error(out, ref.output, ref.written)
        error = f"max_rel={max_rel:.2e} rms_rel={rms:.2e}"
        del ref, out
        kernel = gpu_ms(lambda: run_kernel(args), repeats)
        reference = gpu_ms(lambda: reference_moe_wna16_marlin_gemm(**args), max(3, repeats // 4))
        if rows_variants:
            time_rows_variants(args, kernel, rows_variants, repeats)
        if launch_paths:
            time_launch_paths(args, kernel, repeats)
        if routing_paths:
            time_routing_paths(args, kernel, repeats)
        cache = ExpertWeightCache()
        cached = gpu_ms(
            lambda: reference_moe_wna16_marlin_gemm(**args, weight_cache=cache), max(3, repeats // 2)
        )
    if cpu:
        cpu_args: dict[str, Any] = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        cpu_time = cpu_ms(lambda: reference_moe_wna16_marlin_gemm(**cpu_args), cpu_repeats)
    return Row(kernel, reference, cached, cpu_time, error)


def profile_reference(case: Case, device: torch.device) -> None:
    """Where one Marlin reference call spends its time (:func:`profile_call`) and where it waits for the device."""
    args = build_call(case, device)
    reference_moe_wna16_marlin_gemm(**args)  # warm-up
    profile_call(case.name, lambda: reference_moe_wna16_marlin_gemm(**args), device)
    if device.type == "cuda":
        print_syncs(case.name, lambda: reference_moe_wna16_marlin_gemm(**args))
    print_host_profile(case.name, lambda: reference_moe_wna16_marlin_gemm(**args), calls=20)
    if device.type == "cuda":
        print_stage_times(case.name, lambda: reference_moe_wna16_marlin_gemm(**args), calls=30)
        print_timeline(case.name, lambda: reference_moe_wna16_marlin_gemm(**args))


TIMELINE_STAGES = {
    "moereplay.reference.marlin_moe": (
        "_fetch_routing",
        "_route",
        "_group_rows",
        "_row_tables",
        "_to_device_together",
        "_host_routed_rows",
        "deferred_dequant_notes",
        "resolve_notes_reading",
        "unpermute_bias",
        "_finish_rows",
    ),
    "moereplay.reference.marlin_rows": (
        "route_on_device",
        "plan_rows",
        "expert_rows",
        "_scale_parts",
        "finish_rows",
    ),
}
"""Functions :func:`print_timeline` marks, by module (patched for the one profiled call, restored after)."""


@contextlib.contextmanager
def stages_wrapped(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Every function of :data:`TIMELINE_STAGES` replaced by ``wrap(label, function)`` (label ``module.function``)
    while the block runs, restored after."""
    import importlib

    saved: list[tuple[Any, str, Any]] = []
    try:
        for module_name, functions in TIMELINE_STAGES.items():
            module = importlib.import_module(module_name)
            for function in functions:
                original = getattr(module, function)
                saved.append((module, function, original))
                setattr(module, function, wrap(f"{module_name.rsplit('.', 1)[-1]}.{function}", original))
        yield
    finally:
        for module, function, original in saved:
            setattr(module, function, original)


def print_timeline(name: str, fn: Callable[[], object]) -> None:
    """One call of ``fn`` as a timeline (µs from its start): when the host enters and leaves each of
    :data:`TIMELINE_STAGES`, when each kernel and copy is issued and when it runs on the device. The device idles
    wherever no kernel runs; a kernel issued late is host time in front of it."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    def marked(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return function(*args, **kwargs)

        return wrapper

    with stages_wrapped(marked), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("call"):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    start = min(float(e["ts"]) for e in events if e.get("name") == "call")
    issued = {
        e["args"]["correlation"]: float(e["ts"]) - start
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    print(f"--- {name}: timeline of one call (µs from its start; host marks, then device work)")
    for e in sorted(events, key=lambda e: float(e["ts"])):
        at, took = float(e["ts"]) - start, float(e.get("dur", 0))
        if e.get("cat") == "user_annotation":
            print(f"host   {at:8.1f} {took:8.1f}  {e['name']}")
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            launch = issued.get(e.get("args", {}).get("correlation"))
            where = f"issued {launch:8.1f}" if launch is not None else "issued        ?"
            print(f"device {at:8.1f} {took:8.1f}  {where}  {e['name'][:70]}")


def print_stage_times(name: str, fn: Callable[[], object], calls: int) -> None:
    """Host µs a call of ``fn`` spends in each of :data:`TIMELINE_STAGES` and each Triton launch (inclusive, mean
    over ``calls`` calls; perf_counter around the functions, no profiler: the numbers the wall time is made of) and
    the call's median wall time with its closing sync."""
    spent: dict[str, float] = {}

    def timed(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - started

        return wrapper

    # every launch of the packed-code kernels goes through marlin_rows.launch (Triton's path or the direct one)
    original_launch = marlin_rows.launch

    def timed_launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        timed(f"launch {kernel.fn.__name__}", original_launch)(kernel, grid, *args, **meta)

    marlin_rows.launch = timed_launch
    walls = []
    try:
        with stages_wrapped(timed):
            fn()
            torch.cuda.synchronize()
            spent.clear()
            for _ in range(calls):
                started = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - started)
    finally:
        marlin_rows.launch = original_launch
    print(
        f"--- {name}: host µs per call by stage (inclusive, mean of {calls}); wall {statistics.median(walls) * 1e6:.0f} µs"
    )
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"    {seconds / calls * 1e6:8.1f}  {label}")


def print_host_profile(name: str, fn: Callable[[], object], calls: int) -> None:
    """Where the host spends a call of ``fn`` (cProfile over ``calls`` calls, by own time and by cumulative time):
    a host-bound reference is made faster by cutting these, not its kernels."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    for key, limit in (("tottime", 22), ("cumtime", 22)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(limit)
        lines = [line for line in text.getvalue().splitlines() if line.strip()]
        print(f"--- {name}: host profile of {calls} calls by {key}")
        print("\n".join(lines[-(limit + 2) :]))


def print_syncs(name: str, fn: Callable[[], object]) -> None:
    """The lines of Python that made one call of ``fn`` wait for the device (torch's sync debug mode)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    places = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    print(f"--- {name}: {len(places)} syncs a call: {', '.join(places) or 'none'}")


def profile_call(name: str, fn: Callable[[], object], device: torch.device) -> None:
    """Where one call of ``fn`` (already warmed up) spends its time: the top ops by device time, and by host
    time (a host-bound reference shows launches, not kernels, on top)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        print(f"--- {name}: reference profile ({key})")
        print(prof.key_averages().table(sort_by=key, row_limit=14))


def print_row(name: str, shape: str, row: Row) -> None:
    """One case's line of the table (columns as the header names them; ``-`` where the case has no value)."""
    print(
        f"{name:<17} {shape:<32} {_cell(row.kernel, 9)} {_cell(row.reference, 8, 2)} "
        f"{_ratio(row.reference, row.kernel)} {_cell(row.cached, 9, 2)} {_ratio(row.cached, row.kernel)} "
        f"{_cell(row.cpu, 8, 0)} {_ratio(row.cpu, row.kernel, 9)} {_ratio(row.cpu, row.reference, 9)}  "
        f"{row.error}",
        flush=True,
    )


def _cell(value: float | None, width: int, digits: int = 3) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def _ratio(value: float | None, base: float | None, width: int = 6) -> str:
    return f"{value / base:>{width - 1}.1f}x" if value is not None and base else f"{'-':>{width}}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c.name for c in CASES] + [c.name for c in CALL_CASES]
    parser.add_argument("--cases", default=",".join(names), help="comma-separated case names")
    parser.add_argument(
        "--runs",
        default=f"{1 << 23},{1 << 25}",
        help="extra float32 run sizes (elements) to time the Triton reference with; empty: none",
    )
    parser.add_argument("--repeats", type=int, default=20, help="GPU timings per measurement (median)")
    parser.add_argument("--cpu-repeats", type=int, default=1, help="CPU reference runs per case (best)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU reference")
    parser.add_argument(
        "--profile", action="store_true", help="also print the reference's top ops (torch.profiler) per case"
    )
    parser.add_argument(
        "--rows-variants",
        default="",
        help="Marlin cases: also time the reference with these packed-code kernel shapes, WARPSxCOLUMNS,...",
    )
    parser.add_argument(
        "--launch-paths",
        action="store_true",
        help="Marlin cases: also time the reference with Triton's launch path against the direct one",
    )
    parser.add_argument(
        "--routing-paths",
        action="store_true",
        help="Marlin cases: also time the reference with the call routed on the host against on the device",
    )
    options = parser.parse_args()
    chosen = [c for c in CASES if c.name in options.cases.split(",")]
    chosen_calls = [c for c in CALL_CASES if c.name in options.cases.split(",")]
    runs = [int(v) for v in options.runs.split(",") if v.strip()]
    if not chosen and not chosen_calls:
        print(f"reference_bench: no case among {options.cases!r}", file=sys.stderr)
        return 2

    why_not = gpu_unavailable()
    device = torch.device("cuda") if why_not is None else torch.device("cpu")
    gpu_name = torch.cuda.get_device_name(device) if why_not is None else "none"
    print(
        f"reference_bench: torch {torch.__version__}, GPU {gpu_name}, CPU threads {torch.get_num_threads()}; "
        "the reference runs its float32 matmuls at 'highest' precision (no TF32)"
    )
    if why_not is not None:
        print(f"reference_bench: GPU part skipped: {why_not}")
    print(
        f"{'case':<17} {'shape':<32} {'kernel ms':>9} {'ref ms':>8} {'x':>6} {'cached ms':>9} {'x':>6} "
        f"{'cpu ms':>8} {'x kernel':>9} {'x gpu ref':>9}  kernel vs ref"
    )
    for case in chosen:
        rows, size_k, size_n = case.shape
        row = measure(
            case,
            device,
            gpu=why_not is None,
            cpu=not options.no_cpu,
            repeats=options.repeats,
            cpu_repeats=options.cpu_repeats,
            rows_variants=[v for v in options.rows_variants.split(",") if v.strip()],
            launch_paths=options.launch_paths,
            routing_paths=options.routing_paths,
        )
        if options.profile:
            profile_reference(case, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print_row(case.name, f"[{rows},{size_k}]x[{size_k},{size_n}]", row)
    for call_case in chosen_calls:
        if call_case.gpu_only and why_not is not None:
            print(
                f"{call_case.name:<17} skipped: its call is synthesized with the kernel, and there is no GPU"
            )
            continue
        row, notes = measure_call(
            call_case,
            device,
            gpu=why_not is None,
            cpu=not options.no_cpu,
            repeats=options.repeats,
            cpu_repeats=options.cpu_repeats,
            runs=runs,
            profile=options.profile,
        )
        print_row(call_case.name, call_case.shape, row)
        for note in notes:
            print(f"{'':<17} {note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
