"""A toy op whose kernel reads routing *metadata* derived from the routing, to test the fidelity check's last cause.

``toy_routed_rows``: ``out[r] = x[r] @ w[topk_ids[r]]``. Like ``sorted_token_ids`` / ``expert_ids`` for Marlin or
the offsets and tile maps of triton_kernels' ``RoutingData``, the kernel does not read the routing (``topk_ids``)
itself but metadata derived from it: ``row_expert`` (here simply a copy of it, as int32). The op declares
``rederive_routing(args)`` (``row_expert`` recomputed from ``topk_ids``), so a capture whose recorded metadata is
stale — the production kernel read the right one, the capture copied it before it was written — replays differently
from the recording, and only the re-derived metadata reproduces it. Loaded as ``python:<this file>``; one kernel.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from moereplay.ops import register_op
from moereplay.ops.base import (
    ArgKind,
    Args,
    ArgSpec,
    KernelBackend,
    ReferenceResult,
    RowMap,
)
from moereplay.replay.backends import ModuleBackend

NAME = "toy_routed_rows"


def _kernel(args: dict[str, Any]) -> torch.Tensor:
    x, w, out = args["x"], args["w"], args["out"]
    experts = args["row_expert"].to(torch.long)
    out.copy_(torch.bmm(x.unsqueeze(1), w[experts]).squeeze(1))
    return out


class RoutedOp:
    name = NAME
    arguments = (
        ArgSpec("x", ArgKind.TENSOR),
        ArgSpec("w", ArgKind.TENSOR),
        ArgSpec("topk_ids", ArgKind.TENSOR),
        ArgSpec("row_expert", ArgKind.TENSOR),
        ArgSpec("out", ArgKind.TENSOR),
    )
    mutable = ()
    derived = ()
    contracts = ()
    scratch = ("out",)
    output_name = "out"

    def rederive(self, args: Args, changed: frozenset[str]) -> dict[str, Any]:
        return dict(args)

    def rederive_routing(self, args: Args) -> dict[str, Any]:
        return {**args, "row_expert": args["topk_ids"].to(torch.int32).clone()}

    def make_scratch(self, args: Args, device: torch.device) -> dict[str, Any]:
        out = args["out"]
        return {"out": torch.zeros(out.shape, dtype=out.dtype, device=device)}

    def run(self, args: Args, backend: KernelBackend) -> torch.Tensor:
        return backend.module("toy_routed_kernels").routed_rows(dict(args))  # type: ignore[no-any-return]

    def reference(self, args: Args) -> ReferenceResult:
        x, w, experts = args["x"], args["w"], args["topk_ids"].to(torch.long)
        rows = x.shape[0]
        output = torch.bmm(x.double().unsqueeze(1), w.double()[experts]).squeeze(1).float()
        index = torch.arange(rows)
        row_map = RowMap(index, experts, torch.zeros(rows, dtype=torch.long), index)
        return ReferenceResult(output, torch.ones(rows, dtype=torch.bool), row_map)


ROUTED = register_op(RoutedOp(), replace=True)


def backend(device: torch.device, name: str) -> KernelBackend:
    module = types.ModuleType("toy_routed_kernels")
    module.routed_rows = _kernel  # type: ignore[attr-defined]
    return ModuleBackend.of_modules("toy-routed", device, {"toy_routed_kernels": module})


def make_args(*, rows: int = 6, k: int = 8, n: int = 5, experts: int = 3, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    topk_ids = torch.randint(0, experts, (rows,), generator=generator, dtype=torch.int32)
    return {
        "x": torch.randn(rows, k, generator=generator),
        "w": torch.randn(experts, k, n, generator=generator),
        "topk_ids": topk_ids,
        "row_expert": topk_ids.clone(),
        "out": torch.zeros(rows, n),
    }


def write_stale_capture(path: Any, args: dict[str, Any]) -> Any:
    """A capture whose output the kernel computed with the metadata the routing implies, but whose recorded
    ``row_expert`` is stale (every row on expert 0)."""
    from moereplay.format import CaptureWriter

    output = _kernel({**args, "out": args["out"].clone()}).clone()
    stale = {**args, "row_expert": torch.zeros_like(args["row_expert"])}
    with CaptureWriter(path) as writer:
        index = writer.begin_call(NAME, stale, site="tests.toy")
        writer.complete_call(index, {"out": output, "return": output})
    return path


THIS_FILE = os.path.abspath(__file__)
SPEC = f"python:{THIS_FILE}"
