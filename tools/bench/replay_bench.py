"""Replay speed on the GPU: capture → verdict latency for one gpt-oss Marlin call, and variants per second in a sweep.

The call is gemm2 of vLLM 0.25.1's ``fused_marlin_moe`` at gpt-oss NVFP4 shapes (E=32, N=K=2880 — K padded to 2944
as the published report did — 32 tokens × top-4 rows pre-expanded, ``moe_block_size=16``, float32 routing
weights: a correct call). It is recorded with ``CaptureWriter``, then replayed through ``moereplay.replay.replay``
with its defaults (kernel in a pooled worker process, guard bands, fp32 reference, findings):

- cold: the first replay (worker start, imports, CUDA context, kernel JIT, reference dequantisation);
- warm: the same replay again (target ≤ 2 s);
- sweep: a replay with 40 distinct variants (block size × atomic add × fp32 reduce × tile), run twice; the second
  run's variants ÷ its wall time (target ≥ 100/s).

Each sweep prints where its time went (``ReplayReport.phases``, ms and ms per variant): ``load`` (capture → device;
a second session over an unchanged file reuses the loaded call), ``apply`` / ``contracts`` (mutations, re-derived
routing), ``reference`` (computed once per distinct reference-relevant input, then cached per loaded call),
``kernel_roundtrip`` (request → reply from the worker; minus the ``worker.*`` phases it is IPC), ``worker.apply`` /
``worker.scratch`` / ``worker.materialise`` (guarded buffers: pooled allocations, guards re-filled, spans re-copied) /
``worker.kernel`` / ``worker.check`` (guard check, output copy-out) / ``worker.write_outputs``, ``output_to_device``,
``judge`` (compare + findings), and ``unaccounted`` (the rest of the wall time).

Usage (GPU machine)::

    python tools/bench/replay_bench.py --pack /path/to/pack      # or with vLLM importable: no --pack
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

E, N, K_RAW, K = 32, 2880, 2880, 2944
TOKENS, TOP_K, BLOCK = 32, 4, 16


def build_call() -> dict[str, Any]:
    """Weights from vLLM's own NVFP4 Marlin helper (K padded with zero columns), routing aligned by vLLM."""
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    device = torch.device("cuda")
    qweights, scales, global_scales = [], [], []
    for _ in range(E):
        dense = torch.randn(N, K, device=device, dtype=torch.bfloat16) / 20
        dense[:, K_RAW:] = 0
        _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(dense, 16)
        qweights.append(qweight)
        scales.append(scale)
        global_scales.append(global_scale)
    topk_weights, topk_ids = torch.topk(
        torch.softmax(torch.randn(TOKENS, E, device=device), -1), TOP_K, dim=-1
    )
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids.to(torch.int32), BLOCK, E)
    rows = TOKENS * TOP_K
    activations = torch.randn(rows, K, device=device, dtype=torch.bfloat16) * 0.5
    activations[:, K_RAW:] = 0
    return {
        "input": activations,
        "output": torch.zeros(rows, N, dtype=torch.bfloat16, device=device),
        "b_qweight": torch.stack(qweights),
        "b_bias": None,
        "b_scales": torch.stack(scales),
        "a_scales": None,
        "global_scale": torch.stack(global_scales).reshape(E).to(torch.float32),
        "b_qzeros": None,
        "g_idx": None,
        "perm": None,
        "workspace": marlin_make_workspace_new(device, 4),
        "sorted_token_ids": sorted_ids,
        "expert_ids": expert_ids,
        "num_tokens_past_padded": padded,
        "topk_weights": topk_weights.reshape(-1).to(torch.float32),
        "moe_block_size": BLOCK,
        "top_k": 1,
        "mul_topk_weights": True,
        "b_q_type": scalar_types.float4_e2m1f.id,
        "size_m": rows,
        "size_n": N,
        "size_k": K,
        "is_k_full": True,
        "use_atomic_add": False,
        "use_fp32_reduce": True,
        "is_zp_float": False,
        "thread_k": -1,
        "thread_n": -1,
        "blocks_per_sm": -1,
    }


def record(path: Path, args: dict[str, Any]) -> None:
    import vllm._custom_ops as ops
    from vllm.scalar_type import ScalarType

    from moereplay.format import CaptureWriter

    with CaptureWriter(path, header={"purpose": "tools/bench/replay_bench.py"}) as writer:
        index = writer.begin_call(
            "moe_wna16_marlin_gemm", args, static=("b_qweight", "b_scales", "global_scale")
        )
        output = ops.moe_wna16_marlin_gemm(**dict(args, b_q_type=ScalarType.from_id(args["b_q_type"])))
        torch.cuda.synchronize()
        writer.complete_call(index, {"output": args["output"], "return": output})


def sweep_variants() -> list[Any]:
    from moereplay.replay.mutations import SetValue, Variant

    variants = []
    for block, atomic, fp32, tile in itertools.product(
        (8, 16, 32, 48, 64), (False, True), (True, False), (0, 1)
    ):
        changes = [SetValue("moe_block_size", block), SetValue("use_atomic_add", atomic)]
        changes.append(SetValue("use_fp32_reduce", fp32))
        if tile:
            changes += [SetValue("thread_k", 128), SetValue("thread_n", 64)]
        variants.append(Variant(tuple(changes)))
    return variants


def print_phases(title: str, phases: dict[str, float] | Any, wall_s: float | None, evaluations: int) -> None:
    """One line per phase: total ms and ms per evaluation (variants + baseline); worker IPC and the unaccounted
    rest derived from the totals."""
    rows = dict(phases)
    worker = sum(seconds for name, seconds in rows.items() if name.startswith("worker."))
    if "kernel_roundtrip" in rows:
        rows["ipc (roundtrip - worker.*)"] = rows["kernel_roundtrip"] - worker
    if wall_s is not None:
        accounted = sum(
            seconds for name, seconds in phases.items() if not name.startswith("worker.") and "/" not in name
        )  # judge/* are parts of judge
        rows["unaccounted"] = wall_s - accounted
    print(f"{title}: where the time went ({evaluations} evaluations)")
    for name, seconds in rows.items():
        print(f"  {name:<28} {seconds * 1e3:9.1f} ms {seconds * 1e3 / max(1, evaluations):8.2f} ms/eval")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", default=None, help="kernel pack directory (else the installed vLLM)")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the capture (default: a temp folder)"
    )
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("replay_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    backend = "vllm"
    if options.pack:
        from moereplay.pack import load_pack

        load_pack(options.pack)
        backend = f"pack:{options.pack}"
    from moereplay.replay import Verdict, replay

    folder = options.out or Path(tempfile.mkdtemp(prefix="replay-bench-"))
    path = folder / "gpt_oss_gemm2.moe.zst"
    record(path, build_call())
    print(
        f"capture: {path} ({path.stat().st_size / 1e6:.1f} MB), backend {backend}, {torch.cuda.get_device_name()}"
    )

    start = time.perf_counter()
    cold = replay(path, call=0, backend=backend)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    warm = replay(path, call=0, backend=backend)
    warm_s = time.perf_counter() - start
    print(f"capture -> verdict, cold: {cold_s:.3f} s ({cold.baseline.verdict.value})")
    print(f"capture -> verdict, warm: {warm_s:.3f} s ({warm.baseline.verdict.value}; target <= 2 s)")
    kernel = warm.baseline.elapsed_s
    print(f"kernel time (min over repeats): {kernel * 1e3:.3f} ms" if kernel else "kernel time: -")

    variants = sweep_variants()
    first = replay(path, call=0, backend=backend, mutations=variants)  # compiles every instantiation once
    start = time.perf_counter()
    second = replay(path, call=0, backend=backend, mutations=variants)
    sweep_s = time.perf_counter() - start
    verdicts: dict[str, int] = {}
    for item in second.variants:
        verdicts[item.verdict.value] = verdicts.get(item.verdict.value, 0) + 1
    rate = len(second.variants) / sweep_s
    print_phases("first sweep", first.phases, None, len(first.variants) + 1)
    print_phases("second sweep", second.phases, sweep_s, len(second.variants) + 1)
    print(
        f"sweep: {len(second.variants)} variants (+ baseline) in {sweep_s:.3f} s = {rate:.1f} variants/s "
        f"(target >= 100/s); first pass {sum(1 for v in first.variants if v.verdict is Verdict.OK)} ok; "
        f"verdicts {verdicts}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
