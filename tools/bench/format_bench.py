"""Capture file format v1 on a synthetic one-layer MoE capture (CPU only, one run).

100 calls of a Marlin-style MoE layer share one weight set (int4 weights packed in int32 plus bf16 group
scales, ≥ 100 MB); each call has its own activations, routing and outputs (a random 16–256 tokens).
Prints, all measured in this run:

- file size ÷ unique tensor bytes (the weights once + every call's own tensors) — target ≤ 1.05×;
- file size vs one ``torch.save`` per call of the same argument/output dicts — target ≥ 10× smaller;
- write MB/s (unique tensor bytes ÷ wall time of the whole capture, close included);
- list time for all calls, and read MB/s (tensor bytes materialised ÷ wall time) loading every call's
  arguments and outputs, with a cold reader that decodes each blob every time and with the default blob cache.

Random weights do not compress, so the size ratio is close to 1 by construction; what it measures is the
format's overhead and that the weights are stored once. Usage::

    python tools/bench/format_bench.py [--calls 100] [--experts 32] [--hidden 2048] [--intermediate 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moereplay.format import CaptureReader, CaptureWriter
from moereplay.format.reader import DEFAULT_BLOB_CACHE_BYTES

GROUP = 32
TOP_K = 4
BLOCK = 64


def weights(
    experts: int, hidden: int, intermediate: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Packed int4 (8 per int32) gate/up and down projections with bf16 group scales."""

    def packed(rows: int, columns: int) -> torch.Tensor:
        return torch.randint(
            -(2**31), 2**31 - 1, (experts, rows, columns // 8), dtype=torch.int32, generator=generator
        )

    def scales(rows: int, columns: int) -> torch.Tensor:
        return (torch.rand(experts, rows, columns // GROUP, generator=generator) / 64).to(torch.bfloat16)

    return {
        "w13_qweight": packed(2 * intermediate, hidden),
        "w13_scales": scales(2 * intermediate, hidden),
        "w2_qweight": packed(hidden, intermediate),
        "w2_scales": scales(hidden, intermediate),
    }


def call_tensors(
    tokens: int, experts: int, hidden: int, generator: torch.Generator
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call's own arguments (activations, routing, block alignment) and outputs."""
    hidden_states = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    topk_weights = torch.rand(tokens, TOP_K, generator=generator)
    topk_ids = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K] for _ in range(tokens)]).to(
        torch.int32
    )
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    padded = ((tokens * TOP_K + BLOCK - 1) // BLOCK + experts) * BLOCK
    sorted_token_ids = torch.full((padded,), tokens * TOP_K, dtype=torch.int32)
    sorted_token_ids[: order.numel()] = order
    expert_ids = torch.randint(0, experts, (padded // BLOCK,), dtype=torch.int32, generator=generator)
    output = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    args = {
        "hidden_states": hidden_states,
        "topk_weights": topk_weights,
        "topk_ids": topk_ids,
        "sorted_token_ids": sorted_token_ids,
        "expert_ids": expert_ids,
        "num_tokens_post_padded": torch.tensor([padded], dtype=torch.int32),
        "top_k": TOP_K,
        "block_size_m": BLOCK,
        "mul_topk_weights": False,
    }
    return args, {"output": output}


def tensor_bytes(tree: dict[str, Any]) -> int:
    return sum(
        value.numel() * value.element_size() for value in tree.values() if isinstance(value, torch.Tensor)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    generator = torch.Generator().manual_seed(options.seed)
    weight_set = weights(options.experts, options.hidden, options.intermediate, generator)
    calls = []
    for _ in range(options.calls):
        tokens = int(torch.randint(16, 257, (1,), generator=generator))
        calls.append(call_tensors(tokens, options.experts, options.hidden, generator))
    weight_bytes = tensor_bytes(weight_set)
    own_bytes = sum(tensor_bytes(args) + tensor_bytes(outputs) for args, outputs in calls)
    unique_bytes = weight_bytes + own_bytes

    with tempfile.TemporaryDirectory(prefix="format_bench_") as directory:
        path = Path(directory) / "bench.zst"
        started = time.perf_counter()
        with CaptureWriter(path, {"bench": "format_bench"}) as writer:
            for layer_call, (args, outputs) in enumerate(calls):
                index = writer.begin_call(
                    "moe_wna16_marlin_gemm",
                    {**weight_set, **args},
                    site="format_bench",
                    context={"layer": 0, "step": layer_call},
                    static=weight_set.keys(),
                )
                writer.complete_call(index, outputs, timings={"kernel_s": 0.0})
        write_seconds = time.perf_counter() - started
        file_bytes = path.stat().st_size

        save_bytes = 0
        save_path = Path(directory) / "call.pt"
        save_started = time.perf_counter()
        for args, outputs in calls:  # one torch.save per call, deleted after measuring (11 GB otherwise)
            torch.save({"args": {**weight_set, **args}, "outputs": outputs}, save_path)
            save_bytes += save_path.stat().st_size
            os.remove(save_path)
        save_seconds = time.perf_counter() - save_started

        started = time.perf_counter()
        with CaptureReader(path) as reader:
            listed = sum(1 for _ in reader.calls())
            list_seconds = time.perf_counter() - started
            stats = reader.stats()
        read_results = {}
        for label, cache in (("cold", 0), ("cached", DEFAULT_BLOB_CACHE_BYTES)):
            started = time.perf_counter()
            materialised = 0
            with CaptureReader(path, blob_cache_bytes=cache) as reader:
                for index in range(len(reader)):
                    loaded_args = reader.load_args(index)
                    loaded_outputs = reader.load_outputs(index)
                    materialised += tensor_bytes(loaded_args) + tensor_bytes(loaded_outputs)
            read_results[label] = (materialised, time.perf_counter() - started)
        args, outputs = calls[-1]
        with CaptureReader(path) as reader:
            check = reader.load_args(len(calls) - 1)
            assert all(
                torch.equal(check[name], value)
                for name, value in {**weight_set, **args}.items()
                if isinstance(value, torch.Tensor)
            )

    mb = 1e6
    print(
        f"synthetic MoE capture: {options.calls} calls, {options.experts} experts, hidden {options.hidden}, "
        f"intermediate {options.intermediate}, torch {torch.__version__}"
    )
    print(f"  weight set (stored once)       {weight_bytes / mb:10.1f} MB")
    print(f"  per-call tensors (all calls)   {own_bytes / mb:10.1f} MB")
    print(f"  unique tensor bytes            {unique_bytes / mb:10.1f} MB")
    print(f"  capture file                   {file_bytes / mb:10.1f} MB")
    print(f"  file ÷ unique tensor bytes     {file_bytes / unique_bytes:10.3f}×   (target ≤ 1.05×)")
    print(f"  per-call torch.save total      {save_bytes / mb:10.1f} MB   ({save_seconds:.1f} s)")
    print(f"  torch.save ÷ capture file      {save_bytes / file_bytes:10.1f}×   (target ≥ 10×)")
    print(
        f"  write                          {unique_bytes / mb / write_seconds:10.1f} MB/s ({write_seconds:.2f} s)"
    )
    print(f"  list {listed} calls (no blobs)     {list_seconds * 1e3:10.1f} ms")
    print(f"  dedup ratio (reader stats)     {stats.dedup_ratio:10.1f}×")
    for label, (materialised, seconds) in read_results.items():
        print(
            f"  read, {label:<6} (all calls)      {materialised / mb / seconds:10.1f} MB/s "
            f"({materialised / mb:.0f} MB materialised in {seconds:.2f} s)"
        )


if __name__ == "__main__":
    main()
