"""Replay engine overhead on the CPU: replay_bench.py's 40-variant sweep over a gpt-oss-shaped Marlin gemm2 call,
with a CPU stand-in kernel, so the engine's own costs (keys, caches, comparisons, IPC) can be profiled without a GPU.

The call has the GPU bench's activation and output shapes (128 rows × K=2944 → N=2880, bf16, NVFP4 weights,
``moe_block_size=16``, float32 routing weights), with fewer experts (``--experts``, default 8) to keep the CPU
weights small. The stand-in kernel (this file as a ``python:`` backend) computes the exact result with moreplay's
reference, dequantising the weights once per process and remembering its result per (input, routing, flags) bytes
(it assumes the weights never change: a profiling stand-in, not a test kernel); it writes only the rows the
routing names.

Prints, for the second of two sweeps (the first fills every cache, as on the GPU): the session's phases (the GPU
bench's table), and per phase of the main process the number of ATen operations and of host syncs they would be
on a GPU (``_local_scalar_dense``: ``.item()`` / ``bool()`` / ``int()`` / ``float()`` of a tensor; ``tolist``; copies
to the CPU). ``--in-process`` runs the kernel in this process (no worker), so the worker's ops are counted too;
``--cprofile N`` prints the N functions with the most cumulative time.

Usage::

    python tools/bench/replay_cpu_profile.py [--experts 8] [--in-process] [--cprofile 30]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import os
import pstats
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

THIS_FILE = os.path.abspath(__file__)
SPEC = f"python:{THIS_FILE}"
TOKENS, TOP_K, N, K, BLOCK = 32, 4, 2880, 2944, 16

# -- the stand-in kernel -----------------------------------------------------------------------------------------

_PINNED: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
_OUTPUTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
_WEIGHT_NAMES = ("b_qweight", "b_scales", "global_scale")


def moe_wna16_marlin_gemm(**kwargs: Any) -> torch.Tensor:
    from moereplay.reference.marlin_moe import ExpertWeightCache, reference_moe_wna16_marlin_gemm

    key = tuple(tuple(kwargs[name].shape) for name in _WEIGHT_NAMES)
    inputs = hashlib.sha1()
    for name in ("input", "sorted_token_ids", "expert_ids", "num_tokens_past_padded", "topk_weights"):
        inputs.update(kwargs[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    inputs.update(repr((kwargs["moe_block_size"], kwargs["mul_topk_weights"])).encode())
    made = _OUTPUTS.get(inputs.hexdigest())
    output = kwargs["output"]
    if made is not None:  # the same inputs as an earlier run (a profiling shortcut: the weights never change)
        written, values = made
        output[written] = values
        return output
    pinned = _PINNED.get(key)
    if pinned is None:  # the first weights seen, kept (with their dequantised experts) for every later run
        pinned = {name: kwargs[name].clone() for name in _WEIGHT_NAMES}
        pinned["cache"] = ExpertWeightCache()  # type: ignore[assignment]
        _PINNED[key] = pinned
    call = dict(kwargs)
    cache = pinned["cache"]
    call.update({name: pinned[name] for name in _WEIGHT_NAMES})
    result = reference_moe_wna16_marlin_gemm(**call, weight_cache=cache)  # type: ignore[arg-type]
    values = result.output[result.written].to(output.dtype)
    _OUTPUTS[inputs.hexdigest()] = (result.written, values)
    output[result.written] = values
    return output


def backend(device: torch.device, name: str) -> Any:
    from moereplay.reference.scalar_types import ScalarType
    from moereplay.replay.backends import ModuleBackend

    ops = types.ModuleType("vllm._custom_ops")
    ops.moe_wna16_marlin_gemm = moe_wna16_marlin_gemm  # type: ignore[attr-defined]
    scalar_type = types.ModuleType("vllm.scalar_type")
    scalar_type.ScalarType = ScalarType  # type: ignore[attr-defined]
    return ModuleBackend.of_modules(
        "cpu-marlin-stand-in", device, {"vllm._custom_ops": ops, "vllm.scalar_type": scalar_type}
    )


# -- the call ----------------------------------------------------------------------------------------------------


def build_call(experts: int) -> dict[str, Any]:
    """A gpt-oss-style gemm2 call (rows pre-expanded, ``top_k=1``) on random NVFP4 experts, with the arguments the
    synthetic captures use (:func:`moereplay.synth.marlin_presets.marlin_args`)."""
    from moereplay.reference.marlin_formats import MarlinWeightFormat, random_experts
    from moereplay.synth.marlin_presets import marlin_args
    from moereplay.synth.routing import TopK

    generator = torch.Generator().manual_seed(0)
    packed = random_experts(MarlinWeightFormat.NVFP4, experts, K, N, generator=generator, with_dense=False)
    router = torch.randn(TOKENS, experts, generator=generator)
    topk_weights, topk_ids = torch.topk(torch.softmax(router, -1), TOP_K, dim=-1)
    rows = TOKENS * TOP_K
    return marlin_args(
        x=(torch.randn(rows, K, generator=generator) * 0.5).to(torch.bfloat16),
        weights=packed.kernel_kwargs(),  # type: ignore[arg-type]
        fmt=MarlinWeightFormat.NVFP4,
        topk=TopK(topk_weights, topk_ids.to(torch.int32)),
        topk_weights=topk_weights.reshape(-1).to(torch.float32),
        block=BLOCK,
        experts=experts,
        top_k=1,
        mul_topk_weights=True,
        size_m=rows,
        size_n=N,
        size_k=K,
        device=torch.device("cpu"),
    )


def record(path: Path, args: dict[str, Any]) -> None:
    from moereplay.format import CaptureWriter

    output = moe_wna16_marlin_gemm(**{**args, "output": args["output"].clone()})
    with CaptureWriter(path, header={"purpose": "tools/bench/replay_cpu_profile.py"}) as writer:
        index = writer.begin_call(
            "moe_wna16_marlin_gemm", args, static=("b_qweight", "b_scales", "global_scale")
        )
        writer.complete_call(index, {"output": output, "return": output})


# -- counting operations and host syncs per phase ----------------------------------------------------------------

_SYNC_OPS = ("aten._local_scalar_dense",)


class OpCounter(TorchDispatchMode):
    """ATen operations per current phase; syncs: ``_local_scalar_dense`` and copies to the CPU (``tolist`` is
    counted by a wrapper: it does not dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: list[str] = ["(outside phases)"]
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.names: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        phase = self.phase[-1]
        name = str(func.overloadpacket)
        self.ops[phase] += 1
        if name in _SYNC_OPS or name in ("aten.equal", "aten.nonzero"):
            self.syncs[phase] += 1
            self.names[(phase, name)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[OpCounter]:
    from moereplay.replay import timing

    counter = OpCounter()
    original_phase = timing.PhaseTimes.phase
    original_add = timing.PhaseTimes.add
    original_tolist = torch.Tensor.tolist

    @contextlib.contextmanager
    def phase(self: Any, name: str) -> Iterator[None]:
        counter.phase.append(name)
        try:
            with original_phase(self, name):
                yield
        finally:
            counter.phase.pop()

    def tolist(self: Any) -> Any:  # Any: torch's stubs give Tensor.tolist a TensorBase self
        counter.syncs[counter.phase[-1]] += 1
        counter.names[(counter.phase[-1], "tolist")] += 1
        return original_tolist(self)

    timing.PhaseTimes.phase = phase  # type: ignore[method-assign]
    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with counter:
            yield counter
    finally:
        timing.PhaseTimes.phase = original_phase  # type: ignore[method-assign]
        timing.PhaseTimes.add = original_add  # type: ignore[method-assign]
        torch.Tensor.tolist = original_tolist  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--in-process", action="store_true", help="run the stand-in kernel in this process")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N top functions")
    parser.add_argument(
        "--count", action="store_true", help="one more sweep counting ATen ops and host syncs per phase"
    )
    parser.add_argument("--sweeps", type=int, default=2, help="sweeps to run; the last one is measured")
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from replay_bench import print_phases, sweep_variants

    from moereplay.replay import replay

    folder = Path(tempfile.mkdtemp(prefix="replay-cpu-profile-"))
    path = folder / "gemm2.moe.zst"
    record(path, build_call(options.experts))
    variants = sweep_variants()
    isolate = not options.in_process

    def sweep() -> Any:
        return replay(path, call=0, backend=SPEC, device="cpu", isolate=isolate, mutations=variants)

    for _ in range(max(0, options.sweeps - 1)):
        sweep()
    profiler = cProfile.Profile() if options.cprofile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    report = sweep()
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    from moereplay.replay.memo import _MEMOS

    for memos in _MEMOS.values():
        for name in ("references", "derived", "allowances"):
            cache = getattr(memos, name)
            print(f"memo {name}: {cache.hits} hits, {cache.misses} misses, {len(cache)} kept")
    evaluations = len(report.variants) + 1
    verdicts = Counter(item.verdict.value for item in report.variants)
    print_phases("measured sweep (CPU)", report.phases, wall, evaluations)
    print(
        f"sweep: {len(report.variants)} variants in {wall:.3f} s = {len(report.variants) / wall:.1f}/s "
        f"({'in process' if options.in_process else 'worker process'}); verdicts {dict(verdicts)}"
    )
    if options.count:
        with counting() as counter:  # a further sweep: counting makes every op slow
            sweep()
        print_counts(counter, evaluations)
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(options.cprofile)
    return 0


def print_counts(counter: OpCounter, evaluations: int) -> None:
    print("main-process ATen ops and host syncs (on a GPU) per evaluation, by phase:")
    for phase in sorted(counter.ops, key=lambda name: -counter.ops[name]):
        detail = ", ".join(
            f"{name} {count / evaluations:.1f}"
            for (where, name), count in sorted(counter.names.items())
            if where == phase
        )
        print(
            f"  {phase:<22} ops {counter.ops[phase] / evaluations:7.1f}  syncs "
            f"{counter.syncs[phase] / evaluations:5.1f}  ({detail})"
        )
    print(
        f"  total                  ops {sum(counter.ops.values()) / evaluations:7.1f}  syncs "
        f"{sum(counter.syncs.values()) / evaluations:5.1f}"
    )


if __name__ == "__main__":
    sys.exit(main())
