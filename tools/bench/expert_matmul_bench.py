"""How to multiply rows grouped by expert on a GPU in float32: ways of issuing the per-expert products, and their bits.

A MoE reference multiplies each expert's rows by that expert's dense float32 weight (no TF32). At decode shapes an
expert holds a few rows, so each product is a skinny GEMM. This bench times, on one set of grouped rows, each way
of issuing the same products — wall time per call with a device sync (``wall``), the host time to issue it
(``host``, before the sync) and the GPU time between two events (``gpu``) — and says whether its output equals the
plain loop's bit for bit:

- ``loop``: one ``torch.mm(x_e, W_e.T)`` per expert on weights already in float32 (what the references do);
- ``loop-T``: the transposed product ``W_e @ x_eᵀ`` per expert (other kernels);
- ``bmm`` / ``bmm-T``: experts bucketed by row count (power-of-two zero padding), one ``torch.bmm`` per bucket, in
  either orientation;
- ``cvt-narrow`` / ``cvt-index``: the bf16 → float32 conversion of the used experts' weights alone, as one
  contiguous run or gathered by index;
- ``loop+cvt``: the loop converting a run of experts at a time before their products (a reference's cost);
- ``pipe+cvt``: the same, with the next run's conversion issued on a side stream while the current run's products
  run (same kernels, same bits).

Cases: Qwen3-30B-A3B gemm1 (128 experts, top-8, 64 tokens, K 2048, N 1536) and gpt-oss gemm1 (32 experts, top-4,
32 tokens, K 2880, N 5888).

Usage (GPU; needs only torch)::

    python3 tools/bench/expert_matmul_bench.py [--repeats 20] [--run 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

CASES = {
    "qwen3-gemm1": (128, 8, 64, 2048, 1536),
    "gptoss-gemm1": (32, 4, 32, 2880, 5888),
}


# Callable[..., ...], called with no argument: mypy rejects the callers' lambdas, whose defaults bind loop
# variables, as Callable[[], ...] (python/mypy#15459)
def timings(fn: Callable[..., object], repeats: int) -> tuple[float, float, float]:
    """Median (wall, host, gpu) milliseconds of ``repeats`` calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    walls, hosts, gpus = [], [], []
    for _ in range(repeats):
        start_event, stop_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        start_event.record()
        fn()
        stop_event.record()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
        hosts.append((issued - start) * 1e3)
        gpus.append(start_event.elapsed_time(stop_event))
    return statistics.median(walls), statistics.median(hosts), statistics.median(gpus)


def bench_case(name: str, shape: tuple[int, int, int, int, int], repeats: int, run: int) -> None:
    experts, top_k, tokens, K, N = shape
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=1).indices.reshape(-1)
    used, counts = torch.unique_consecutive(ids.sort().values, return_counts=True)
    used_l, counts_l = used.tolist(), counts.tolist()
    starts = [0]
    for c in counts_l:
        starts.append(starts[-1] + c)
    x = torch.randn(tokens * top_k, K, device=device)  # already in group order
    weights_bf16 = (torch.randn(experts, N, K, generator=gen) * 0.02).to(torch.bfloat16).to(device)
    dense = weights_bf16.to(torch.float32)
    xs = torch.split(x, counts_l)
    print(
        f"--- {name}: {len(used_l)} experts used, rows per expert {min(counts_l)}..{max(counts_l)} "
        f"(mean {sum(counts_l) / len(counts_l):.1f}), K {K}, N {N}",
        flush=True,
    )
    out = torch.empty(tokens * top_k, N, device=device)
    outs = torch.split(out, counts_l)

    def loop() -> None:
        for i, e in enumerate(used_l):
            torch.mm(xs[i], dense[e].T, out=outs[i])

    loop()
    reference = out.clone()
    rows: list[tuple[str, tuple[float, float, float], bool | None]] = [("loop", timings(loop, repeats), True)]

    transposed = [torch.empty(N, c, device=device) for c in counts_l]

    def loop_t() -> None:
        for i, e in enumerate(used_l):
            torch.mm(dense[e], xs[i].T, out=transposed[i])
            outs[i].copy_(transposed[i].T)

    out.zero_()
    rows.append(("loop-T", timings(loop_t, repeats), torch.equal(out, reference)))

    buckets: dict[int, list[int]] = {}
    for i, c in enumerate(counts_l):
        buckets.setdefault(1 << (c - 1).bit_length(), []).append(i)
    plans = []
    padded_x = torch.cat((x, x.new_zeros(1, K)))
    for pad, members in buckets.items():
        source = torch.full((len(members), pad), x.shape[0], dtype=torch.long)
        target: list[int] = []
        valid: list[int] = []
        for j, i in enumerate(members):
            source[j, : counts_l[i]] = torch.arange(starts[i], starts[i + 1])
            target += range(starts[i], starts[i + 1])
            valid += range(j * pad, j * pad + counts_l[i])
        experts_d = torch.tensor([used_l[i] for i in members], device=device)
        plans.append(
            (pad, source.to(device).reshape(-1), torch.tensor(target, device=device),
             torch.tensor(valid, device=device), dense.index_select(0, experts_d))
        )  # fmt: skip

    def bmm(transpose: bool) -> None:
        for pad, source, target, valid, w in plans:
            xb = padded_x.index_select(0, source).view(-1, pad, K)
            if transpose:
                product = torch.bmm(w, xb.transpose(1, 2)).transpose(1, 2).reshape(-1, N)
            else:
                product = torch.bmm(xb, w.transpose(1, 2)).view(-1, N)
            out.index_copy_(0, target, product.index_select(0, valid))

    for label, flag in (("bmm", False), ("bmm-T", True)):
        out.zero_()
        rows.append((label, timings(lambda flag=flag: bmm(flag), repeats), torch.equal(out, reference)))

    first, last = used_l[0], used_l[-1]
    used_d = torch.tensor(used_l, device=device)
    rows.append(
        ("cvt-narrow", timings(lambda: weights_bf16[first : last + 1].to(torch.float32), repeats), None)
    )
    rows.append(
        ("cvt-index", timings(lambda: weights_bf16.index_select(0, used_d).to(torch.float32), repeats), None)
    )

    runs = [(i, min(i + run, len(used_l))) for i in range(0, len(used_l), run)]

    def convert(lo: int, hi: int) -> torch.Tensor:
        return weights_bf16[used_l[lo] : used_l[hi - 1] + 1].to(torch.float32)

    def loop_cvt() -> None:
        for lo, hi in runs:
            chunk = convert(lo, hi)
            for i in range(lo, hi):
                torch.mm(xs[i], chunk[used_l[i] - used_l[lo]].T, out=outs[i])

    out.zero_()
    rows.append(("loop+cvt", timings(loop_cvt, repeats), torch.equal(out, reference)))
    side = torch.cuda.Stream(device)

    def pipe_cvt() -> None:
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        pending = []
        with torch.cuda.stream(side):
            for lo, hi in runs:
                chunk = convert(lo, hi)
                done = torch.cuda.Event()
                done.record(side)
                pending.append((lo, hi, chunk, done))
        for lo, hi, chunk, done in pending:
            main.wait_event(done)
            chunk.record_stream(main)
            for i in range(lo, hi):
                torch.mm(xs[i], chunk[used_l[i] - used_l[lo]].T, out=outs[i])

    out.zero_()
    rows.append(("pipe+cvt", timings(pipe_cvt, repeats), torch.equal(out, reference)))
    for label, (wall, host, gpu), same in rows:
        bits = "-" if same is None else str(same)
        print(
            f"  {label:<11} wall {wall:7.3f} ms  host {host:7.3f} ms  gpu {gpu:7.3f} ms  same bits as loop: {bits}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--run", type=int, default=16, help="experts converted at a time (loop+cvt, pipe+cvt)"
    )
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("expert_matmul_bench: needs a GPU")
        return 0
    torch.set_float32_matmul_precision("highest")
    print(f"expert_matmul_bench: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name, shape in CASES.items():
        bench_case(name, shape, options.repeats, options.run)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
