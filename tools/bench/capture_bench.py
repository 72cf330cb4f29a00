"""Capture overhead on the GPU: vLLM's real ``fused_marlin_moe`` (NVFP4, gpt-oss shapes: E=32, top-k 4,
hidden = intermediate = 2880) at decode M = 1, 8, 64 and prefill M = 2048, measured in one run with capture
off, flight recorder armed, and full capture. Prints per-call times, ratios to "off", and the sustained rate
of full capture (bytes queued for the file ÷ wall time, including the writer draining).

Usage (GPU machine, vLLM 0.25.1 importable, e.g. from a kernel pack on PYTHONPATH)::

    python tools/bench/capture_bench.py [--iterations 200] [--out DIR]

Targets (issue 4): armed ≤ 1.05×, full capture ≥ 1 GB/s sustained.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(experts: int = 32, hidden: int = 2880, inner: int = 2880):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import rand_marlin_weight_nvfp4_like

    def stack(n: int, k: int):
        q, s, g = [], [], []
        for _ in range(experts):
            _ref, qweight, scale, global_scale = rand_marlin_weight_nvfp4_like(
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20, 16
            )
            q.append(qweight)
            s.append(scale)
            g.append(global_scale)
        return torch.stack(q), torch.stack(s), torch.stack(g).reshape(experts)

    return stack(2 * inner, hidden), stack(hidden, inner)


def timed(call, iterations: int) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()

    from vllm.scalar_type import scalar_types

    from moereplay.capture import session as session_module

    marlin = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    torch.manual_seed(0)
    (w1, s1, g1), (w2, s2, g2) = build()
    experts, topk, hidden = 32, 4, 2880
    out_dir = options.out or Path(tempfile.mkdtemp(prefix="capture-bench-"))
    rows = []
    for m in (1, 8, 64, 2048):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(m, experts, device="cuda"), -1).topk(topk)
        ids = ids.to(torch.int32)

        def call(x=x, weights=weights, ids=ids) -> torch.Tensor:
            return marlin.fused_marlin_moe(
                x, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
                global_scale1=g1, global_scale2=g2,
            )  # fmt: skip

        iterations = options.iterations if m < 2048 else max(10, options.iterations // 10)
        result = {"M": m, "off_ms": timed(call, iterations) * 1e3}
        for mode, extra in (("flight", {"MOEREPLAY_TRIGGER": "flight"}), ("full", {})):
            env = {"MOEREPLAY_CAPTURE": "1", "MOEREPLAY_DIR": str(out_dir / f"m{m}-{mode}"),
                   "MOEREPLAY_QUEUE_BYTES": "8G", "MOEREPLAY_QUEUE_CALLS": "4096", **extra}  # fmt: skip
            session = session_module.arm(env)
            assert session is not None
            started = time.perf_counter()
            per_call = timed(call, iterations)
            session.flush(timeout=600)
            drained = time.perf_counter() - started
            counters = session.writer.counters.as_dict()
            copied = session.recorder.counters.selected
            session_module.disarm()
            size = session.path.stat().st_size
            result[f"{mode}_ms"] = per_call * 1e3
            result[f"{mode}_ratio"] = per_call * 1e3 / result["off_ms"]
            if mode == "full":
                queued = sum(p.stat().st_size for p in [session.path])
                result["full_calls_recorded"] = counters["recorded"]
                result["full_drops"] = counters["dropped_queue_full"] + counters["outputs_dropped"]
                result["full_file_MB"] = size / 1e6
                result["full_selected"] = copied
                result["full_MBps_file"] = queued / 1e6 / drained
        rows.append(result)
        print(json.dumps(result), flush=True)
    print("\n  M   off ms  flight×  full×   full MB/s(file)  drops")
    for row in rows:
        print(f"{row['M']:5d} {row['off_ms']:8.3f} {row['flight_ratio']:7.3f} {row['full_ratio']:6.3f} "
              f"{row['full_MBps_file']:15.1f} {row['full_drops']:6d}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
