"""How cheap can an armed flight recorder be at decode? Host cost of one ring launch, and vLLM's real
``fused_marlin_moe`` (gpt-oss NVFP4 shapes, as ``capture_bench.py``) with a lean layer-scope wrapper that copies
the layer's dynamic inputs and its output into a :class:`~moereplay.capture.device_ring.DeviceRing` and folds the
output's largest magnitude into a tag word: ONE launch per layer call, nothing for its two kernel calls.

Measured in rounds (off / bare wrapper / ring wrapper / +1 torch launch, interleaved), median ratio per M, so
drift between blocks of the run cannot pass for overhead. Also checks the ring copies byte for byte and the tag
words against torch (NaN / Inf / finite).

Usage (GPU machine, vLLM importable): ``python tools/bench/ring_floor.py [--rounds 7] [--iterations 200]``
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_bench import build_weights, make_inputs

from moereplay.capture.device_ring import MAX_SPANS, DeviceRing, decode_word


def per_call(fn, count: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(count):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count


def correctness(ring: DeviceRing) -> None:
    failures = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for special in (None, math.nan, math.inf, -math.inf):
            for n in (1, 7, 2880, 2048 * 2880 + 3):
                x = torch.randn(n, device="cuda").to(dtype)
                if special is not None:
                    x[n // 2] = special
                odd = torch.randint(0, 255, (n * 3 + 1,), dtype=torch.uint8, device="cuda")
                odd = (
                    odd[1:] if n % 2 else odd[:-1]
                )  # odd n: a span whose size is no multiple of 8 (copied as whole words all the same)
                starts, leads, _sizes, tag = ring.record([x, odd], x, True)
                assert tag is not None
                torch.cuda.synchronize()
                same = torch.equal(ring.view(starts[0] + leads[0], x.nbytes), x.view(torch.uint8).reshape(-1))
                same &= torch.equal(ring.view(starts[1] + leads[1], odd.nbytes), odd)
                state, value = decode_word(int(ring.words[tag[0]]), tag[1])
                assert ring.host_words is not None
                published = decode_word(int(ring.host_words[tag[0]]), tag[1])
                same &= published[0] == state and (published[1] == value or math.isnan(value))
                expect = float(torch.linalg.vector_norm(x.float(), ord=math.inf))
                ok = (
                    same and state == "ok" and (value == expect or (math.isnan(value) and math.isnan(expect)))
                )
                if not ok:
                    failures += 1
                    print(
                        f"  MISMATCH {dtype} special={special} n={n}: bytes {same}, {state} {value} vs {expect}"
                    )
    print(f"ring correctness: {'all ok' if failures == 0 else f'{failures} FAILED'}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--sizes", default="1,8,64,2048")
    options = parser.parse_args()
    from vllm.scalar_type import scalar_types

    # vLLM modules whose fused_marlin_moe and moe_wna16_marlin_gemm are replaced below
    marlin: Any = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    ops: Any = importlib.import_module("vllm._custom_ops")
    torch.manual_seed(0)
    (w1, s1, g1), (w2, s2, g2) = build_weights()
    ring = DeviceRing(1 << 30, torch.device("cuda", 0))
    print(
        f"ring_floor: {torch.cuda.get_device_name(0)}; kernel launcher: {ring.launcher is not None}",
        flush=True,
    )
    correctness(ring)

    # host cost of one launch (tiny spans), against a tiny torch op
    a = torch.zeros(1024, device="cuda", dtype=torch.bfloat16)
    four = [a] * 4
    scratch = torch.zeros(1, device="cuda")
    ring_launch = lambda i: ring.record(four, a, True)  # noqa: E731
    launcher = ring.launcher
    assert launcher is not None
    variant = launcher._variants[(1, 2, 2)]  # aligned, bfloat16 check, tag word: what ring_launch compiled
    stream = torch.cuda.current_stream().cuda_stream
    args = [a.data_ptr(), ring._base, 2048] + [0, 0, 0] * (MAX_SPANS - 1)
    args += [a.data_ptr(), 1024, ring._words, 1, ring._done, ring._host]
    parts = (
        ("ring.record (4 tensors + check)", ring_launch),
        (
            "launcher.launch_prepared (4 spans + check)",
            lambda i: launcher.launch_prepared(
                [a.data_ptr(), ring._base, 2048] * 4,
                4,
                1,
                8192,
                (a.data_ptr(), 1024, 2),
                (ring._words, 1, ring._done, ring._host),
            ),
        ),
        ("cuLaunchKernel only (prepared arguments)", lambda i: variant(4, stream, args)),
        ("t.data_ptr()", lambda i: a.data_ptr()),
        ("t.nbytes", lambda i: a.nbytes),
        ("t.is_contiguous()", lambda i: a.is_contiguous()),
        ("raw stream handle", lambda i: torch._C._cuda_getCurrentRawStream(0)),
        ("torch add_", lambda i: scratch.add_(1)),
    )
    for name, fn in parts:
        for _ in range(3):
            per_call(fn, 200)
        samples = [per_call(fn, 2000) * 1e6 for _ in range(5)]
        print(f"host µs per call: {name}: median {statistics.median(samples):.2f} (min {min(samples):.2f})")

    original_fused = marlin.fused_marlin_moe
    original_gemm = ops.moe_wna16_marlin_gemm
    state = {"parents": 0}

    def bare_fused(*args, **kwargs):
        return original_fused(*args, **kwargs)

    def bare_gemm(*args, **kwargs):
        return original_gemm(*args, **kwargs)

    def ring_fused(hidden_states, w1, w2, b1, b2, s1, s2, topk_weights, topk_ids, *args, **kwargs):
        state["parents"] += 1
        result = original_fused(
            hidden_states, w1, w2, b1, b2, s1, s2, topk_weights, topk_ids, *args, **kwargs
        )
        ring.record([hidden_states, topk_weights, topk_ids, result], result, True)
        return result

    def ring_gemm(*args, **kwargs):
        if state["parents"]:
            return original_gemm(*args, **kwargs)
        return original_gemm(*args, **kwargs)

    def launch_fused(*args, **kwargs):
        scratch.add_(1)
        return original_fused(*args, **kwargs)

    modes = {
        "bare": (bare_fused, bare_gemm),
        "ring": (ring_fused, ring_gemm),
        "+1 torch launch": (launch_fused, bare_gemm),
    }
    print(
        f"\n{'M':>5} {'off ms':>8} "
        + " ".join(f"{name + '×':>16}" for name in modes)
        + "   (median of rounds; min..max)"
    )
    for m in [int(v) for v in options.sizes.split(",")]:
        iterations = options.iterations if m < 2048 else max(10, options.iterations // 10)
        inputs = make_inputs(m, 8)

        def call(i: int, inputs=inputs):
            x, weights, ids = inputs[i % len(inputs)]
            return marlin.fused_marlin_moe(
                x, w1, w2, None, None, s1, s2, weights, ids, scalar_types.float4_e2m1f.id,
                global_scale1=g1, global_scale2=g2,
            )  # fmt: skip

        per_call(call, 5)
        offs: list[float] = []
        ratios: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(options.rounds):
            off = per_call(call, iterations)
            offs.append(off)
            for name, (fused, gemm) in modes.items():
                marlin.fused_marlin_moe, ops.moe_wna16_marlin_gemm = fused, gemm
                try:
                    per_call(call, 3)
                    ratios[name].append(per_call(call, iterations) / off)
                finally:
                    marlin.fused_marlin_moe, ops.moe_wna16_marlin_gemm = original_fused, original_gemm
        cells = " ".join(
            f"{statistics.median(v):6.3f} ({min(v):.2f}..{max(v):.2f})".rjust(17) for v in ratios.values()
        )
        print(f"{m:>5} {statistics.median(offs) * 1e3:8.3f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
