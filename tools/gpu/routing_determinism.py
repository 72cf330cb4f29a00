"""Is the routing vLLM's gpt-oss layer computes from its router logits deterministic on this GPU?

The question decides whether the layer flight recorder may record gpt-oss one level up — at
``triton_kernel_moe_forward(hidden_states, w1, w2, gating_output, topk, renormalize, …)``: two dynamic tensors —
instead of at ``triton_kernel_fused_experts``, whose RoutingData / GatherIndx / ScatterIndx hold 16 more tensors
walked and measured on the serving thread per call. One level up, a replay (``moereplay expand``) recomputes the
routing from the recorded logits; that regenerates the kernel calls bit-exactly only if the routing is a function
of the logits alone.

This runs vLLM's own ``triton_kernel_moe_forward`` (the kernel pack's vLLM 0.25.1) with its module global
``triton_kernel_fused_experts`` replaced by a stand-in that keeps what it is given (the routing objects; nothing
is multiplied), ``--repeats`` times per logits tensor, and compares every tensor of the routing bitwise with the
first run's. Logits: random bf16 (gpt-oss's router output dtype), and logits with many exact ties (rounded to a few
values — where a sort or an atomic could order equal keys differently), at decode and prefill token counts,
with ``renormalize`` both ways (softmax before or after the top-k). Between repeats another workload runs on the
GPU (a matmul) so that the routing's kernels do not meet an idle, identical machine each time.

    python3 tools/gpu/routing_determinism.py [--tokens 1,8,32,256,2048,8192] [--repeats 20] [--json FILE]

Prints one line per case and a verdict; exits 1 when any case differed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

MODULE = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"
EXPERTS, TOP_K, HIDDEN = 32, 4, 2880


def tensors_of(value: Any, prefix: str, found: dict[str, Any]) -> None:
    """Every tensor reachable from ``value`` (attributes, dicts, lists, tuples), by a path name."""
    import torch

    if isinstance(value, torch.Tensor):
        found[prefix] = value.detach().clone()
    elif isinstance(value, dict):
        for key, item in value.items():
            tensors_of(item, f"{prefix}[{key!r}]", found)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            tensors_of(item, f"{prefix}[{index}]", found)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for key, item in vars(value).items():
            tensors_of(item, f"{prefix}.{key}", found)


def raw(tensor: Any) -> Any:
    """The tensor's bytes (a bitwise comparison: NaN equals the same NaN, -0.0 differs from 0.0)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,256,2048,8192")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("routing_determinism: needs a CUDA device", file=sys.stderr)
        return 2
    module: Any = importlib.import_module(MODULE)  # a vLLM module: one of its globals is replaced below
    given: list[dict[str, Any]] = []

    def stand_in(output: Any, hidden_states: Any, w1: Any, w2: Any, routing_data: Any, gather_indx: Any,
                 scatter_indx: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        found: dict[str, Any] = {}
        tensors_of(routing_data, "routing_data", found)
        tensors_of(gather_indx, "gather_indx", found)
        tensors_of(scatter_indx, "scatter_indx", found)
        given.append(found)
        return output

    module.triton_kernel_fused_experts = stand_in  # the module global triton_kernel_moe_forward calls
    legacy = getattr(module, "use_legacy_triton_kernels", None)
    print(
        f"routing_determinism: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"{MODULE}.use_legacy_triton_kernels={legacy}, {options.repeats} repeats a case"
    )
    w1 = torch.empty(EXPERTS, 1, 1, device="cuda")  # read for its shape only (expert maps), never multiplied
    w2 = torch.empty(EXPERTS, 1, 1, device="cuda")
    noise = torch.randn(2048, 2048, device="cuda")
    results = []
    differed = 0
    generator = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (int(text) for text in options.tokens.split(",")):
        hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
        for kind in ("random", "ties"):
            logits = torch.randn(tokens, EXPERTS, device="cuda", generator=generator)
            if kind == "ties":
                logits = (logits * 2).round() / 2  # a handful of values: many exact ties per row
            logits = logits.to(torch.bfloat16)
            for renormalize in (True, False):
                given.clear()
                for _ in range(options.repeats):
                    module.triton_kernel_moe_forward(hidden, w1, w2, logits, TOP_K, renormalize)
                    noise @ noise  # other work on the GPU between repeats
                torch.cuda.synchronize()
                first = given[0]
                bad = [
                    name
                    for run in given[1:]
                    for name, tensor in run.items()
                    if name not in first or first[name].shape != tensor.shape or not torch.equal(
                        raw(first[name]), raw(tensor)
                    )
                ]  # fmt: skip
                names = sorted(set(bad))
                differed += bool(names)
                line = (
                    f"tokens {tokens:>5} {kind:>6} renormalize={renormalize!s:<5} "
                    f"{len(first)} tensors × {len(given)} runs: "
                    + ("bit-identical" if not names else f"DIFFER in {', '.join(names)}")
                )
                print(line, flush=True)
                case = {"tokens": tokens, "logits": kind, "renormalize": renormalize}
                results.append({**case, "tensors": sorted(first), "runs": len(given), "differ": names})
    verdict = "deterministic" if not differed else f"NOT deterministic in {differed} case(s)"
    print(f"routing_determinism: {verdict}")
    if options.json is not None:
        options.json.write_text(
            json.dumps({"verdict": verdict, "legacy": legacy, "cases": results}, indent=1)
        )
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
