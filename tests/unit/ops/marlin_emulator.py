"""A CPU stand-in for vLLM's ``moe_wna16_marlin_gemm`` that reads memory the way the kernel does, for CPU tests of
what runs the Marlin op end to end (replay engine, shape bisection) where no GPU is.

It computes the kernel's semantics with moereplay's exact reference, except for what matters to the failures under
test: ``topk_weights`` is read as **float32 from its data pointer**, one value per output row — so bf16 routing
weights are misread and rows past half the buffer read past its end (into replay's guard band), exactly the
published report's mechanism; and only the rows the routing names are written into ``output`` (others keep the
zeros replay gives it). The host code's shape checks that matter for shrunk calls are made: a tile must divide
``size_n`` / ``size_k``.

Loaded as a backend with ``python:<this file>``: ``module("vllm._custom_ops").moe_wna16_marlin_gemm(**kwargs)``
and ``module("vllm.scalar_type").ScalarType.from_id``, as :meth:`MarlinMoeOp.run` calls them.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from moereplay.ops.base import KernelBackend
from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm
from moereplay.reference.scalar_types import ScalarType
from moereplay.replay.backends import ModuleBackend

THIS_FILE = os.path.abspath(__file__)
SMALL_TILES = ((128, 128), (64, 128), (128, 64))
LARGE_TILES = ((64, 256), (64, 128), (128, 64))


def _float32_loads(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` float32 values from ``tensor``'s data pointer on, whatever its dtype (past its end if shorter)."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    start = tensor.storage_offset() * tensor.element_size()
    return raw[start : start + 4 * count].view(torch.float32).clone()


def moe_wna16_marlin_gemm(**kwargs: Any) -> torch.Tensor:
    size_m, size_n, size_k, top_k = kwargs["size_m"], kwargs["size_n"], kwargs["size_k"], kwargs["top_k"]
    tiles = SMALL_TILES if kwargs["moe_block_size"] <= 16 else LARGE_TILES
    if kwargs.get("thread_k", -1) != -1:
        tiles = ((kwargs["thread_k"], kwargs["thread_n"]),)
    if not any(size_k % k == 0 and size_n % n == 0 for k, n in tiles):
        raise RuntimeError(f"Invalid thread config for MKN = [{size_m}, {size_k}, {size_n}]")
    rows = size_m * top_k
    read = dict(kwargs)
    read["topk_weights"] = _float32_loads(kwargs["topk_weights"], rows)
    result = reference_moe_wna16_marlin_gemm(**read)
    output = kwargs["output"]
    if output is None:
        output = torch.zeros((rows, size_n), dtype=kwargs["input"].dtype, device=kwargs["input"].device)
    output[result.written] = result.output[result.written].to(output.dtype)
    return output


def backend(device: torch.device, name: str) -> KernelBackend:
    ops = types.ModuleType("vllm._custom_ops")
    ops.moe_wna16_marlin_gemm = moe_wna16_marlin_gemm  # type: ignore[attr-defined]
    scalar_type = types.ModuleType("vllm.scalar_type")
    scalar_type.ScalarType = ScalarType  # type: ignore[attr-defined]
    modules = {"vllm._custom_ops": ops, "vllm.scalar_type": scalar_type}
    return ModuleBackend.of_modules("marlin-emulator", device, modules)


SPEC = f"python:{THIS_FILE}"
