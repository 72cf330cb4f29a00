"""The Marlin MoE reference against vLLM's kernel at gpt-oss shapes: GPU time, cached-weights time, CPU time.

Cases: gpt-oss (E=32 experts, top_k=4, 32 tokens, hidden 2880, intermediate 2880 padded to 2944) in NVFP4 and
MXFP4, gemm1 (``[32, 2880] x [2880, 5888]``, top_k=4) and gemm2 (``[128, 2944] x [2944, 2880]``, top_k=1 with the
routing weights multiplied in), ``moe_block_size`` 8 as ``fused_marlin_moe`` picks it, bfloat16 activations.
Weights are packed by moereplay (bit-identical to vLLM's preparation, see tests/gpu/test_marlin_reference.py).

One run prints, per case: the kernel's time (median of CUDA-event timings), the reference's time on the GPU from
scratch (dequantisation + matmuls) and with an ``ExpertWeightCache`` already holding the dense weights, the
reference on the CPU (same call, tensors copied to the CPU), each as a ratio to the kernel, and the kernel's
max/RMS relative error against the reference as a sanity check. Without a GPU (or without an importable vLLM)
the GPU columns are skipped — said so on stdout — and the CPU reference runs on a locally packed call.

Usage (GPU machine, repository root)::

    source tools/gpu/device_setup.sh && python3 tools/bench/reference_bench.py
    python3 tools/bench/reference_bench.py --no-cpu           # GPU columns only
    python3 tools/bench/reference_bench.py --cases nvfp4-gemm1 --cpu-repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moereplay.ops.base import positional
from moereplay.ops.marlin_moe import MARLIN_MOE
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


def measure(case: Case, device: torch.device, *, gpu: bool, cpu: bool, repeats: int, cpu_repeats: int) -> Row:
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
        cache = ExpertWeightCache()
        cached = gpu_ms(
            lambda: reference_moe_wna16_marlin_gemm(**args, weight_cache=cache), max(3, repeats // 2)
        )
    if cpu:
        cpu_args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        cpu_time = cpu_ms(lambda: reference_moe_wna16_marlin_gemm(**cpu_args), cpu_repeats)
    return Row(kernel, reference, cached, cpu_time, error)


def profile_reference(case: Case, device: torch.device) -> None:
    """Where one reference call spends its time: the top ops by device (GPU) or CPU time."""
    from torch.profiler import ProfilerActivity, profile

    args = build_call(case, device)
    reference_moe_wna16_marlin_gemm(**args)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        reference_moe_wna16_marlin_gemm(**args)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- {case.name}: reference profile ({key})")
    print(prof.key_averages().table(sort_by=key, row_limit=12))


def _cell(value: float | None, width: int, digits: int = 3) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def _ratio(value: float | None, base: float | None, width: int = 6) -> str:
    return f"{value / base:>{width - 1}.1f}x" if value is not None and base else f"{'-':>{width}}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--repeats", type=int, default=20, help="GPU timings per measurement (median)")
    parser.add_argument("--cpu-repeats", type=int, default=1, help="CPU reference runs per case (best)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU reference")
    parser.add_argument(
        "--profile", action="store_true", help="also print the reference's top ops (torch.profiler) per case"
    )
    options = parser.parse_args()
    chosen = [c for c in CASES if c.name in options.cases.split(",")]
    if not chosen:
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
        f"{'case':<12} {'shape':<26} {'kernel ms':>9} {'ref ms':>8} {'x':>6} {'cached ms':>9} {'x':>6} "
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
        )
        if options.profile:
            profile_reference(case, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(
            f"{case.name:<12} {f'[{rows},{size_k}]x[{size_k},{size_n}]':<26} {_cell(row.kernel, 9)} "
            f"{_cell(row.reference, 8, 2)} {_ratio(row.reference, row.kernel)} {_cell(row.cached, 9, 2)} "
            f"{_ratio(row.cached, row.kernel)} {_cell(row.cpu, 8, 0)} {_ratio(row.cpu, row.kernel, 9)} "
            f"{_ratio(row.cpu, row.reference, 9)}  {row.error}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
