"""A CPU stand-in for ``moe_wna16_marlin_gemm`` that combines split-K partial sums the way the kernel's reduction
modes do, for CPU tests of their tolerance (``python:<this file>`` backend).

With ``use_atomic_add``: K (in tiles of 64) is cut into ``SLICES`` contiguous ranges at random tile boundaries;
each range's float32 partial product, times the row's routing weight, is rounded to the output type and added into
the zeroed output in a random order, every add rounding again — so repeats differ, as on the GPU. With
``use_fp32_reduce=False``: the running sum passes through the output type between ranges, in K order. Otherwise:
the exact result rounded once. ``$MARLIN_EMULATOR_CORRUPT_ROW`` (unset: none) names a row scaled by 1.25 — a
stand-in for a kernel bug in these modes; ``$MARLIN_EMULATOR_RANDOM_CUTS`` cuts K differently every run (a
16-bit reduction that is nondeterministic, which it should not be). Routing weights are taken as given (tests pass float32).
"""

from __future__ import annotations

import itertools
import os
import types
from typing import Any

import torch

from moereplay.ops.base import KernelBackend
from moereplay.reference import scalar_types as st
from moereplay.reference.marlin_formats import MarlinExpertWeights
from moereplay.reference.marlin_moe import reference_moe_wna16_marlin_gemm
from moereplay.reference.scalar_types import ScalarType
from moereplay.replay.backends import ModuleBackend

THIS_FILE = os.path.abspath(__file__)
SPEC = f"python:{THIS_FILE}"
SLICES = 6
TILE = 64


def _partials(
    kwargs: dict[str, Any], rows: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor
) -> list:
    weights = MarlinExpertWeights.from_kernel_args(
        b_qweight=kwargs["b_qweight"],
        b_scales=kwargs["b_scales"],
        b_q_type=st.as_scalar_type(kwargs["b_q_type"]),
        activation_dtype=kwargs["input"].dtype,
        size_k=kwargs["size_k"],
        size_n=kwargs["size_n"],
        global_scale=kwargs.get("global_scale"),
    )
    dense = weights.dequantize()
    x = kwargs["input"].float()[tokens]  # [rows, K]
    w = dense[experts]  # [rows, K, N]
    tiles = kwargs["size_k"] // TILE
    cut_order = torch.randperm(tiles - 1) if os.environ.get("MARLIN_EMULATOR_RANDOM_CUTS") else None
    if cut_order is None:  # the same cuts every run, as one launch configuration gives
        cut_order = torch.randperm(tiles - 1, generator=torch.Generator().manual_seed(0))
    cuts = sorted((cut_order[: SLICES - 1] + 1).tolist())
    bounds = [0, *cuts, tiles]
    return [
        torch.einsum("rk,rkn->rn", x[:, a * TILE : b * TILE], w[:, a * TILE : b * TILE])
        for a, b in itertools.pairwise(bounds)
    ]


def moe_wna16_marlin_gemm(**kwargs: Any) -> torch.Tensor:
    result = reference_moe_wna16_marlin_gemm(**kwargs)
    output = kwargs["output"]
    dtype = output.dtype
    written = result.written
    rows = torch.nonzero(written).reshape(-1)
    weight = result.row_weights[rows][:, None]
    if kwargs["use_atomic_add"] or not kwargs["use_fp32_reduce"]:
        partials = _partials(kwargs, rows, result.row_map.expert[rows], result.row_map.input_row[rows])
        if kwargs["use_atomic_add"]:
            total = torch.zeros((rows.numel(), output.shape[1]), dtype=dtype)
            for index in torch.randperm(len(partials)).tolist():
                total = (total.float() + (partials[index] * weight).to(dtype).float()).to(dtype)
            values = total.float()
        else:
            running = torch.zeros_like(partials[0])
            for index, partial in enumerate(partials):
                running = running + partial
                if index < len(partials) - 1:
                    running = running.to(dtype).float()
            values = running * weight
    else:
        values = result.output[rows]
    corrupt = os.environ.get("MARLIN_EMULATOR_CORRUPT_ROW")
    if corrupt is not None:
        values[rows == int(corrupt)] *= 1.25
    output[rows] = values.to(dtype)
    return output


def backend(device: torch.device, name: str) -> KernelBackend:
    ops = types.ModuleType("vllm._custom_ops")
    ops.moe_wna16_marlin_gemm = moe_wna16_marlin_gemm  # type: ignore[attr-defined]
    scalar_type = types.ModuleType("vllm.scalar_type")
    scalar_type.ScalarType = ScalarType  # type: ignore[attr-defined]
    modules = {"vllm._custom_ops": ops, "vllm.scalar_type": scalar_type}
    return ModuleBackend.of_modules("marlin-atomic-emulator", device, modules)
